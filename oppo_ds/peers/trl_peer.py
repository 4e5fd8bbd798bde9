"""TRL 1.12's PPO trainer as a peer on our workload.

    python -m oppo_ds.peers.trl_peer [--config FILE] --steps N --seed S --out DIR [KEY=VALUE ...]

:func:`run_trl_peer` loads our config (the same YAML and overrides as a mode of oppo-bench),
resolves the actor, reference, reward model, critic, tokenizer and prompts through our code
(``builtin`` included), and trains them with ``trl.experimental.ppo.PPOTrainer`` (TRL 1.12.0,
the last release with PPO):

* policy: our actor checkpoint as an ``AutoModelForCausalLM``; reference: a second copy of it;
* reward and value model: ``AutoModelForSequenceClassification(num_labels=1)`` of the same
  architecture carrying our value-head model's body and head (:func:`to_sequence_classifier`),
  so TRL's ``get_reward`` computes exactly our reward-model score;
* prompts: our encoded prompt ids, in the order our ``PromptStream`` hands them to the
  sequential trainer (step k trains on the same prompts in both);
* settings: :func:`trl_settings` (the whole mapping from our config is in that one function,
  but for the decode's cache, set on the policy's ``generation_config``:
  :func:`policy_generation`; :data:`GENERATION_KEYS` says how each generation key is taken).

Per step it appends one row in our metrics format to ``DIR/metrics.jsonl``: ``step``,
``time/step_s``, ``samples``, ``reward/mean``, ``gold/mean`` (built-in prompts only),
``response/lengths``, ``rollout/tail_waste_frac``, ``time/phase/{generate,score,advantages,
train}``, a few of TRL's statistics under our names (``kl/mean``, ``loss/policy``, ...) and
every number TRL logs under ``trl/``. How steps and phases are timed: :func:`_instrumented`
and :class:`_StepRecorder`. What still differs from our PPO: docs/benchmarks.md, section
"TRL 1.12 PPO peer".
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import math
import os
import sys
import time
import warnings
from contextlib import contextmanager
from typing import Optional

import torch

logger = logging.getLogger(__name__)

TRL_VERSION = "1.12.0"
INSTALL_HINT = "pip install 'oppo-ds[peer]'"


class PeerUnavailable(RuntimeError):
    """TRL (with its PPO trainer) cannot be imported; ``str()`` says how to install it."""


class PeerSettingError(ValueError):
    """A setting of our config that TRL's PPO cannot express; ``str()`` names the key."""


def _import_trl():
    """(PPOConfig, PPOTrainer, the ppo_trainer module, trl version), or PeerUnavailable."""
    try:
        import trl
    except ImportError:
        raise PeerUnavailable(f"trl is not installed: {INSTALL_HINT}") from None
    try:
        with warnings.catch_warnings():  # trl.experimental warns on import that it is experimental
            warnings.simplefilter("ignore")
            from trl.experimental.ppo import PPOConfig, PPOTrainer
            from trl.experimental.ppo import ppo_trainer as module
    except ImportError as err:
        raise PeerUnavailable(f"trl {getattr(trl, '__version__', '?')} has no PPO trainer "
                              f"(removed after {TRL_VERSION}; {err}): {INSTALL_HINT}") from None
    return PPOConfig, PPOTrainer, module, trl.__version__


# ------------------------------------------------------------------ models

def to_sequence_classifier(value_model):
    """Our value-head model (an AutoModel body + ``Linear(hidden, 1)`` head) as the
    ``AutoModelForSequenceClassification(num_labels=1)`` of the same architecture, with the
    same weights: TRL scores with ``model.score(backbone(...).hidden_states[-1])`` where the
    backbone is ``getattr(model, model.base_model_prefix)``, which then computes exactly our
    ``value_head(body(...).last_hidden_state)``."""
    from transformers import AutoModelForSequenceClassification

    config = copy.deepcopy(value_model.body.config)
    config.num_labels = 1
    body_param = next(value_model.body.parameters())
    model = AutoModelForSequenceClassification.from_config(config).to(body_param.dtype)
    backbone = getattr(model, model.base_model_prefix, None)
    if backbone is None or not isinstance(getattr(model, "score", None), torch.nn.Linear):
        raise ValueError(f"{type(model).__name__} has no `{model.base_model_prefix}` backbone and "
                         f"`score` head; TRL's PPO cannot use it as a reward or value model")
    with torch.no_grad():
        backbone.load_state_dict(value_model.body.state_dict(), strict=True)
        model.score.weight.copy_(value_model.value_head.weight.to(model.score.weight.dtype))
        if model.score.bias is not None:
            model.score.bias.zero_()
    return model.to(body_param.device).eval()


