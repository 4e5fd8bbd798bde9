"""Configuration: dataclasses are the single source of truth.

Each field has a docstring under it (``oppo_ds.config_docs`` makes ``docs/config.md`` of them);
defaults live only here. YAML files and dotted command-line overrides (``ppo.kl_coef=0.05``)
are checked against these classes (``oppo_ds.config_types`` converts them): an unknown key
or a value of the wrong type or outside the allowed set raises ``ConfigError`` naming the key
and what is allowed.

Algorithm settings (``ppo``, ``generation``) are kept apart from speed/memory settings
(``oppo``, ``system``, micro-batch size): changing the latter must not change the math.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

import yaml

from .config_checks import check_across_sections
from .config_paths import local_paths
from .config_ppo import PPOConfig
from .config_system import SystemConfig
from .config_types import ConfigError, build_dataclass
from .config_types import require as _require
from .config_yaml import parse_override, read_config_file, set_dotted

__all__ = ["CheckpointConfig", "Config", "ConfigError", "DataConfig", "EvalConfig", "FROZEN_KINDS",
           "GenerationConfig", "LoggingConfig", "ModelConfig", "OppoConfig", "PPOConfig",
           "SCORER_KINDS", "SystemConfig", "WorkloadConfig", "load_config", "save_config"]

# the models that score sequences chunk by chunk (``rollout.scorer.StreamingScorer``), and the
# frozen ones among them, which never train: their caches of a row outlive an update
SCORER_KINDS = ("reward", "reference", "critic")
FROZEN_KINDS = ("reward", "reference")


def _require_seed(seed: int, key: str) -> None:
    """numpy's (and DeepSpeed-Chat's) seeds are 32-bit: numpy refused another only when the
    run started ("Seed must be between 0 and 2**32 - 1")."""
    _require(0 <= seed < 2**32, key, f"must be in [0, 2**32 - 1] (a 32-bit seed), got {seed}")


@dataclass
class ModelConfig:
    actor: str = "builtin"
    """Actor (policy) to train: a local Hugging Face checkpoint directory, `builtin` (the
    built-in workload's supervised-tuned actor, prepared on first use) or a tiny architecture
    built from config with random weights (`tiny-llama`, `tiny-qwen2`, `tiny-gpt2`)."""
    reference: Optional[str] = None
    """Frozen reference model for the KL penalty; null = the same checkpoint as `actor`."""
    reward: str = "builtin"
    """Reward model (LM body + scalar head): a local directory, `builtin` or a tiny architecture."""
    critic: Optional[str] = None
    """Critic (value model); null = initialised from `reward`, as DeepSpeed-Chat does."""
    reward_function: Optional[Union[str, list[str]]] = None
    """A Python function that scores the responses in place of the reward model (TRL's
    reward_funcs, OpenRLHF's reward-function file): `package.module:function` or
    `path/to/file.py:function`, called on each batch of finished responses as
    fn(prompts=[...], completions=[...], **fields) and returning one finite number per
    response; prompts as the data file holds them, completions as decoded text, and one list
    per other field of the prompt rows (e.g. answer=[...], None where a row lacks it). A list
    of functions scores with their weighted sum (`reward_weights`), as TRL's list does: each
    may return None for a response it does not apply to, which then counts 0 in the sum, but
    every response needs a number from at least one; each function's mean is logged as
    reward_fn/<name>/mean. No reward model is then built or streamed (model.reward is only
    where the critic starts, with model.critic null). Under system.backend: megatron every rank
    of a model replica calls it and the replica trains on its first rank's scores.
    `oppo_ds.workload:gold_reward` is the built-in task's hidden rule. Null: the reward model
    scores."""
    reward_weights: Optional[list[float]] = None
    """One weight per function of `reward_function` (TRL's reward_weights): the score is the
    sum of each function's score times its weight. Null: 1 for each."""
    reward_normalize: bool = False
    """Score with the reward model's own normalisation, (score - mean) / std, from the `mean`
    and `std` its config.json holds: what OpenRLHF's reward-model training writes with
    --normalize_reward and its PPO applies with --normalize_reward. The run stops if the
    checkpoint holds none. reward/mean and the samples show the normalised scores."""
    tokenizer: Optional[str] = None
    """Tokenizer directory; null = the actor's directory (or the built-in tokenizer)."""
    trust_remote_code: bool = False
    """Allow model code shipped inside a checkpoint directory to run (off by default)."""
    builtin_arch: Literal["tiny-llama", "tiny-qwen2", "tiny-gpt2", "qwen2.5-0.5b", "qwen2.5-1.5b",
                          "qwen2.5-7b"] = "tiny-llama"
    """Architecture of the built-in workload's models; the real shapes (qwen2.5-*) only with
    `workload.kind: length_oracle` (random weights, built from config)."""
    actor_lora_dim: int = 0
    """LoRA rank added to the actor's linear layers named by `lora_module_name` (0 = off).
    Each such layer's weight is frozen and learns through its LoRA matrices (its bias and the
    layers without LoRA still train, as in DeepSpeed-Chat; only_optimize_lora freezes those).
    The LoRA weights are merged into the base weights for export."""
    critic_lora_dim: int = 0
    """LoRA rank added to the critic's linear layers named by `lora_module_name` (0 = off),
    their weights frozen as the actor's."""
    lora_module_name: str = "layers."
    """LoRA goes into every `nn.Linear` whose qualified name contains this text (Llama/Qwen2
    decoder layers: `layers.`; GPT-2: `h.`)."""
    lora_alpha: Optional[float] = None
    """LoRA scale numerator: the update is (alpha / rank) * R L (null = alpha equal to the
    rank, i.e. scale 1)."""
    lora_learning_rate: Optional[float] = None
    """Peak learning rate of the LoRA matrices of actor and critic, in an optimizer parameter
    group of their own with ppo.weight_decay, under the same schedule as the rest of the
    model (DeepSpeed-Chat's --actor_lora_learning_rate / --critic_lora_learning_rate; its
    LoRA scripts train LoRA at 5e-4 beside a base rate near 1e-5). Null: ppo.actor_lr /
    ppo.critic_lr, in the model's groups. Used with a LoRA dim > 0 (system.backend:
    deepspeed); set or null, it must be as in the run a resume continues (it changes the
    optimizer's groups)."""
    only_optimize_lora: bool = False
    """Freeze every weight except the LoRA matrices (and the critic's value head), so the
    optimizer states are those of the LoRA weights only. Needs a LoRA dim > 0."""
    actor_ema: bool = False
    """Keep an exponential moving average of the actor's weights, updated after every PPO
    step from the starting weights, checkpointed, and exported to output_dir/actor_ema
    (DeepSpeed-Chat's and OpenRLHF's --enable_ema). Costs an fp32 copy of what each rank holds
    of the actor, on its device."""
    actor_ema_beta: float = 0.992
    """The average's decay: ema = beta * ema + (1 - beta) * weights (DeepSpeed-Chat's 0.992)."""

    def __post_init__(self):
        _require(0.0 <= self.actor_ema_beta <= 1.0, "actor_ema_beta",
                 f"must be in [0, 1], got {self.actor_ema_beta}")
        for key in ("actor_lora_dim", "critic_lora_dim"):
            _require(getattr(self, key) >= 0, key, f"must be >= 0, got {getattr(self, key)}")
        _require(self.lora_alpha is None or self.lora_alpha > 0, "lora_alpha", "must be > 0 or null")
        _require(self.lora_learning_rate is None or self.lora_learning_rate > 0,
                 "lora_learning_rate", f"must be > 0 or null, got {self.lora_learning_rate}")
        _require(not self.only_optimize_lora or self.actor_lora_dim or self.critic_lora_dim,
                 "only_optimize_lora", "needs actor_lora_dim or critic_lora_dim > 0")
        _require(self.lora_learning_rate is None or self.actor_lora_dim or self.critic_lora_dim,
                 "lora_learning_rate", f"{self.lora_learning_rate} needs actor_lora_dim or "
                 "critic_lora_dim > 0 (no LoRA matrices to train at it); null without LoRA")
        functions = self.reward_functions
        _require(self.reward_function != [], "reward_function",
                 "is an empty list: name at least one function, or null for the reward model")
        _require(self.reward_weights is None or functions, "reward_weights",
                 "weighs the functions of model.reward_function, which is null: set both, or "
                 "neither (the reward model scores)")
        _require(self.reward_weights is None or len(self.reward_weights) == len(functions),
                 "reward_weights", f"has {len(self.reward_weights or ())} weight(s) for the "
                 f"{len(functions)} function(s) of model.reward_function: one each")

    @property
    def reward_functions(self) -> list[str]:
        """``reward_function`` as a list (none for the reward model)."""
        if self.reward_function is None:
            return []
        return [self.reward_function] if isinstance(self.reward_function, str) \
            else list(self.reward_function)

    @property
    def uses_reward_model(self) -> bool:
        """Whether a reward model scores (no ``reward_function``), which is then built."""
        return self.reward_function is None


@dataclass
class GenerationConfig:
    max_prompt_len: int = 32
    """Longest prompt in tokens (see data.overlong for longer ones)."""
    max_new_tokens: int = 192
    """Response length limit in tokens."""
    temperature: float = 1.0
    """Sampling temperature; 0 = greedy. Log-probs are those of logits / temperature."""
    top_k: int = 0
    """Keep only the k most likely tokens (0 = off)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1 = off)."""
    eos_token_ids: Union[Literal["auto"], list[int]] = "auto"
    """Token ids that end a response (the token is kept, and scored). `auto`: the ones Hugging
    Face's `generate` stops at for the actor checkpoint (`eos_token_id` of its
    `generation_config.json`, else `config.json`: chat models list their end-of-turn token
    there) and the tokenizer's EOS; or a list of ids."""
    sync_every: int = 1
    """Tokens the actor decodes between two checks, on the host, of which responses ended
    (1 = after every token). On a GPU each check waits for the device; with N > 1 a
    response that ends stays in the batch until the next check (up to N - 1 wasted
    forwards of its row) and the pool's stop rule is settled once every N tokens, for one
    wait per N tokens. What is sampled does not depend on N > 1; on a GPU it is what N = 1
    samples, on a CPU a different stream (inverse-CDF sampling from the same generator
    instead of `torch.multinomial`). On an H100 a wait cost 0.02 ms and blocks of 16 decoded
    3% faster (docs/benchmarks.md, "The second GPU run"), hence the default."""
    static_cache: bool = False
    """Decode at one shape: a KV cache of fixed length and a batch that keeps the responses
    that ended (fed again, their outputs unread), so that every decode forward of a rollout has
    the same shapes, and with `cuda_graph` can be replayed as one CUDA graph. One length for the
    whole run: max_prompt_len + max_new_tokens + sync_every (+ max_new_tokens - 1 with
    overcommitment: a deferred response is continued after its prompt), rounded up to 64;
    with `cuda_graph` one batch too: ppo.batch_size + the largest Delta rows (or a wider
    later round's of ppo.filter_groups), which a smaller rollout or an evaluation's batch fills
    up with padding rows (computed, never read). In
    fp32 the same tokens and log-probs up to float rounding; in bf16 its attention runs by
    another kernel (an explicit mask), a few ulps apart, so draws near a tie may differ, and its
    log-probs are as near the training forward's as the default decode's or nearer. Costs the
    ended rows' share of each forward: little where decoding is host-bound (as on the GPUs
    measured so far), a slower long tail on a CPU. Needs the actor's own Hugging Face forward
    with sdpa or eager attention: not with system.hybrid_engine or backend megatron."""
    cuda_graph: bool = False
    """Capture the actor's one-token forward as a CUDA graph and replay it for every token (one
    launch a token instead of one per kernel). Captured once a run, and again only when the
    weights move in memory (ZeRO-3 gathers them anew for each rollout): every rollout and
    evaluation decodes in the same rows (see static_cache). The static cache and the graph's
    memory are kept from one rollout to the next, through training too.
    Needs static_cache and the actor on a CUDA GPU."""

    def __post_init__(self):
        _require(self.max_prompt_len >= 1, "max_prompt_len", "must be >= 1")
        _require(self.sync_every >= 1, "sync_every", "must be >= 1")
        _require(not self.cuda_graph or self.static_cache, "cuda_graph",
                 "needs static_cache: true (a graph replays one shape)")
        _require(self.eos_token_ids == "auto" or (len(self.eos_token_ids) > 0
                                                  and min(self.eos_token_ids) >= 0),
                 "eos_token_ids", "must be auto or a non-empty list of token ids (>= 0)")
        _require(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")
        _require(self.temperature >= 0, "temperature", "must be >= 0")
        _require(self.top_k >= 0, "top_k", "must be >= 0")
        _require(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")


@dataclass
class OppoConfig:
    """Speed settings of OPPO's two techniques; none of them changes the PPO math."""
    streaming: bool = False
    """Intra-step overlap: the actor hands every chunk of decoded tokens to the scorers, which
    prefill it into their own KV caches while decoding goes on (false = the sequential
    baseline: generate everything, then score)."""
    chunk_size: Union[int, Literal["auto"]] = 16
    """Tokens the actor decodes between two hand-overs to the scorers, or `auto`: start from a
    cost model fitted to two measured calibration steps, then every `chunk_explore_every`
    steps try each of `chunk_candidates` for a step and keep the fastest (logged). `auto`
    decides by measured time, and the chunk size moves streamed scores in their last bits
    (about 1e-7, carried on by the updates): two runs of one config then agree to float
    rounding, not bit for bit. A fixed size gives bit-identical runs."""
    chunk_candidates: list[int] = field(default_factory=lambda: [4, 8, 16, 32, 64])
    """Chunk sizes `auto` chooses from."""
    chunk_explore_every: int = 50
    """Steps between two explorations of the candidates under `auto` (0 = never explore)."""
    stream_to: list[Literal["reference", "critic", "actor"]] = field(
        default_factory=lambda: ["reference", "critic", "actor"])
    """What streams besides the reward model (which always does when streaming is on); the
    others score whole sequences after generation. `actor`: PPO's old log-probs are the ones
    the actor computed as it decoded each token (for a deferred sequence's carried tokens, in
    the prefill that rebuilds its cache under the current weights) instead of one more actor
    forward after generation; the same log-probs up to float rounding. Where DeepSpeed's
    hybrid engine decodes with its inference kernels, whose log-probs differ from the training
    forward's, they are recomputed after generation all the same (logged at start)."""
    placement: Literal["inline", "colocated", "stage"] = "inline"
    """Where scorer prefill runs: inline = between decode chunks in the same thread (the reference
    for correctness); colocated = concurrently on the same devices (a worker thread on CPU, a
    side CUDA stream on GPU; not with backend megatron over tensor_parallel or pipeline_parallel
    above 1, whose forwards are collectives: inline or stage there); stage = on a rank of their
    own, the last one: launch N + 1 ranks (`deepspeed --num_gpus N+1 --module oppo_ds.train
    ...`), N actor ranks train (their own torch.distributed world, so any ZeRO stage and the
    hybrid engine), the last one holds the reward and reference models and receives each chunk
    by point-to-point over a link of its own with each actor rank. The critic trains on the
    actor ranks; when it streams, the scorer rank holds a copy that takes rank 0's weights after
    every update (under backend megatron replica 0 gathers its critic's shards for the send);
    that copy is a whole critic in the scorer rank's memory (`oppo-plan` counts it): leave
    `critic` out of `stream_to` to keep the critic on the actor ranks. With `overcommit` the
    scorer rank keeps the deferred rows in its caches from step to step, as the frozen scorers
    do in the actor's process under the other placements (after a resume it prefills them again
    once). Needs `streaming: true`."""
    stage_timeout_minutes: int = 30
    """Under `placement: stage`: how long each end of a link waits for the other, per message
    and to open it. The scorer rank waits for the next rollout through everything the actor
    ranks do between two (scoring, training, evaluation, a checkpoint save, and at start the
    models' loading): raise it where those can take longer (a 70B save to slow storage). A
    process that ends stops the others at once whatever its value."""
    overcommit: Union[int, Literal["auto"]] = 0
    """Delta: extra sequences started per step beyond batch_size (inter-step overlap). Each step
    decodes batch_size + Delta sequences, keeps the first batch_size that finish and carries the
    others, with what they generated, into the next step. `auto`: Delta follows the trend of
    the mean reward (grows while it rises, shrinks toward `delta_min` otherwise). 0 with
    `streaming: false` is the sequential baseline. With a group baseline
    (ppo.advantage_estimator rloo, reinforce_baseline, group_norm) the pool draws and takes
    whole prompts: Delta and its bounds are multiples of data.samples_per_prompt, and `auto`
    moves it one prompt at a time. At most batch_size (so that max_defer_steps can hold)."""
    delta_min: int = 0
    """Smallest Delta under `overcommit: auto`."""
    delta_max: int = 8
    """Largest Delta under `overcommit: auto`; also the starting Delta. At most
    ppo.batch_size."""
    delta_window: int = 10
    """Steps of mean reward whose least-squares slope drives `overcommit: auto`."""
    max_defer_steps: int = 2
    """A sequence deferred this many times must finish in the next step: that step waits for it
    and takes it first (Delta <= ppo.batch_size makes sure a step can take every such row)."""
    off_policy: Literal["recompute", "truncated_is"] = "recompute"
    """Tokens of a deferred sequence sampled by an older policy: `recompute` takes PPO's old
    log-probs from the current actor (DeepSpeed-Chat's rule, no correction); `truncated_is`
    also weights each token's policy loss by min(exp(old - behaviour log-prob), is_clip)."""
    is_clip: float = 2.0
    """Upper clip of the truncated importance weight (`off_policy: truncated_is`)."""

    def __post_init__(self):
        _require(self.chunk_size == "auto" or self.chunk_size >= 1, "chunk_size",
                 f"must be >= 1 or auto, got {self.chunk_size}")
        _require(bool(self.chunk_candidates) and min(self.chunk_candidates) >= 1, "chunk_candidates",
                 f"must be a non-empty list of sizes >= 1, got {self.chunk_candidates}")
        _require(self.chunk_explore_every >= 0, "chunk_explore_every", "must be >= 0")
        _require(len(set(self.stream_to)) == len(self.stream_to), "stream_to",
                 f"lists a scorer twice: {self.stream_to}")
        _require(self.overcommit == "auto" or self.overcommit >= 0, "overcommit",
                 f"must be >= 0 or auto, got {self.overcommit}")
        _require(0 <= self.delta_min <= self.delta_max, "delta_min",
                 f"must satisfy 0 <= delta_min <= delta_max, got {self.delta_min} and {self.delta_max}")
        _require(self.delta_window >= 2, "delta_window", f"must be >= 2, got {self.delta_window}")
        _require(self.stage_timeout_minutes >= 1, "stage_timeout_minutes",
                 f"must be >= 1, got {self.stage_timeout_minutes}")
        _require(self.max_defer_steps >= 1, "max_defer_steps", f"must be >= 1, got {self.max_defer_steps}")
        _require(self.is_clip >= 1.0, "is_clip", f"must be >= 1, got {self.is_clip}")
        if self.placement == "stage":
            _require(self.streaming, "placement",
                     "stage needs streaming: true (the scorer rank scores the streamed chunks)")

    @property
    def streams_actor(self) -> bool:
        """Whether PPO's old log-probs come from the actor's own decode (see `stream_to`)."""
        return self.streaming and "actor" in self.stream_to

    @property
    def overcommits(self) -> bool:
        """Whether steps go through the rollout pool (any Delta other than a fixed 0)."""
        return self.overcommit != 0

    @property
    def largest_delta(self) -> int:
        """The largest Delta of a run: `overcommit`, or `delta_max` under `auto`."""
        return self.delta_max if self.overcommit == "auto" else self.overcommit


@dataclass
class DataConfig:
    prompts: Union[str, list[str]] = "builtin"
    """Prompt file or directory: .jsonl, .json (an array or JSON lines), .csv or .tsv (a
    header row naming the columns; every cell read as text), any of them compressed (.gz,
    .bz2, .xz), .parquet, a datasets save_to_disk directory, a directory of such files (a hub
    snapshot: data/train-*.parquet), or `builtin` (the built-in long-tail workload's
    prompts). A list of them: their prompts together, each once per epoch, the ids written
    in their rows put under each source's name (a.jsonl/0), so that sources may number their
    rows alike."""
    prompt_key: str = "prompt"
    """Field holding the prompt (a string or a list of chat messages; messages ending with an
    assistant message are continued, as TRL does: the response carries on its text)."""
    split: str = "train"
    """Split to read from a saved DatasetDict, or from a directory whose files or folders are
    named by split (the word anywhere in a name: train-*, gsm8k_train.jsonl, data/train/;
    validation/valid/val/dev, test/eval), a name given exactly first (train_sft). A split in
    several configuration folders (gsm8k's main/, socratic/) is an error: point prompts at
    one."""
    chat_template: Literal["auto", "on", "off"] = "auto"
    """Apply the tokenizer's chat template: auto = when it has one, except under
    deepspeed_chat_formats (its prompts carry their own format: set on to apply it all the
    same). A string prompt already rendered by a template (starting with the BOS text, or
    holding the template's special tokens) is an error while one is applied."""
    input_template: Optional[str] = None
    """Without a chat template in use, text put around every string prompt before tokenising,
    the prompt going where it holds `{}` (OpenRLHF's --input_template, e.g.
    "User: {}\nAssistant: "); with a tokenizer that has a chat template, set chat_template:
    off to use it. Null: the prompt as it is."""
    overlong: Literal["error", "truncate", "skip"] = "error"
    """Prompts over generation.max_prompt_len: stop with file and line, keep their last
    tokens, or drop them (truncated and dropped prompts are counted and logged)."""
    shuffle: bool = True
    """Shuffle prompts each epoch (seeded)."""
    samples_per_prompt: int = 1
    """Responses sampled for each prompt drawn (OpenRLHF's --n_samples_per_prompt): a step's
    ppo.batch_size rows hold batch_size / samples_per_prompt prompts, each that many times,
    as rows `<id>#0`, `<id>#1`, ... that are trained on once each; the rollout pool draws
    whole prompts. batch_size must be a multiple."""
    max_samples: int = 0
    """Train on the first N prompts read (OpenRLHF's --max_samples): of the sources in the
    order given, after phase_split and before overlong prompts are skipped; every row is still
    read and checked. 0 = all. The built-in workload's prompts are sized by
    workload.num_prompts instead."""
    phase_split: Optional[list[float]] = None
    """Weights of the SFT, reward-model and PPO parts of each prompt source, as
    DeepSpeed-Chat's --data_split (e.g. [2, 4, 4]): each source is cut, in a permutation
    seeded by phase_split_seed, into three parts of these shares, and only the third, the PPO
    part, is read (the same prompts as DeepSpeed-Chat's step 3). Null: every prompt."""
    phase_split_seed: Optional[int] = None
    """Seed of phase_split's permutation (DeepSpeed-Chat's --seed); null: `seed`."""
    ptx: Optional[Union[str, list[str]]] = None
    """Pretraining text for PPO-ptx (with ppo.ptx_coef > 0): files or directories as
    `prompts` takes them (the `split` split), whose `ptx_key` field is a string (rows where it
    is empty or whitespace only skipped, counted in a log line); the texts are tokenized,
    concatenated and cut into blocks of ptx_block_len tokens (the remainder dropped), as
    DeepSpeed-Chat groups its unsupervised data; every rank tokenizes it all at
    start, so give it what the run will use (steps x batch_size x ppo_epochs blocks per rank
    are drawn). Null: none."""
    ptx_key: str = "text"
    """Field holding the pretraining text."""
    ptx_block_len: Optional[int] = None
    """Tokens per pretraining block; null = generation.max_prompt_len + max_new_tokens (as
    DeepSpeed-Chat's max_prompt_seq_len + max_answer_seq_len)."""
    deepspeed_chat_formats: bool = False
    """Read each source as DeepSpeed-Chat's step 3 reads its --data_path (oppo-train's
    --data_path sets it): a path naming one of its data sets (Dahoas/rm-static,
    Dahoas/synthetic-instruct-gptj-pairwise, openai/webgpt_comparisons, stanfordnlp/SHP, ...;
    matched as it matches them) gets that set's prompts as it builds them (e.g. ' Human: ' +
    a field + ' Assistant:'; the first nine tenths of a seeded cut of train where the set has
    no test split, cut again by phase_split; rows without a prompt dropped), a .json file
    its local/jsonfile format (a space before `prompt`); other sources are read by
    prompt_key."""

    def __post_init__(self):
        sources = [self.prompts] if isinstance(self.prompts, str) else self.prompts
        _require(len(sources) > 0, "prompts", "an empty list: name a prompt file or directory")
        _require(isinstance(self.prompts, str) or "builtin" not in sources, "prompts",
                 "builtin is the built-in workload's prompts alone; it cannot be listed with files")
        _require(all(s.strip() for s in sources), "prompts", f"an empty path in {self.prompts!r}")
        if self.phase_split_seed is not None:
            _require_seed(self.phase_split_seed, "phase_split_seed")
        _require(self.max_samples >= 0, "max_samples", f"must be >= 0 (0 = all), got {self.max_samples}")
        _require(not self.max_samples or self.prompts != "builtin", "max_samples",
                 "the built-in workload's prompts number workload.num_prompts: set that instead")
        _require(self.ptx_block_len is None or self.ptx_block_len >= 2, "ptx_block_len",
                 f"must be >= 2 (a block predicts its tokens after the first), got {self.ptx_block_len}")
        if self.ptx is not None:
            ptx = [self.ptx] if isinstance(self.ptx, str) else self.ptx
            _require(len(ptx) > 0 and all(x.strip() for x in ptx) and "builtin" not in ptx, "ptx",
                     f"{self.ptx!r}: name pretraining text files or directories, or null")
        if self.phase_split is not None:
            _require(len(self.phase_split) == 3 and min(self.phase_split) >= 0, "phase_split",
                     f"three weights >= 0 (SFT, reward model, PPO), got {self.phase_split}")
            _require(self.phase_split[2] > 0, "phase_split",
                     f"the third weight is the PPO part's share and must be > 0, got "
                     f"{self.phase_split}")
        _require(self.input_template is None or self.input_template.count("{}") == 1,
                 "input_template", "must hold {} once, where the prompt goes (e.g. "
                 f"'User: {{}}\\nAssistant: '), got {self.input_template!r}")


@dataclass
class WorkloadConfig:
    """The built-in long-tail task (used when model/data point at `builtin`)."""
    kind: Literal["task", "length_oracle"] = "task"
    """`task`: the built-in task (SFT actor and reward model trained by us, gold score).
    `length_oracle`: every `builtin` model is `model.builtin_arch` built from config with
    random weights, prompts are random token ids, and each response ends at a target length
    drawn from the same long-tailed distribution (`median_len`, `tail_sigma`): a speed
    benchmark of real model shapes without trained weights."""
    cache_dir: str = ".cache/oppo-builtin"
    """Where the prepared tokenizer, prompts, SFT actor and reward model are cached. Rank 0
    prepares them and the others load them: with several nodes, a filesystem they all see
    (checked at start)."""
    num_prompts: int = 2048
    """Prompts in the built-in training set."""
    sft_steps: int = 300
    """Supervised-tuning steps of the built-in actor."""
    reward_steps: int = 300
    """Training steps of the built-in reward model on preference pairs."""
    median_len: int = 16
    """Median response length of the supervised data (tokens)."""
    tail_sigma: float = 0.9
    """Log-normal spread of response lengths; p99/median = exp(2.33 * tail_sigma)."""

    def __post_init__(self):
        for key, least in (("num_prompts", 1), ("sft_steps", 0), ("reward_steps", 0),
                           ("median_len", 1), ("tail_sigma", 0)):
            _require(getattr(self, key) >= least, key,
                     f"must be >= {least}, got {getattr(self, key)}")


@dataclass
class LoggingConfig:
    output_dir: str = "runs/demo"
    """Run directory: summary.json, TensorBoard events, checkpoints, exported actor. Every rank
    writes its part of a checkpoint here: with several nodes, a filesystem they all see
    (checked at start)."""
    tensorboard: bool = True
    """Write TensorBoard scalars under output_dir/tensorboard."""
    wandb_project: Optional[str] = None
    """Log to Weights & Biases in this project too (null = not), as OpenRLHF's --use_wandb
    and TRL's report_to="wandb" do: rank 0's step metrics (scalars; lists as histograms), the
    evaluations, the config and the run's summary (no sample texts; oppo-bench's TRL peer logs
    none). Needs the wandb package (`pip install wandb`, or oppo-ds's `wandb` extra; checked
    before any model is built). The run's project, name, id and folder (output_dir/wandb) are
    ours; wandb's other settings apply: WANDB_MODE=offline writes the run there for a later
    `wandb sync` (nodes without a network), WANDB_ENTITY names the team, a login or
    WANDB_API_KEY is needed online. A resumed run continues the same wandb run (its id and
    last logged step in output_dir/wandb-run-id): wandb's steps only go forward, so the steps
    a crashed run logged after its last checkpoint keep their first values there and the
    resumed run's repeats of them are not sent (metrics.jsonl holds the resumed run's)."""
    wandb_run_name: Optional[str] = None
    """The wandb run's name (null: the last folder of output_dir)."""
    progress: bool = True
    """Show a progress bar (rank 0)."""
    log_every: int = 10
    """Print a metrics line every N steps (0 = never)."""
    samples: int = 2
    """Responses written to output_dir/samples.jsonl (and TensorBoard's text tab) every
    samples_every steps: the first N of rank 0's batch, each with its prompt, reward, gold
    score (built-in task), length and whether it ended at an end id (0 = none)."""
    samples_every: int = 0
    """Steps between written samples (0 = with each metrics line, every log_every steps)."""
    print_samples: bool = False
    """Print the written samples too, under the metrics line (DeepSpeed-Chat's
    --print_answers)."""
    trace_every: int = 0
    """Write a Chrome/Perfetto trace of every N-th step's timeline (phases; with streaming
    also decode chunks and scorer prefills) to output_dir/traces/ (0 = never). Open it in
    https://ui.perfetto.dev or chrome://tracing."""
    profile_step: int = 0
    """Profile step N with torch's profiler (its host ops, and on a GPU its kernels):
    output_dir/profile/step_N.txt, the ops by self CPU time under the step's phases (on a
    GPU first by self device time, then by CPU time: the host's share), and step_N.json, the
    trace to open in https://ui.perfetto.dev (gigabytes on a GPU at 0.5B parameters). Rank 0;
    0 = never. The profiler slows the step it watches."""

    def __post_init__(self):
        _require(bool(self.output_dir.strip()), "output_dir",
                 f"must not be empty: name the run directory, got {self.output_dir!r}")
        for key in ("log_every", "samples", "samples_every", "trace_every", "profile_step"):
            _require(getattr(self, key) >= 0, key, f"must be >= 0, got {getattr(self, key)}")
        _require(self.wandb_project is None or bool(str(self.wandb_project).strip()),
                 "wandb_project", "must name a project, or be null for no wandb logging")

    @property
    def sample_period(self) -> int:
        """Steps between written samples; 0: never."""
        return (self.samples_every or self.log_every) if self.samples else 0


@dataclass
class EvalConfig:
    """Held-out evaluation: the actor answers a fixed set of prompts it does not train on,
    and the reward model (and, for the built-in task, the gold rule) scores the answers."""
    prompts: Optional[Union[str, list[str]]] = None
    """Prompts to evaluate on: a file, directory or list of them as in data.prompts,
    `builtin` (num_prompts prompts of the built-in task drawn apart from its training
    prompts), or null: no evaluation."""
    split: str = "test"
    """Split read from a saved DatasetDict or a directory of split-named files (as
    data.split); a file named by itself is read whole."""
    num_prompts: int = 64
    """Prompts evaluated: the first N read (0 = all); the size of the `builtin` set."""
    every: int = 0
    """Evaluate after every N-th step (0 = only before the first step and after the last)."""
    at_start: bool = True
    """Evaluate the starting actor before the first step (not when resuming)."""
    temperature: Optional[float] = None
    """Null = generation.temperature (the policy as it trains, so evaluation and training
    rewards compare), with generation.top_k and top_p, from a generator of its own that
    starts from the same seed at every evaluation: two evaluations differ by the policy, not
    by the draw. 0 = greedy decoding (a small model may then repeat a token to the length
    limit: the built-in task's SFT actor does)."""

    def __post_init__(self):
        for key in ("num_prompts", "every"):
            _require(getattr(self, key) >= 0, key, f"must be >= 0, got {getattr(self, key)}")
        _require(self.temperature is None or self.temperature >= 0, "temperature",
                 f"must be >= 0 or null, got {self.temperature}")
        if self.prompts is not None:
            sources = [self.prompts] if isinstance(self.prompts, str) else self.prompts
            _require(len(sources) > 0, "prompts", "an empty list: name a prompt file or directory, "
                     "or null for no evaluation")
            _require(isinstance(self.prompts, str) or "builtin" not in sources, "prompts",
                     "builtin is the built-in task's held-out prompts alone; it cannot be listed "
                     "with files")
            _require(all(s.strip() for s in sources), "prompts", f"an empty path in {self.prompts!r}")
            _require(self.prompts != "builtin" or self.num_prompts > 0, "num_prompts",
                     "the size of the built-in evaluation set: must be >= 1 with eval.prompts: builtin")

    @property
    def enabled(self) -> bool:
        return self.prompts is not None


@dataclass
class CheckpointConfig:
    every: int = 0
    """Save a checkpoint every N steps (0 = only at the end)."""
    resume: str = "auto"
    """`auto` = continue from the latest checkpoint in output_dir when there is one (the tag
    its `latest` file names; where complete checkpoints are there but `latest` is missing or
    empty, lost in a crash or removed by hand, the run stops naming the tags, rather than
    start afresh over them: set the tag to resume, or `never`), `never` = start fresh (an
    earlier run's checkpoints there are moved whole to `checkpoints.earlier-<time>/`, so
    that a later `auto` never resumes that run), or the tag of one checkpoint under
    output_dir/checkpoints (`step300`). A run resumes only with the number of ranks, seed,
    prompts, `data.shuffle` and the actor's and critic's settings (model sources,
    architecture, LoRA, backend and parallel sizes, ZeRO stage, dtype) it was written with;
    placement, streaming and chunk size may change (docs/architecture.md, Checkpoints)."""
    keep_last: int = 2
    """Checkpoints to keep, the newest up to the run's latest (older ones are removed; tags
    of later steps, a branch left by resuming an older tag, stay until the run saves that
    step)."""
    final: bool = True
    """Save a checkpoint when training ends (unless `every` just saved one, or nothing trained
    since the checkpoint the run resumed from: a finished run started again). Off only where
    nothing will continue the run: oppo-bench's timed runs, which would otherwise write the
    actor's and critic's weights and optimizer states (13 GB at 0.5B) after their last step."""
    export_hf: bool = True
    """Export the final models in Hugging Face format (safetensors) to output_dir/actor and
    output_dir/critic (and actor_ema with model.actor_ema)."""
    save_hf: bool = False
    """With every checkpoint, its models in Hugging Face format too, as the final export
    writes them, in checkpoints/hf/<tag>/ (OpenRLHF's --save_hf_ckpt): an intermediate policy
    loads in transformers, vLLM or an evaluation harness without converting DeepSpeed's or
    Megatron's files. Removed with their checkpoint (keep_last)."""
    on_signals: list[Literal["USR1", "USR2", "TERM", "INT"]] = field(
        default_factory=lambda: ["USR1", "TERM"])
    """Signals that stop training after the current step with a checkpoint (every rank
    agrees on it at the step's end); the process then exits with code 75 so a job script can
    requeue it (slurm/train.sh does). A second TERM or INT stops at once; in a Slurm job
    (SLURM_JOB_ID set) a second TERM is only logged, since Slurm repeats TERM and KILLs after
    KillWait, and the checkpoint the first one started goes on."""

    def __post_init__(self):
        _require(self.every >= 0, "every", "must be >= 0")
        _require(self.keep_last >= 1, "keep_last", "must be >= 1")
        _require(self.resume in ("auto", "never") or re.fullmatch(r"step\d+", self.resume) is not None,
                 "resume", f"{self.resume!r}: must be auto, never or a checkpoint tag stepN "
                           f"(a folder name under output_dir/checkpoints/trainer)")


@dataclass
class Config:
    steps: int = 200
    """PPO steps to run."""
    seed: int = 0
    """Seed for data order, initialisation and sampling."""
    model: ModelConfig = field(default_factory=ModelConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    oppo: OppoConfig = field(default_factory=OppoConfig)
    system: SystemConfig = field(default_factory=SystemConfig)
    data: DataConfig = field(default_factory=DataConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self):
        _require(self.steps >= 1, "steps", "must be >= 1")
        _require_seed(self.seed, "seed")
        local_paths(self)  # `~` expanded, empty paths refused: oppo_ds/config_paths.py
        check_across_sections(self)  # the rules between sections: oppo_ds/config_checks.py

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def widest_rollout(self) -> int:
        """Rows of a rank's widest rollout: ppo.batch_size, or a later round of
        ppo.filter_groups when wider (the most the batch can lack, times
        filter_groups_oversample, in whole prompts), plus the largest Delta. The memory
        planner sizes the actor's KV cache for it, and the static decode its buffers."""
        p, n = self.ppo, self.data.samples_per_prompt
        rows = p.batch_size
        if p.filter_groups:
            rows = max(rows, n * math.ceil(-(-p.batch_size // n) * p.filter_groups_oversample))
        return rows + self.oppo.largest_delta

    @property
    def streamed_scorers(self) -> list[str]:
        """The scorer models that prefill the streamed chunks: the reward model first (none
        with model.reward_function, which scores finished text), then the reference and
        critic when they stream (none without streaming)."""
        o = self.oppo
        if not o.streaming:
            return []
        return ["reward"] * self.model.uses_reward_model + [k for k in o.stream_to if k != "actor"]

    @property
    def actor_rank_streamed(self) -> list[str]:
        """The streamed scorers that prefill the chunks on the actor ranks: all of them, but
        none under the stage placement (its scorer rank's copies do)."""
        return [] if self.oppo.placement == "stage" else self.streamed_scorers

    def scorer_rank_models(self, evaluating: bool = False) -> list[str]:
        """The models the stage placement's scorer rank holds whole, in the streamed scorers'
        order: every streamed scorer (the reward model, and the reference when it streams,
        off the actor ranks; a copy of the critic when it streams, which trains on the actor
        ranks and sends its weights there after each update). ``evaluating`` (``oppo-train
        --evaluate``): the reward model alone where it is one of them (an evaluation's
        figures are its scores: a reference or critic copy there would be built, and the
        critic's weights sent, for nothing). None under the other placements."""
        if self.oppo.placement != "stage":
            return []
        kinds = self.streamed_scorers
        return ["reward"] if evaluating and "reward" in kinds else kinds

    def actor_rank_models(self, evaluating: bool = False) -> frozenset[str]:
        """The models every actor rank builds (the engine builders and both memory plans go
        by this): the actor; the critic where one is trained (``ppo.advantage_estimator``
        gae); the reference where the KL is on and the reward model where no
        ``model.reward_function`` scores, each unless the scorer rank holds it
        (``scorer_rank_models``). ``evaluating`` (``oppo-train --evaluate``): no critic or
        reference (the actor answers, the reward model or function scores)."""
        p, on_stage = self.ppo, self.scorer_rank_models(evaluating)
        models = {"actor"}
        if p.uses_critic and not evaluating:
            models.add("critic")
        if p.uses_reference and not evaluating and "reference" not in on_stage:
            models.add("reference")
        if self.model.uses_reward_model and "reward" not in on_stage:
            models.add("reward")
        return frozenset(models)

    @property
    def streamed_frozen_scorers(self) -> list[str]:
        """The streamed scorers that do not train (``FROZEN_KINDS``: the reward model and the
        reference, not the critic): a deferred row's caches of theirs stay valid from one step
        to the next, and a finished row's scores of theirs are final."""
        return [k for k in self.streamed_scorers if k in FROZEN_KINDS]

    @property
    def carried_scorer_kinds(self) -> list[str]:
        """The streamed scorers whose caches of the deferred rows the actor ranks keep from one
        step to the next (the rollout pool's): the frozen ones (``streamed_frozen_scorers``;
        the critic trains, so its cache is rebuilt), except under the stage placement, whose
        scorer rank keeps its own."""
        return [] if self.oppo.placement == "stage" else self.streamed_frozen_scorers


def load_config(path: Optional[str] = None, overrides: tuple[str, ...] | list[str] = ()) -> Config:
    data: dict = read_config_file(path) if path is not None else {}
    for text in overrides:
        key, value = parse_override(text)
        set_dotted(data, key, value)
    return build_dataclass(Config, data, "")


def save_config(config: Config, path: str) -> None:
    with open(path, "w") as f:
        yaml.safe_dump(config.to_dict(), f, sort_keys=False)
