"""The ``ppo`` section of the configuration (``oppo_ds.config.Config.ppo``): the algorithm's
settings, from the batch and its mini- and micro-batches to the estimators, the KL, the losses
and dynamic sampling. Like every section it is a dataclass with a docstring under each field
(``docs/config.md`` is made of them) and checks in ``__post_init__`` that name the key;
``oppo_ds.config`` loads it with the others and checks what spans sections.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from .config_types import require as _require


@dataclass
class PPOConfig:
    batch_size: int = 16
    """B: sequences whose experience one PPO step trains on, per data-parallel rank."""
    mini_batch_size: int = 8
    """Sequences per optimizer update, per rank (batch_size must be a multiple)."""
    micro_batch_size: int = 8
    """Sequences per forward/backward, per rank: a memory knob only, it does not change the
    gradient (token-level loss aggregation). Also the rows of each no-grad forward that scores
    the experience (old log-probs, values, reference, reward) unless ppo.score_batch_tokens is
    set. With ppo.micro_batch_tokens the update's micro-batches are sized by tokens instead, and
    this sets the engines' accumulation steps (mini_batch_size / micro_batch_size), by which
    each micro-batch's loss is divided."""
    micro_batch_tokens: Optional[int] = None
    """Micro-batches of the PPO update sized by tokens (OpenRLHF's --use_dynamic_batch with
    --train_max_tokens_per_gpu, verl's ppo_max_token_len_per_gpu): at most this many token
    positions per forward/backward of actor and critic, per rank, padding included (rows x
    their longest prompt + longest response, or the packed rows under
    system.packing_samples). Each mini-batch is split, longest sequences first, into the
    fewest micro-batches within the budget; every rank makes as many as the rank that needs
    most. Like ppo.micro_batch_size it does not change the update (1e-5 in fp32, summation
    order); train/micro_batches logs the count. Under PPO-ptx each sequence also counts the
    pretraining block that goes with it into the backward (data.ptx_block_len), while the
    actor trains (not in ppo.freeze_actor_steps). At least one sequence of the longest,
    generation.max_prompt_len + max_new_tokens (+ a block under PPO-ptx). null = off:
    ppo.micro_batch_size sequences each."""
    score_batch_tokens: Optional[int] = None
    """The no-grad forwards that score the experience after the rollout (the actor's old
    log-probs, the critic's values, the reference's log-probs, the reward model's scores, and
    an evaluation's scores) sized by tokens, as ppo.micro_batch_tokens sizes the update's
    (OpenRLHF's --rollout_max_tokens_per_gpu): at most this many token positions a forward,
    padding included, longest sequences first; where those forwards are collective (ZeRO-3's
    actor and critic, a partitioned reference) every rank makes as many as the rank that
    needs most. The scores are the same (1e-5 in fp32). The streaming scorers prefill chunks
    and are not sized by it. At least generation.max_prompt_len + max_new_tokens. null = off:
    ppo.micro_batch_size sequences each."""
    ppo_epochs: int = 1
    """Passes over one step's experience."""
    freeze_actor_steps: int = 0
    """Steps at the start in which only the critic trains (OpenRLHF's --freezing_actor_steps):
    a critic started from the reward model first learns the values of the starting policy, so
    the actor's first updates follow advantages of a fitted critic. The actor, its PPO-ptx
    loss and its learning-rate schedule wait; those steps log no policy loss."""
    actor_lr: float = 5e-4
    """Actor learning rate."""
    critic_lr: float = 1e-3
    """Critic learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay for actor and critic."""
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW's beta1 and beta2 for actor and critic (OpenRLHF's --adam_betas, TRL's adam_beta1
    and adam_beta2). The default is DeepSpeed-Chat's and OpenRLHF's; TRL's is [0.9, 0.999]. A
    resume takes this run's values, as it takes the learning rates (the change is logged)."""
    adam_eps: float = 1e-8
    """AdamW's epsilon for actor and critic (TRL's adam_epsilon). A resume takes this run's."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate decay after warm-up."""
    warmup_steps: int = 0
    """Optimizer updates of linear learning-rate warm-up."""
    grad_clip: Optional[float] = 1.0
    """Gradient-norm clipping (null or 0 = off, on either backend)."""
    kl_coef: float = 0.05
    """Coefficient of the per-token KL penalty against the reference model (beta). 0 turns the
    KL off and, as in OpenRLHF (--init_kl_coef 0), no reference model is built, loaded or run
    (model.reference and the partition_reference keys must then be unset); kl/mean is then not
    logged."""
    kl_estimator: Literal["k1", "k3", "abs", "mse"] = "k1"
    """Per-token KL estimator: the one taken off the rewards (kl_penalty: reward) or added
    to the actor's loss (kl_penalty: loss), and the one kl/mean (and so kl_target) sums."""
    kl_penalty: Literal["reward", "loss"] = "reward"
    """Where the KL to the reference enters: `reward` takes ppo.kl_coef x the per-token
    estimate off the rewards (InstructGPT, DeepSpeed-Chat, TRL), so it goes through the critic
    and GAE; `loss` adds ppo.kl_coef x the estimate to the actor's loss instead, aggregated
    over tokens and responses as the policy loss is (ppo.loss_agg_mode) (GRPO's,
    OpenRLHF's --use_kl_loss), with kl_estimator mse or k3 (k1's gradient is zero in
    expectation). kl/mean is logged either way, and kl_target adapts the coefficient of either."""
    kl_target: Optional[float] = None
    """Adaptive KL coefficient (Ziegler et al. 2019, section 2.2; OpenRLHF's --kl_target, the
    adap_kl_ctrl of TRL's former PPOTrainer): after every step the coefficient is multiplied
    by 1 + e * n / kl_horizon, where e is the step's KL (kl/mean: summed over a response's
    tokens, averaged over its responses) divided by this target, minus 1, clipped to
    [-0.2, 0.2], and n the responses the step trained on, all ranks together. ppo.kl_coef is
    where it starts; kl/coef logs it. null = the coefficient stays ppo.kl_coef."""
    kl_horizon: int = 10000
    """Responses over which the adaptive KL coefficient closes its gap to ppo.kl_target."""
    reward_clip: Optional[float] = 5.0
    """Clip the sequence reward to [-reward_clip, reward_clip] (null = off)."""
    ptx_coef: float = 0.0
    """Weight of the pretraining language-modelling loss on data.ptx added to the actor's
    PPO loss (PPO-ptx; DeepSpeed-Chat's --unsup_coef, OpenRLHF's --ptx_coef); 0 = off. The
    loss is the mean negative log-likelihood per token, so the scale is the policy loss's."""
    missing_eos_penalty: Optional[float] = None
    """Subtracted from the reward of a response that reached generation.max_new_tokens
    without an end id (TRL's missing_eos_penalty), after reward_clip, so that truncated
    responses do not earn the reward of finished ones; null = off. The share of such
    responses is logged as response/truncated_frac either way."""
    overlong_buffer_len: int = 0
    """DAPO's overlong reward shaping (OpenRLHF's --overlong_buffer_len): a response longer
    than generation.max_new_tokens - overlong_buffer_len tokens loses reward for every token it
    runs into that buffer, linearly up to ppo.overlong_penalty_factor at the limit; taken off
    after reward_clip, beside missing_eos_penalty (the two add up). The mean penalty is logged
    as reward/overlong_penalty. 0 = off."""
    overlong_penalty_factor: float = 1.0
    """The overlong penalty at generation.max_new_tokens (OpenRLHF's --overlong_penalty_factor);
    used with ppo.overlong_buffer_len > 0."""
    mask_truncated_completions: bool = False
    """Leave the responses that reached generation.max_new_tokens without an end id out of the
    actor's loss (TRL GRPO's mask_truncated_completions, DAPO's overlong filtering): their
    tokens get no policy gradient, entropy bonus or KL-in-the-loss, and the actor's loss
    aggregation (ppo.loss_agg_mode) counts only the other responses' tokens and responses, as
    if the truncated ones were not in the batch. They still count everywhere else: their
    scores in the group baselines, whitening and kl/mean, and the critic (its value loss)
    trains on them. response/truncated_frac logs their share. A mini-batch left with no
    response still takes its optimizer step, with a zero gradient."""
    filter_groups: bool = False
    """DAPO's dynamic sampling (verl's algorithm.filter_groups, OpenRLHF's
    --dynamic_filtering): a prompt whose responses all got the same score (a 0/1 checker's
    all right or all wrong) gives each of them a group advantage of 0 and the actor nothing
    to learn; it is dropped, and more prompts are generated and scored in its place until
    the batch holds only prompts whose scores differ, or ppo.filter_groups_max_rounds rounds
    have run (then dropped prompts fill the rest, logged as filter/fallback_groups). The
    scores compared are the reward model's or model.reward_function's, before reward_clip
    and the penalties. Every rank runs as many rounds as the rank that needs most; prompts a
    rank generated beyond its need are not trained on (filter/surplus_groups);
    filter/dropped_groups, filter/rounds and filter/prompts_drawn (all ranks) log the rest;
    the streaming metrics add up every round's rollouts, the chunk-size controller sees the
    first round's only. With oppo.overcommit a later round is one more take from the rollout
    pool, whose deferred responses are part-decoded already: the pool is topped up to the
    prompts missing + Delta and decoded until that many finish; a rank's surplus goes back
    to the pool (taken first next step) and the pool's ledger counts the dropped prompts.
    ppo.filter_groups_reward_range chooses OpenRLHF's rule (the mean score inside a range)
    instead. Needs a group baseline (advantage_estimator rloo, reinforce_baseline or
    group_norm). A model replica's ranks (system.backend: megatron) drop the same prompts
    and count them once."""
    filter_groups_max_rounds: int = 4
    """Generation rounds per step at most under ppo.filter_groups, the first included (verl's
    max_num_gen_batches)."""
    filter_groups_reward_range: Optional[list[float]] = None
    """Under ppo.filter_groups, OpenRLHF's rule instead of DAPO's (its
    --dynamic_filtering_reward_range): [low, high] keeps a prompt whose responses' mean score
    lies strictly between low and high, and drops the others. For 0/1 scores [0, 1] is DAPO's
    rule; [0.1, 0.9] also drops the prompts that 90% or more of the responses get right, or
    wrong. null: DAPO's rule (the scores not all equal)."""
    filter_groups_oversample: float = 1.0
    """Under ppo.filter_groups a later round generates this many times the prompts the batch
    still lacks (rounded up), for fewer rounds when many prompts are dropped (verl generates
    whole batches). The prompts it keeps beyond the batch are a surplus
    (filter/surplus_groups): with oppo.overcommit they go back to the rollout pool, taken
    first next step; without, they are not trained on. Such a round decodes up to this many
    times the batch (plus Delta): `oppo-plan` sizes the caches for it."""
    advantage_estimator: Literal["gae", "reinforce", "rloo", "reinforce_baseline", "group_norm"] = "gae"
    """How advantages are estimated (OpenRLHF's --advantage_estimator). `gae`: PPO's, with a
    critic. The others train no critic (none is built, checkpointed or exported; its keys are
    unused): each response's score, after reward_clip, missing_eos_penalty and the overlong
    penalty, less a baseline from the other responses to its prompt
    (data.samples_per_prompt >= 2 of them), is its reward at the last token; advantages are
    the rewards (the KL penalty's included) summed from each token to the end with gamma,
    then whitened if whiten_advantages.
    `reinforce`: no baseline (REINFORCE++); `rloo`: minus the mean of the prompt's other
    responses (RLOO); `reinforce_baseline`: minus the mean of all of them; `group_norm`:
    minus that mean, divided by their standard deviation (GRPO; its paper puts the KL in the
    loss, ppo.kl_penalty: loss, and does not whiten, ppo.whiten_advantages: false). Under
    oppo.overcommit the pool takes a prompt's responses together: a prompt counts as finished
    when all of them have."""
    gamma: float = 1.0
    """Discount factor of GAE (and of the critic-free estimators' returns)."""
    lam: float = 0.95
    """lambda of GAE."""
    clip_eps: float = 0.2
    """Ratio clipping of the policy loss (epsilon)."""
    clip_eps_high: Optional[float] = None
    """The upper clip range: the ratio of a token with a positive advantage is clipped at
    1 + this (DAPO's clip-higher, e.g. 0.28 beside clip_eps 0.2; OpenRLHF's
    --eps_clip_low_high), so that unlikely tokens can gain more per update; null = clip_eps."""
    dual_clip: Optional[float] = None
    """Dual-clip PPO (Ye et al. 2020; OpenRLHF's --dual_clip): the loss of a token with a
    negative advantage A is capped at dual_clip x |A|, so a ratio far above 1 (a token
    sampled by an older policy, a stale deferred row) cannot dominate the update; > 1,
    null = off. policy/dual_clip_frac logs the share it capped."""
    value_clip_eps: float = 0.2
    """Clipping of the value loss around the old values."""
    whiten_rewards: bool = False
    """Rescale the per-token rewards (KL penalty and score) to unit variance over the step's
    batch, all ranks together, keeping their mean, before GAE (TRL's whiten_rewards): the
    critic then learns returns of one scale whatever the reward model's."""
    whiten_advantages: bool = True
    """Normalise advantages to mean 0, variance 1 over the step's batch (all ranks)."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient in the policy loss (the loss less entropy_coef x the token
    entropy; below 0 a penalty on entropy)."""
    loss_agg_mode: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = "token_mean"
    """How the actor's per-token losses (policy, entropy bonus, KL in the loss) become one
    number per mini-batch, over all its micro-batches and ranks. `token_mean`: every token
    weighs the same (DeepSpeed-Chat's and OpenRLHF's PPO, DAPO; TRL GRPO's loss_type dapo);
    `seq_mean_token_mean`: each response's tokens averaged, then the responses (the GRPO
    paper's objective; TRL's loss_type grpo), so a long response's tokens weigh less;
    `seq_mean_token_sum_norm`: each response's token sum over generation.max_new_tokens, then
    the responses (Dr. GRPO; TRL's loss_type dr_grpo), without that length bias. The
    critic's value loss stays the token mean."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """Where the policy ratio pi_theta / pi_old is taken (TRL GRPO's key of the same name).
    `token`: per token (PPO's). `sequence`: per response, the geometric mean of its tokens'
    ratios, clipped as a whole, on each of its tokens (GSPO, Zheng et al. 2025, with which
    Qwen3 was trained; its paper clips at ppo.clip_eps 3e-4 / clip_eps_high 4e-4, since a
    mean ratio moves far less than a token's, and averages per response,
    seq_mean_token_mean). Truncated importance sampling (oppo.off_policy) still weighs each
    token."""

    def __post_init__(self):
        for key in ("batch_size", "mini_batch_size", "micro_batch_size", "ppo_epochs"):
            _require(getattr(self, key) >= 1, key, f"must be >= 1, got {getattr(self, key)}")
        _require(self.freeze_actor_steps >= 0, "freeze_actor_steps",
                 f"must be >= 0, got {self.freeze_actor_steps}")
        _require(self.batch_size % self.mini_batch_size == 0, "mini_batch_size",
                 f"must divide batch_size ({self.batch_size}), got {self.mini_batch_size}")
        _require(self.mini_batch_size % self.micro_batch_size == 0, "micro_batch_size",
                 f"must divide mini_batch_size ({self.mini_batch_size}), got {self.micro_batch_size}")
        for key in ("micro_batch_tokens", "score_batch_tokens"):
            _require(getattr(self, key) is None or getattr(self, key) >= 1, key,
                     f"must be >= 1 or null, got {getattr(self, key)}")
        for key in ("gamma", "lam"):
            _require(0.0 <= getattr(self, key) <= 1.0, key, "must be in [0, 1]")
        for key in ("actor_lr", "critic_lr", "clip_eps", "value_clip_eps"):
            _require(getattr(self, key) > 0, key, "must be > 0")
        _require(self.clip_eps_high is None or self.clip_eps_high > 0, "clip_eps_high",
                 f"must be > 0 or null, got {self.clip_eps_high}")
        _require(self.dual_clip is None or self.dual_clip > 1, "dual_clip",
                 f"must be > 1 or null (the bound is dual_clip x |advantage|), got {self.dual_clip}")
        _require(self.kl_coef >= 0, "kl_coef", "must be >= 0")
        for key in ("weight_decay", "warmup_steps"):
            _require(getattr(self, key) >= 0, key, f"must be >= 0, got {getattr(self, key)}")
        _require(len(self.adam_betas) == 2 and all(0 <= b < 1 for b in self.adam_betas),
                 "adam_betas", f"must be two numbers in [0, 1) (beta1, beta2), got "
                 f"{self.adam_betas}")
        _require(self.adam_eps > 0, "adam_eps", f"must be > 0, got {self.adam_eps}")
        _require(self.grad_clip is None or self.grad_clip >= 0, "grad_clip",
                 f"must be >= 0 or null (null or 0 = off), got {self.grad_clip}")
        _require(self.reward_clip is None or self.reward_clip > 0, "reward_clip",
                 f"must be > 0 or null (null = off), got {self.reward_clip}")
        _require(self.kl_penalty == "reward" or self.kl_estimator in ("mse", "k3"), "kl_estimator", (
            f"{self.kl_estimator} with kl_penalty: loss: as a loss only mse's and k3's gradients "
            "pull the policy toward the reference (k1's is zero in expectation); use mse or k3"))
        _require(self.kl_target is None or self.kl_target > 0, "kl_target",
                 f"must be > 0 or null, got {self.kl_target}")
        _require(self.kl_horizon >= 1, "kl_horizon", f"must be >= 1, got {self.kl_horizon}")
        _require(self.kl_target is None or self.kl_coef > 0, "kl_coef", (
            "must be > 0 with ppo.kl_target set: the adaptive coefficient is multiplied from it, "
            "and from 0 it would stay 0"))
        _require(self.ptx_coef >= 0, "ptx_coef", f"must be >= 0, got {self.ptx_coef}")
        _require(self.missing_eos_penalty is None or self.missing_eos_penalty >= 0,
                 "missing_eos_penalty", f"must be >= 0 or null, got {self.missing_eos_penalty}")
        _require(self.overlong_buffer_len >= 0, "overlong_buffer_len",
                 f"must be >= 0 (0 = off), got {self.overlong_buffer_len}")
        _require(self.overlong_penalty_factor >= 0, "overlong_penalty_factor",
                 f"must be >= 0, got {self.overlong_penalty_factor}")
        _require(self.filter_groups_max_rounds >= 1, "filter_groups_max_rounds",
                 f"must be >= 1 (the first round included), got {self.filter_groups_max_rounds}")
        _require(self.filter_groups_reward_range is None or (
            len(self.filter_groups_reward_range) == 2
            and self.filter_groups_reward_range[0] < self.filter_groups_reward_range[1]),
            "filter_groups_reward_range",
            f"must be [low, high] with low < high, or null, got {self.filter_groups_reward_range}")
        _require(self.filter_groups_reward_range is None or self.filter_groups,
                 "filter_groups_reward_range", "is the rule of ppo.filter_groups: set "
                 "ppo.filter_groups: true with it, or leave it null")
        _require(self.filter_groups_oversample >= 1.0, "filter_groups_oversample",
                 f"must be >= 1 (a round generates at least what the batch lacks), got "
                 f"{self.filter_groups_oversample}")
        _require(self.uses_critic or not self.freeze_actor_steps, "freeze_actor_steps",
                 f"must be 0 with advantage_estimator {self.advantage_estimator}: the frozen "
                 f"steps train the critic alone, and this estimator has none")

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates of each trained model per PPO step: ppo_epochs x mini-batches."""
        return self.ppo_epochs * (self.batch_size // self.mini_batch_size)

    @property
    def uses_critic(self) -> bool:
        """Whether the advantages come from a critic (``gae``), which is then built and trained."""
        return self.advantage_estimator == "gae"

    @property
    def uses_reference(self) -> bool:
        """Whether the KL to a reference model is used (``kl_coef`` > 0), which is then built."""
        return self.kl_coef > 0

    @property
    def group_baseline(self) -> bool:
        """Whether the estimator compares each response with the others to its prompt
        (``algo.GROUP_ESTIMATORS``), so that a batch must hold all of them."""
        return self.advantage_estimator in ("rloo", "reinforce_baseline", "group_norm")