# ------------------------------------------------------------------ settings

def _checkpointing_key() -> str:
    """transformers 5.24 renamed TrainingArguments' ``gradient_checkpointing`` to
    ``activation_checkpointing`` (the old name warns, and goes in v6)."""
    from transformers import TrainingArguments

    fields = TrainingArguments.__dataclass_fields__
    return "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"


def trl_settings(cfg, *, out_dir: str, eos_token_ids: tuple[int, ...], use_cpu: bool,
                 sft_model_path: str = "", reward_model_path: str = "") -> tuple[dict, list[str]]:
    """TRL ``PPOConfig`` keyword arguments for our config, and notes on what of ours TRL
    cannot express (each also logged as a warning by :func:`run_trl_peer`).

    Batching: TRL's rollout batch is ``per_device_train_batch_size * gradient_accumulation_steps``
    and its optimizer steps every ``gradient_accumulation_steps`` micro-batches, whatever the
    mini-batch boundaries; with ``gradient_accumulation_steps=1`` and ``num_mini_batches = B / M``
    each mini-batch of M is one forward/backward and one optimizer update, as in ours (our
    micro-batch size, a memory knob, has no TRL counterpart)."""
    p, g = cfg.ppo, cfg.generation
    notes = []
    warmup = math.ceil(p.warmup_steps / p.updates_per_step) if p.warmup_steps else 0
    if p.warmup_steps:
        notes.append(f"ppo.warmup_steps={p.warmup_steps} updates -> {warmup} PPO steps "
                     f"(TRL steps its scheduler once per PPO step)")
    schedule = {"constant": "constant_with_warmup" if warmup else "constant",
                "linear": "linear", "cosine": "cosine"}[p.lr_schedule]
    if p.kl_estimator not in ("k1", "k3"):
        raise PeerSettingError(f"ppo.kl_estimator={p.kl_estimator!r}: TRL's PPO has only k1 "
                               f"and k3")
    if not p.whiten_advantages:
        notes.append("ppo.whiten_advantages=false: TRL always whitens advantages")
    if p.reward_clip is not None:
        notes.append(f"ppo.reward_clip={p.reward_clip}: TRL does not clip scores")
    if p.grad_clip is not None:
        notes.append(f"ppo.grad_clip={p.grad_clip}: TRL's PPO loop clips no gradients")
    if p.critic_lr != p.actor_lr:
        notes.append(f"ppo.critic_lr={p.critic_lr}: TRL trains policy and value model with one "
                     f"optimizer at ppo.actor_lr={p.actor_lr}")
    if p.clip_eps_high is not None or p.dual_clip is not None:
        notes.append(f"ppo.clip_eps_high={p.clip_eps_high}, dual_clip={p.dual_clip}: TRL's PPO "
                     f"clips the ratio at 1 +- cliprange={p.clip_eps} only")
    if p.freeze_actor_steps:
        notes.append(f"ppo.freeze_actor_steps={p.freeze_actor_steps}: TRL's PPO trains the policy "
                     f"from the first step")
    if cfg.model.reward_normalize:
        notes.append("model.reward_normalize=true: TRL's PPO scores with the reward model as it "
                     "is; the peer's rewards are not normalised")
    if not p.uses_critic:
        raise PeerSettingError(
            f"ppo.advantage_estimator={p.advantage_estimator}: TRL's PPO estimates advantages "
            f"with a value model (GAE); its critic-free methods are other trainers "
            f"(RLOOTrainer, GRPOTrainer)")
    if cfg.data.samples_per_prompt > 1:
        raise PeerSettingError(f"data.samples_per_prompt={cfg.data.samples_per_prompt}: TRL's "
                               f"PPO samples one response per prompt")
    if p.kl_penalty == "loss":
        raise PeerSettingError("ppo.kl_penalty='loss': TRL's PPO takes the KL off the rewards "
                               "only")
    if p.loss_agg_mode != "token_mean":
        raise PeerSettingError(f"ppo.loss_agg_mode={p.loss_agg_mode!r}: TRL's PPO averages the "
                               f"policy loss over a mini-batch's tokens (token_mean)")
    if p.importance_sampling_level != "token":
        raise PeerSettingError(
            f"ppo.importance_sampling_level={p.importance_sampling_level!r}: TRL's PPO takes "
            f"the policy ratio per token (its GRPOTrainer has the option)")
    if p.overlong_buffer_len:
        raise PeerSettingError(f"ppo.overlong_buffer_len={p.overlong_buffer_len}: TRL's PPO has "
                               f"no overlong reward shaping (its missing_eos_penalty is "
                               f"ppo.missing_eos_penalty)")
    if not cfg.model.uses_reward_model:
        raise PeerSettingError(
            f"model.reward_function={cfg.model.reward_function}: the peer runs TRL's "
            f"PPOTrainer, which scores with a reward model (its GRPOTrainer takes reward "
            f"functions)")
    if p.mask_truncated_completions:
        raise PeerSettingError("ppo.mask_truncated_completions: TRL's PPO trains on truncated "
                               "responses (its GRPOTrainer and RLOOTrainer have the option)")
    if p.filter_groups:
        raise PeerSettingError("ppo.filter_groups: TRL's PPO trains on every prompt it samples "
                               "(DAPO's dynamic sampling is in none of TRL's trainers)")
    if p.kl_target is not None:
        notes.append(f"ppo.kl_target={p.kl_target}: TRL 1.12's PPO keeps its KL coefficient "
                     f"fixed; the peer uses ppo.kl_coef={p.kl_coef} throughout")
    if p.entropy_coef:
        notes.append(f"ppo.entropy_coef={p.entropy_coef}: TRL's PPO has no entropy bonus")
    if p.ptx_coef:
        notes.append(f"ppo.ptx_coef={p.ptx_coef}: TRL's PPO has no pretraining loss; the peer "
                     f"trains without data.ptx")
    if cfg.model.actor_ema:
        notes.append("model.actor_ema=true: TRL's PPO keeps no average of the actor's weights")
    if cfg.eval.enabled:
        notes.append("eval.prompts: the peer runs no held-out evaluation")
    if p.missing_eos_penalty and p.reward_clip is not None:
        notes.append("ppo.missing_eos_penalty: TRL takes it off the unclipped score")
    if g.top_k or g.top_p < 1.0:
        notes.append(f"generation.top_k={g.top_k}, top_p={g.top_p}: TRL samples with top_k=0, top_p=1")
    if g.temperature == 0:
        notes.append("generation.temperature=0 (greedy): TRL samples at temperature 1e-7")
    notes += _generation_notes(g, use_cpu)
    if cfg.system.dtype == "fp16":
        notes.append("system.dtype=fp16: the peer runs in fp32 (TRL's fp16 needs fp32 weights "
                     "under a gradient scaler; ours trains fp16 weights)")
    elif cfg.system.dtype == "bf16":
        notes.append("system.dtype=bf16: the peer's models are bf16 and TRL trains them with "
                     "bf16=True (AdamW on the bf16 weights; our engines keep fp32 master weights)")
    stop = eos_token_ids[0] if eos_token_ids else None
    if len(eos_token_ids) > 1:
        notes.append(f"responses end at token ids {list(eos_token_ids)} in oppo-ds; TRL stops "
                     f"at one (stop_token_id={stop})")
    settings = dict(
        output_dir=os.path.join(out_dir, "trl"),
        seed=cfg.seed, data_seed=cfg.seed, use_cpu=use_cpu,
        # batches: one rollout of B per step, an update per mini-batch of M (see above)
        per_device_train_batch_size=p.batch_size, gradient_accumulation_steps=1,
        num_mini_batches=p.batch_size // p.mini_batch_size, num_ppo_epochs=p.ppo_epochs,
        total_episodes=cfg.steps * p.batch_size,
        local_rollout_forward_batch_size=p.batch_size,  # generate / score the batch at once
        # generation
        response_length=g.max_new_tokens, temperature=g.temperature,
        stop_token_id=stop, missing_eos_penalty=p.missing_eos_penalty,
        # PPO math
        kl_coef=p.kl_coef, kl_estimator=p.kl_estimator, cliprange=p.clip_eps,
        cliprange_value=p.value_clip_eps, vf_coef=1.0, gamma=p.gamma, lam=p.lam,
        whiten_rewards=p.whiten_rewards,
        # optimizer: torch AdamW with our engine's betas / eps
        learning_rate=p.actor_lr, weight_decay=p.weight_decay, optim="adamw_torch",
        adam_beta1=p.adam_betas[0], adam_beta2=p.adam_betas[1], adam_epsilon=p.adam_eps,
        max_grad_norm=p.grad_clip if p.grad_clip is not None else 0.0,  # unused by TRL's PPO loop
        lr_scheduler_type=schedule, warmup_steps=warmup,
        # precision and memory
        bf16=peer_dtype(cfg) == "bf16", fp16=False, **{_checkpointing_key(): False},
        # nothing but training: no reports, saves, evals or sample generations
        report_to=[], save_strategy="no", eval_strategy="no", push_to_hub=False,
        num_sample_generations=0, logging_steps=1, disable_tqdm=True,
        dataloader_pin_memory=not use_cpu,
        sft_model_path=sft_model_path, reward_model_path=reward_model_path,
    )
    return settings, notes


