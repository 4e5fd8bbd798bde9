"""``python -m oppo_ds.train`` and ``deepspeed --module oppo_ds.train``: see oppo_ds.cli.train."""
from .cli.train import entry

if __name__ == "__main__":
    entry()
