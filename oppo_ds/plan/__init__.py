"""oppo-plan: per-GPU memory and a discrete-event simulation of the PPO step (see
docs/scaling.md). Pure calculation: nothing here builds a model or touches a device."""