# How the peer takes each key of our `generation` section. A key not here, set to anything
# but its default, is refused (_generation_notes): a decode option added to our trainer must
# not reach our modes and silently not the peer.
GENERATION_KEYS = {
    "max_prompt_len": "our code encodes the prompts (load_prompts)",
    "max_new_tokens": "response_length",
    "temperature": "temperature (greedy: 1e-7)",
    "top_k": "not applied (a note): TRL samples with top_k=0",
    "top_p": "not applied (a note): TRL samples with top_p=1",
    "eos_token_ids": "stop_token_id, the first of them",
    "sync_every": "not applied (a note): HF generate checks for ended rows every token",
    "static_cache": "policy.generation_config.cache_implementation='static' (policy_generation)",
    "cuda_graph": "transformers' own compile of the forward, on CUDA (policy_generation)",
}


def _generation_notes(g, use_cpu: bool) -> list[str]:
    """Notes on our generation keys TRL's generate takes otherwise; PeerSettingError for a
    key :data:`GENERATION_KEYS` does not map, set to other than its default, and for
    ``cuda_graph`` without a GPU (as our trainer refuses it)."""
    defaults = type(g)()
    for field in dataclasses.fields(g):
        value = getattr(g, field.name)
        if field.name not in GENERATION_KEYS and value != getattr(defaults, field.name):
            raise PeerSettingError(
                f"generation.{field.name}={value!r}: the peer does not know how TRL's generate "
                f"would take it (it maps {', '.join(GENERATION_KEYS)}); leave it at its "
                f"default to run the peer")
    notes = []
    if g.sync_every != 1:
        notes.append(f"generation.sync_every={g.sync_every}: HF generate checks for ended rows "
                     f"after every token")
    if g.cuda_graph and use_cpu:
        raise PeerSettingError(
            "generation.cuda_graph=true: the peer's counterpart is transformers' compile of the "
            "policy's forward for the static cache (torch.compile, mode 'reduce-overhead': CUDA "
            "graphs), which transformers does on a CUDA GPU only, and this process sees none: "
            "set generation.cuda_graph: false")
    length = g.max_prompt_len + g.max_new_tokens
    if g.cuda_graph:
        notes.append(f"generation.static_cache=true, cuda_graph=true: HF generate decodes with a "
                     f"StaticCache of {length} positions (cache_implementation='static') and "
                     f"transformers compiles the policy's forward for it (torch.compile, mode "
                     f"'reduce-overhead': CUDA graphs; the compile falls in the first steps), "
                     f"where ours captures one CUDA graph of its own forward")
    elif g.static_cache:
        notes.append(f"generation.static_cache=true: HF generate decodes with a StaticCache of "
                     f"{length} positions (cache_implementation='static'), uncompiled "
                     f"(disable_compile=True: transformers would compile it on a GPU, which is "
                     f"generation.cuda_graph's counterpart)")
    return notes


