"""Peers: other RLHF trainers run on our workload, so that the benchmark can put their speed
and reward next to ours.

Each peer loads the same config (YAML + overrides) as a mode of ``oppo-bench``, resolves the
same models, tokenizer and prompts through our code, trains with the other project's own
trainer (called, never copied), and writes per-step rows in our ``metrics.jsonl`` format
(the keys :func:`oppo_ds.bench.summarize_mode` reads).

* :mod:`oppo_ds.peers.trl_peer`: TRL 1.12's ``PPOTrainer`` (``pip install 'oppo-ds[peer]'``).

Importing this package (or a peer's module) never imports the peer's library; a missing
library is reported when a peer runs.
"""
