"""``python -m oppo_ds.train`` and ``deepspeed --module oppo_ds.train``: see oppo_ds.cli.train."""
import sys

from .cli.train import main

if __name__ == "__main__":
    sys.exit(main())