def policy_generation(cfg) -> dict:
    """Attributes the peer sets on the policy's ``generation_config``: HF ``generate``
    completes the ``GenerationConfig`` TRL passes (its sampling settings only) from the
    model's, so these reach every rollout. ``generation.static_cache``: a ``StaticCache``
    (``cache_implementation='static'``) sized once for the run (``max_cache_len``: the
    longest prompt and response, so that no rollout allocates, or compiles, another);
    without ``generation.cuda_graph`` uncompiled (``disable_compile``: on a GPU transformers
    would otherwise compile the forward with CUDA graphs, ``cuda_graph``'s counterpart).
    Nothing for the default decode."""
    g = cfg.generation
    if not g.static_cache:
        return {}
    return {"cache_implementation": "static", "max_cache_len": g.max_prompt_len + g.max_new_tokens,
            "disable_compile": not g.cuda_graph}


def peer_dtype(cfg) -> str:
    """The dtype the peer builds its models in: bf16 as ours, else fp32 (fp16 too, see
    :func:`trl_settings`)."""
    return "bf16" if cfg.system.dtype == "bf16" else "fp32"


def check_settings(config_path: Optional[str], overrides: list[str], steps: int,
                   seed: int) -> None:
    """Raise ConfigError or PeerSettingError for a config the peer would refuse, without
    importing TRL or building a model: oppo-bench asks before its first mode runs."""
    from ..config import load_config

    cfg = load_config(config_path, [*overrides, f"steps={steps}", f"seed={seed}"])
    trl_settings(cfg, out_dir="", eos_token_ids=(), use_cpu=not torch.cuda.is_available())


# ------------------------------------------------------------------ per-step rows

