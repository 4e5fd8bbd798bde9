"""oppo-ds: PPO-based RLHF with pipeline overlap (OPPO) on DeepSpeed."""

__version__ = "0.1.0"
