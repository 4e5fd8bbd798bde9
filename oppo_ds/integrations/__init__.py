"""Bridges from other RLHF stacks to OPPO's rollout.

  * ``deepspeed_chat``: DeepSpeed-Chat step 3. ``OppoExperience`` replaces
    ``DeepSpeedPPOTrainer.generate_experience`` with chunked decoding, streaming scorers and
    overcommitment on DeepSpeed-Chat's own engines, returning its experience dict unchanged
    in form; ``add_arguments`` / ``enable_oppo`` are the two calls the patch in
    ``patches/deepspeed-chat/`` adds to its ``main.py``.
  * ``rollout_engine``: ``OppoRolloutEngine``, an implementation of DeepSpeed's own
    ``deepspeed.runtime.rollout.RolloutEngine`` interface.

``import oppo_ds.integrations`` imports neither DeepSpeed nor the models: each module loads
what it needs when it is imported.
"""