def _gold_scores(tokenizer, queries: torch.Tensor, responses: torch.Tensor,
                 lengths: list[int]) -> list[float]:
    """The built-in task's gold score per row, as PPOTrainer._gold computes it in our trainer."""
    from .. import workload as wl

    prompts = tokenizer.batch_decode(queries, skip_special_tokens=True)
    texts = [tokenizer.decode(r[:n], skip_special_tokens=True)
             for r, n in zip(responses.tolist(), lengths)]
    out = []
    for p, r in zip(prompts, texts):
        task = wl.parse_prompt(p.split())
        out.append(wl.gold_score(task, r.split()) if task else float("nan"))
    return out


# TRL's statistics under the names our trainer logs them
_TRL_TO_OURS = {"objective/kl": "kl/mean", "loss/policy_avg": "loss/policy",
                "loss/value_avg": "loss/value", "policy/clipfrac_avg": "policy/clip_frac",
                "policy/approxkl_avg": "policy/approx_kl", "val/clipfrac_avg": "value/clip_frac",
                "policy/entropy_avg": "policy/entropy", "lr": "lr/actor"}


def _callback_base():
    from transformers import TrainerCallback

    return TrainerCallback


class _StepRecorder:
    """Collects one row per PPO step (created by :func:`_make_recorder`, which mixes in
    transformers' ``TrainerCallback``).

    Step time: TRL's ``train()`` calls ``on_train_begin`` once, then ``on_step_end`` once per
    PPO step (after the update, its metrics and ``lr_scheduler.step()``); a step's wall time
    runs from the previous boundary to its ``on_step_end``. The recorder's own work (lengths,
    decoding for the gold score, writing the row) happens after the end is taken and before
    the next start, so it is in no step.

    Phases, from the events of :func:`_instrumented` (contiguous, all inside the step):
    generate = time in ``batch_generation``; score = end of generation -> end of the reward
    model's ``get_reward`` (behaviour log-probs from the generation logits, reference forward,
    value forward, reward forward); advantages = -> the first training ``forward`` (EOS
    handling, KL-shaped rewards, GAE, whitening); train = -> ``on_step_end`` (PPO epochs,
    TRL's metrics, scheduler step); gc = the ``gc.collect()`` calls TRL makes in its loop
    (after the rollout and after each step), taken out of the phase they fall in. Not in any
    phase: taking the next prompts."""

    def __init__(self, *, tokenizer, pad_token_id: int, builtin_prompts: bool, metrics_path: str,
                 first_true_indices):
        self.tokenizer = tokenizer
        self.pad_token_id = pad_token_id
        self.builtin_prompts = builtin_prompts
        self.metrics_path = metrics_path
        self.first_true_indices = first_true_indices  # TRL's own, for lengths as TRL sees them
        self.rows: list[dict] = []
        self.step_start: Optional[float] = None
        self._clear()

    def _clear(self) -> None:
        self.generate_s = 0.0
        self.generated_at = self.scored_at = self.train_at = None
        self.gc_calls: list[tuple[float, float]] = []
        self.scored: list[tuple[torch.Tensor, int, torch.Tensor]] = []
        self.logs: dict = {}

    # events from the instrumented TRL functions
    def on_generated(self, start: float, end: float) -> None:
        self.generate_s += end - start
        self.generated_at = end

    def on_scored(self, query_responses: torch.Tensor, context_length: int, scores: torch.Tensor,
                  end: float) -> None:
        self.scored.append((query_responses, context_length, scores))
        self.scored_at = end

    def on_train_forward(self, start: float) -> None:
        if self.train_at is None:
            self.train_at = start

    def on_gc(self, start: float, end: float) -> None:
        self.gc_calls.append((start, end))

    def _gc_within(self, start: float, end: float) -> float:
        return sum(max(0.0, min(b, end) - max(a, start)) for a, b in self.gc_calls)

    # TrainerCallback hooks
    def on_train_begin(self, args, state, control, **kwargs):
        self.step_start = time.perf_counter()

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.update(logs or {})

    def on_step_end(self, args, state, control, **kwargs):
        end = time.perf_counter()
        self._write(self._row(len(self.rows) + 1, end))
        self._clear()
        self.step_start = time.perf_counter()

    def _row(self, step: int, end: float) -> dict:
        from ..rollout.waste import tail_waste

        scores = torch.cat([s.float().cpu() for _, _, s in self.scored]) if self.scored else torch.zeros(0)
        lengths, gold, slots = [], [], 0
        for query_responses, context, _ in self.scored:
            responses = query_responses[:, context:].cpu()
            slots += responses.numel()  # generate decoded every row to the batch's width
            # as TRL: the response ends before its first pad (truncate_response put pads after
            # the stop token), so a length counts the EOS
            n = self.first_true_indices(responses == self.pad_token_id).tolist()
            lengths += n
            if self.builtin_prompts:
                gold += _gold_scores(self.tokenizer, query_responses[:, :context].cpu(), responses, n)
        row = {"step": step, "time/step_s": end - self.step_start, "samples": len(lengths),
               "reward/mean": scores.mean().item() if scores.numel() else float("nan")}
        if gold:
            row["gold/mean"] = sum(gold) / len(gold)
        if lengths:
            row.update({"response/len_mean": sum(lengths) / len(lengths),
                        "response/len_max": max(lengths),
                        "response/len_p50": sorted(lengths)[len(lengths) // 2],
                        "response/lengths": [int(x) for x in lengths],
                        # HF generate decodes every row until the batch's longest one ends,
                        # also past a pad a row sampled (TRL's length ends at the first pad)
                        "rollout/tail_waste_frac": tail_waste(lengths, slots)})
        marks = [self.step_start, self.generated_at, self.scored_at, self.train_at, end]
        if None not in marks:
            spans = {"score": (self.generated_at, self.scored_at),
                     "advantages": (self.scored_at, self.train_at), "train": (self.train_at, end)}
            row["time/phase/generate"] = self.generate_s
            for name, (a, b) in spans.items():
                row[f"time/phase/{name}"] = (b - a) - self._gc_within(a, b)
            row["time/phase/gc"] = self._gc_within(self.step_start, end)
        for key, value in self.logs.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                row[f"trl/{key}"] = value
                if key in _TRL_TO_OURS:
                    row[_TRL_TO_OURS[key]] = value
        return row

    def _write(self, row: dict) -> None:
        self.rows.append(row)
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")


def _make_recorder(**kwargs) -> _StepRecorder:
    cls = type("StepRecorder", (_StepRecorder, _callback_base()), {})
    return cls(**kwargs)


def _prompt_key(row: torch.Tensor, pad_token_id: int) -> tuple:
    return tuple(row[row != pad_token_id].tolist())


@contextmanager
def _oracle_generation(model, queries: torch.Tensor, pad_token_id: int,
                       targets: Optional[dict]):
    """While the block runs, ``model.generate`` stops each row of ``queries`` (left-padded
    prompts) after its prompt's target length in ``targets`` (prompt ids -> tokens), and the
    whole decode when every row has reached its own, as our decode loop ends rows under the
    length oracle. Yields the function that cuts ``batch_generation``'s result: tokens past a
    row's target (HF generate samples on for a row a stopping criterion ended, unless an EOS
    criterion is configured) become pads, so that TRL's length (up to the first pad) is the
    target. Without targets: nothing changes."""
    if not targets:
        yield lambda out: out
        return
    from transformers import StoppingCriteria, StoppingCriteriaList

    context = queries.shape[1]
    keys = [_prompt_key(q, pad_token_id) for q in queries.cpu()]
    missing = sum(key not in targets for key in keys)
    if missing:  # it would decode to max_new_tokens, unlike ours: a wrong comparison
        raise RuntimeError(f"length oracle: {missing} of {len(keys)} prompts of TRL's batch have "
                           f"no target length (their ids differ from the oracle's prompts)")
    limit = torch.tensor([targets[key] for key in keys], device=queries.device)

    class OracleStop(StoppingCriteria):
        def __init__(self, rows: torch.Tensor):
            self.rows = rows

        def __call__(self, input_ids, scores, **kwargs):
            return input_ids.shape[1] - context >= self.rows

    generate, done = model.generate, [0]

    def oracle_generate(*args, **kwargs):
        # batch_generation hands generate the rows in order, in slices of its batch size
        n = kwargs["input_ids"].shape[0]
        stop = OracleStop(limit[done[0]:done[0] + n])
        done[0] += n
        kwargs["stopping_criteria"] = StoppingCriteriaList(
            [*(kwargs.get("stopping_criteria") or ()), stop])
        return generate(*args, **kwargs)

    def cut(out):
        query_responses, logits = out
        positions = torch.arange(query_responses.shape[1] - context, device=limit.device)
        past = positions[None, :] >= limit[:, None]
        query_responses[:, context:][past] = pad_token_id
        return query_responses, logits

    model.generate = oracle_generate
    try:
        yield cut
    finally:
        del model.generate  # the instance attribute; the class's method shows again


@contextmanager
def _instrumented(module, trainer, recorder: _StepRecorder, targets: Optional[dict] = None):
    """The one place that patches TRL, only while the block runs.

    ``PPOTrainer.train()`` is one long function; it reaches three functions and the ``gc``
    module through module-level names of its module (``trl.experimental.ppo.ppo_trainer``).
    Each is replaced by a wrapper that calls the original unchanged and tells the recorder
    when it ran: ``batch_generation`` (the rollout's HF generate), ``get_reward`` (value and
    reward model forwards; for the reward model the wrapper also passes on the scored
    sequences and their scores), ``forward`` (reference forward in the rollout, policy+value
    forward in the update) and ``gc.collect``. The originals are restored on exit, also on
    error. With ``targets`` (the length oracle's: prompt ids -> response length)
    ``batch_generation`` also ends every row at its prompt's target (:func:`_oracle_generation`),
    as our decode loop does."""
    names = ("batch_generation", "get_reward", "forward", "gc")
    originals = {name: getattr(module, name) for name in names}

    def batch_generation(model, queries, batch_size, pad_token_id, generation_config):
        start = time.perf_counter()
        with _oracle_generation(model, queries, pad_token_id, targets) as cut:
            out = cut(originals["batch_generation"](model, queries, batch_size, pad_token_id,
                                                    generation_config))
        recorder.on_generated(start, time.perf_counter())
        return out

    def get_reward(model, query_responses, pad_token_id, context_length):
        out = originals["get_reward"](model, query_responses, pad_token_id, context_length)
        if model is trainer.reward_model:
            recorder.on_scored(query_responses, context_length, out[1].detach(), time.perf_counter())
        return out

    def forward(model, query_responses, pad_token_id):
        if model is not trainer.ref_model:
            recorder.on_train_forward(time.perf_counter())
        return originals["forward"](model, query_responses, pad_token_id)

    class TimedGC:
        """Stands for the ``gc`` module in TRL's module: ``gc.collect()`` timed, the rest as is."""

        def __getattr__(self, name):
            return getattr(originals["gc"], name)

        def collect(self, *args, **kwargs):
            start = time.perf_counter()
            out = originals["gc"].collect(*args, **kwargs)
            recorder.on_gc(start, time.perf_counter())
            return out

    wrappers = {"batch_generation": batch_generation, "get_reward": get_reward, "forward": forward,
                "gc": TimedGC()}
    try:
        for name in names:
            setattr(module, name, wrappers[name])
        yield
    finally:
        for name in names:
            setattr(module, name, originals[name])


# ------------------------------------------------------------------ the run

def _ordered_prompt_ids(prompts, cfg) -> list[list[int]]:
    """Prompt ids for ``cfg.steps`` steps of ``cfg.ppo.batch_size``, in the order our
    sequential trainer's PromptStream gives them (epochs wrap as there)."""
    from ..data import PromptStream

    stream = PromptStream(prompts, cfg.ppo.batch_size, cfg.seed, 0, 1, shuffle=cfg.data.shuffle)
    return [list(x.input_ids) for _ in range(cfg.steps) for x in stream.next_batch()]


def run_trl_peer(config_path: Optional[str], overrides: list[str], steps: int, seed: int,
                 out_dir: str) -> list[dict]:
    """Train ``steps`` PPO steps with TRL's PPOTrainer on the workload of our config
    (``config_path`` + ``overrides``, as a mode of oppo-bench gets them; ``steps`` and ``seed``
    win over the same keys there). Writes ``out_dir/metrics.jsonl`` (one row per step, our
    format), ``out_dir/config.yaml`` (our resolved config) and ``out_dir/peer.json`` (TRL
    version, the PPOConfig used, notes on unmapped settings); returns the rows.

    Raises PeerUnavailable when TRL's PPO cannot be imported, ConfigError for a bad config."""
    PPOConfig, PPOTrainer, module, trl_version = _import_trl()
    from datasets import Dataset
    from torch.utils.data import DataLoader
    from transformers import PrinterCallback, ProgressCallback, set_seed

    from ..config import load_config, save_config
    from ..models import build_causal_lm, build_device, build_value_model, disable_dropout
    from ..rollout.generate import cudnn_attention
    from ..sources import (check_prompt_format, end_ids, load_prompts, resolve_sources,
                           run_tokenizer)

    cfg = load_config(config_path, [*overrides, f"steps={steps}", f"seed={seed}",
                                    f"logging.output_dir={out_dir}"])
    os.makedirs(out_dir, exist_ok=True)
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    open(metrics_path, "w").close()  # a fresh history
    save_config(cfg, os.path.join(out_dir, "config.yaml"))
    if cfg.system.torch_threads:
        torch.set_num_threads(cfg.system.torch_threads)
    set_seed(cfg.seed)  # python, numpy (TRL's mini-batch permutations) and torch

    # the same sources, tokenizer and prompts as our trainer
    src = resolve_sources(cfg, rank=0)
    tokenizer = run_tokenizer(cfg, src)
    tokenizer.padding_side = "left"  # TRL's collator pads the queries; PPO needs them left-padded
    check_prompt_format(cfg, src, tokenizer)
    prompts, _ = load_prompts(cfg, src, tokenizer, log=True)
    # the length oracle's target of each prompt (prompts are random ids, so their ids are keys)
    targets = {tuple(p.input_ids): p.target_len for p in prompts if p.target_len}
    dataset = Dataset.from_dict({"input_ids": _ordered_prompt_ids(prompts, cfg)})

    # made where our trainer makes them (build_device), so that the seed gives the same weights
    common = dict(vocab_size=len(tokenizer), dtype=peer_dtype(cfg),
                  trust_remote_code=cfg.model.trust_remote_code, seed=cfg.seed,
                  device=build_device(cfg.system.zero_stage))
    policy = disable_dropout(build_causal_lm(src.actor, **common))
    reference = disable_dropout(build_causal_lm(src.reference, **common))  # a separate copy
    reward = to_sequence_classifier(build_value_model(src.reward, require_head=True, **common))
    value = disable_dropout(to_sequence_classifier(build_value_model(src.critic, **common)))

    ends = end_ids(cfg, src, tokenizer, log=False)
    settings, notes = trl_settings(cfg, out_dir=out_dir, eos_token_ids=ends,
                                   use_cpu=not torch.cuda.is_available(),
                                   sft_model_path=src.actor, reward_model_path=src.reward)
    for note in notes:
        logger.warning("TRL peer: %s", note)
    decode = policy_generation(cfg)
    for key, setting in decode.items():
        setattr(policy.generation_config, key, setting)
    args = PPOConfig(**settings)
    recorder = _make_recorder(tokenizer=tokenizer, pad_token_id=tokenizer.pad_token_id,
                              builtin_prompts=src.builtin_prompts, metrics_path=metrics_path,
                              first_true_indices=module.first_true_indices)
    trainer = PPOTrainer(args=args, processing_class=tokenizer, model=policy, ref_model=reference,
                         reward_model=reward, value_model=value, train_dataset=dataset,
                         callbacks=[recorder])
    trainer.remove_callback(PrinterCallback)  # it would print TRL's metrics every step
    trainer.remove_callback(ProgressCallback)
    # TRL's DataLoader shuffles (shuffle=True, fixed in PPOTrainer.__init__); the dataset is
    # already in our order, so replace it by the same loader without shuffling.
    trainer.dataloader = trainer.accelerator.prepare(DataLoader(
        trainer.train_dataset, batch_size=trainer.local_dataloader_batch_size, shuffle=False,
        collate_fn=trainer.data_collator, drop_last=True))
    with open(os.path.join(out_dir, "peer.json"), "w") as f:
        json.dump({"peer": "trl", "trl_version": trl_version, "notes": notes,
                   "policy_generation_config": decode,
                   "ppo_config": {k: v for k, v in args.to_dict().items()
                                  if k in settings or k in ("batch_size", "mini_batch_size",
                                                            "local_mini_batch_size",
                                                            "num_total_batches")}},
                  f, indent=2, default=str)
    # the attention backends our runs use (system.cudnn_attention: on a GPU, cuDNN's builds a
    # plan for every new shape, most of a decode's time when rows end), so that the two
    # compare schedules, not a torch backend
    with cudnn_attention(cfg.system.cudnn_attention), \
            _instrumented(module, trainer, recorder, targets):
        trainer.train()
    return recorder.rows


# ------------------------------------------------------------------ CLI

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m oppo_ds.peers.trl_peer",
        description="Run TRL 1.12's PPOTrainer on the workload of an oppo-ds config and write "
                    "its per-step metrics in oppo-ds's format (DIR/metrics.jsonl).")
    parser.add_argument("--config", metavar="FILE", help="YAML config (default: the built-in workload)")
    parser.add_argument("--steps", type=int, required=True, help="PPO steps")
    parser.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    prog = "oppo-trl-peer"
    if args.steps < 1:
        print(f"{prog}: error: --steps must be >= 1", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    # accelerate warns once per TRL statistic per step that the data set "had no length"
    for name in ("accelerate", "transformers", "datasets"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers 5's renamed arguments
    from ..config import ConfigError
    from ..datafiles import DataError

    try:
        check_settings(args.config, args.overrides, args.steps, args.seed)
        _import_trl()
        run_trl_peer(args.config, args.overrides, args.steps, args.seed, args.out)
    except PeerUnavailable as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    except (ConfigError, DataError, FileNotFoundError, PeerSettingError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    print(os.path.abspath(os.path.join(args.out, "metrics.jsonl")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
