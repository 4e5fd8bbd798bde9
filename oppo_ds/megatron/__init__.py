"""The Megatron-core backend's building blocks (docs/megatron.md): CPU compatibility fixes
(``compat``), HF <-> Megatron weights (``convert``), a rank's shard read from safetensors
files (``loading``), process groups and the pipeline's communication (``parallel``), and the
HF-style model over a GPTModel (``model``). The engine is
``oppo_ds/engines/megatron_engine.py``. Nothing here is imported by ``oppo_ds`` itself:
megatron-core is an optional dependency (the ``megatron`` extra)."""
