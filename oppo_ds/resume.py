"""The trainer's checkpoints, what they hold and what a resume may change (a mixin of
``PPOTrainer``; the files themselves are ``CheckpointManager``'s).

A trainer state holds, per rank, the step, the prompt stream's cursor (and PPO-ptx's), the
average of the actor's weights (model.actor_ema), the sampling and shuffling generators, the
chunk-size and Delta controllers, the adaptive KL coefficient, the rollout pool with its
ledger, the frozen streaming scorers' caches of the deferred rows, and the settings that
decide what the engines hold. A resume refuses, in one line naming what differs and before
any engine loads where it can, what it could not continue exactly or without losing or
inventing a deferred row (docs/architecture.md, "Checkpoints"); the placement, streaming and
chunk size may change. With checkpoint.save_hf a checkpoint's models follow in HF format.
"""
from __future__ import annotations

import logging
import os
import shutil
from functools import partial
from typing import Optional

from .config import ConfigError
from .config_checks import BF16_OPTIMIZER_STATES, optimizer_states_kind
from .data import StreamMismatch
from .durable import fsync_dir
from .ema import ActorEMA

logger = logging.getLogger(__name__)

# the settings that decide what a checkpoint's engines hold: resumed under others, the
# engines would load into another model, or continue the old one under a new name
CHECKPOINT_SETTINGS = ("model.actor", "model.critic", "model.builtin_arch", "model.actor_lora_dim",
                       "model.critic_lora_dim", "model.lora_module_name", "model.lora_alpha",
                       "model.only_optimize_lora",
                       "system.backend", "system.tensor_parallel", "system.pipeline_parallel",
                       "system.megatron_layers", "system.zero_stage", "system.dtype",
                       "system.grad_accum_dtype", "ppo.advantage_estimator")

# derived, not a key: whether the weights of the layers given LoRA are frozen (with LoRA,
# without only_optimize_lora; checkpoints written before 2026-11-29 trained them)
LORA_FROZEN = "model.lora_layer_weights_frozen"
# model.lora_learning_rate as set or null (with LoRA): whether the LoRA matrices have an
# optimizer group of their own
LORA_GROUP = "model.lora_learning_rate"

# the settings of the objective a resume may change (the run continues under the new ones),
# named in the log when they differ from the checkpoint's: every ppo key but the optimizer's
# (learning rates, weight decay, Adam's betas and epsilon: logged from the engines' own state),
# the estimator (refused above) and the micro-batch size and token budgets (memory knobs that
# leave the update as it is), the sampling, and the reward function
_OBJECTIVE_EXCLUDED = ("ppo.actor_lr", "ppo.critic_lr", "ppo.weight_decay", "ppo.adam_betas",
                       "ppo.adam_eps", "ppo.advantage_estimator", "ppo.micro_batch_size",
                       "ppo.micro_batch_tokens", "ppo.score_batch_tokens")


def _compared(key: str, value):
    """``value`` of objective setting ``key`` as resumes compare it: one reward function
    (`f`) is the list of it (`[f]`)."""
    return [value] if key == "model.reward_function" and isinstance(value, str) else value


def _source(path: str) -> str:
    """A model source as a resume compares it: a folder by its real path (./ckpt, /abs/ckpt
    and a link to it are one), a name (`builtin`, `tiny-llama`) as it is."""
    return os.path.realpath(path) if os.path.exists(path) else path


def objective_settings(values: dict) -> dict:
    """``{"ppo.kl_coef": 0.05, ...}``: the objective's settings in ``values`` (``Config.to_dict()``)."""
    out = {f"ppo.{k}": v for k, v in values["ppo"].items()}
    out.update({f"generation.{k}": values["generation"][k] for k in ("temperature", "top_k", "top_p")})
    for key in ("reward_function", "reward_weights"):  # what is rewarded
        out[f"model.{key}"] = values["model"].get(key)
    return {k: v for k, v in out.items() if k not in _OBJECTIVE_EXCLUDED}


# a saved prompt stream's settings, as a user sets them
_STREAM_SETTING = {"seed": "seed={}", "num_prompts": "{} prompts", "shuffle": "data.shuffle={}",
                   "world_size": "{} data-parallel ranks",
                   "prompts": "prompts of fingerprint {}"}


def _grad_accum_hint(saved: str) -> str:
    """How to resume a checkpoint whose optimizer files ``saved`` (a ``system.grad_accum_dtype``
    checkpoint setting) describes."""
    if saved == BF16_OPTIMIZER_STATES:
        return ("DeepSpeed's BF16 optimizer wrote its optimizer's files: resume it with "
                "system.zero_stage 1, system.offload false and system.grad_accum_dtype auto "
                "or fp32")
    return (f"its optimizer's files are not DeepSpeed's BF16 optimizer's, which auto picks for "
            f"bf16 under zero_stage 1 without offload: resume it with system.grad_accum_dtype "
            f"{saved}")


class Resumable:
    """``save_checkpoint`` and the resume at start-up (``_maybe_resume``) of ``PPOTrainer``."""

    def _maybe_resume(self) -> None:
        resume = self.cfg.checkpoint.resume
        self.resumed_from: Optional[str] = None  # the checkpoint's tag, once loaded
        if resume == "never":
            if self.is_main and not self.evaluating_only:
                self._set_earlier_checkpoints_aside()
            return
        tag = self.ckpt.auto_tag() if resume == "auto" else resume
        if tag is None:
            return
        self.resumed_from = tag
        # an evaluation builds no critic (trained_engines: the actor alone) and reads the
        # weights alone: the optimizers' states and, where the backend keeps them apart, their
        # bytes on disk stay where they are
        state = self.ckpt.load(tag, engines=self.trained_engines,
                               weights_only=self.evaluating_only,
                               check=partial(self._check_checkpoint_settings, tag))
        self.step_count = state["step"]
        if self.evaluating_only:  # the weights alone: the prompts' position, the pool and the
            return  # controllers are training's (other prompts or limits may be evaluated)
        self._resume_streams(state, tag)
        self._resume_ema(state, tag)
        self.sample_gen.set_state(state["sample_gen"])
        self.shuffle_gen.set_state(state["shuffle_gen"])
        notes = []
        if self.chunk_ctl is not None and state.get("chunk_ctl"):
            notes.append(self.chunk_ctl.load_state_dict(state["chunk_ctl"]))
        self._resume_pool(state, tag)
        if self.cfg.ppo.kl_target is not None:
            if state.get("kl_coef") is not None:
                self.kl_coef = state["kl_coef"]
            else:
                logger.info("checkpoint %s holds no adaptive KL coefficient (written without "
                            "ppo.kl_target): it starts from ppo.kl_coef=%g", tag, self.kl_coef)
        if self.delta_ctl is not None and state.get("delta_ctl"):
            notes.append(self.delta_ctl.load_state_dict(state["delta_ctl"]))
        if self.is_main:
            self._log_resumed(state, tag, notes)

    def _set_earlier_checkpoints_aside(self) -> None:
        """``checkpoint.resume: never`` where an earlier run left checkpoints: they move aside
        whole (a user's checkpoints are not ours to delete, nor to mix with this run's: a
        crash before this run's first save and a restart under ``auto``, the Slurm scripts'
        requeue, would continue the earlier run over this one's logs); said once."""
        old = self.ckpt.tags()
        aside = self.ckpt.set_aside()
        if aside is not None:
            logger.warning("checkpoint.resume=never: %s held an earlier run's checkpoints (%s); "
                           "moved to %s, this run starts afresh", self.ckpt.root,
                           ", ".join(old), aside)

    def _resume_streams(self, state: dict, tag: str) -> None:
        """The prompt stream's position (and PPO-ptx's), refused when the order would differ."""
        try:
            self.stream.load_state_dict(state["stream"])
        except StreamMismatch as err:  # the prompt order would differ: neither exact nor once each
            raise ConfigError("checkpoint.resume", (
                f"checkpoint {tag} was written with " + ", ".join(
                    _STREAM_SETTING[k].format(saved) for k, (saved, _) in err.changed.items())
                + ", this run has " + ", ".join(
                    _STREAM_SETTING[k].format(now) for k, (_, now) in err.changed.items())
                + ": the prompts handed out, and their order, follow them; resume with the "
                  "prompts and settings it was written with, or start afresh with "
                  "checkpoint.resume=never"
                + ("; the same files give other prompts where oppo-ds reads them otherwise "
                   "(since 2026-11-29: split names anywhere in a file's name, ids of several "
                   "sources under their source's name)" if "prompts" in err.changed else "")
                )) from None
        if self.ptx_stream is not None:
            if state.get("ptx_stream"):
                try:
                    self.ptx_stream.load_state_dict(state["ptx_stream"])
                except StreamMismatch as err:
                    raise ConfigError("data.ptx", (
                        f"checkpoint {tag} was written with pretraining text of other blocks or "
                        f"ranks ({', '.join(f'{k}: {saved} then, {now} now' for k, (saved, now) in err.changed.items())}): "
                        "its position in them means nothing here; resume with the data.ptx and "
                        "data.ptx_block_len it was written with, or start afresh with "
                        "checkpoint.resume=never")) from None
            else:
                logger.info("checkpoint %s has no PPO-ptx data position (written without "
                            "data.ptx): pretraining blocks start from the first", tag)

    def _resume_ema(self, state: dict, tag: str) -> None:
        """The actor's weight average, or a new one from the resumed weights."""
        if self.ema is not None:
            if state.get("actor_ema") is not None:
                try:
                    self.ema.load_state_dict(state["actor_ema"])
                except ValueError as err:
                    raise ConfigError("model.actor_ema", f"checkpoint {tag}: {err}; start "
                                      "afresh with checkpoint.resume=never") from None
            else:
                logger.info("checkpoint %s holds no average of the actor (written without "
                            "model.actor_ema): it starts from the resumed weights", tag)
                self.ema = ActorEMA(self.actor.module, self.cfg.model.actor_ema_beta)

    def _resume_pool(self, state: dict, tag: str) -> None:
        """The rollout pool with its deferred rows, and the frozen scorers' caches of them;
        under the stage, the scores its finished rows lack from the scorer rank."""
        held = len(state["pool"]["entries"]) if state.get("pool") else 0
        if self.pool is None and held:
            raise ConfigError("oppo.overcommit", (
                f"0, but checkpoint {tag} holds {held} deferred sequence(s) in its rollout pool, "
                f"which a run without overcommitment would drop; resume with oppo.overcommit "
                f"above 0 or auto, as it was written, or start afresh with checkpoint.resume=never"))
        if self.pool is not None:
            if not state.get("pool"):
                raise ConfigError("oppo.overcommit", (
                    f"{self.cfg.oppo.overcommit}, but checkpoint {tag} has no rollout pool: it was "
                    f"written without overcommitment and cannot continue a run with it; resume "
                    f"with oppo.overcommit=0, or start afresh with checkpoint.resume=never"))
            groups = state["pool"].get("group_size")  # checkpoints before 2026-11-27: unknown
            if held and groups is not None and groups != self.pool.group_size:
                # its rows would be counted and taken in groups of another size: a step
                # would train more or fewer than B, baselines over the wrong responses
                n = self.cfg.data.samples_per_prompt
                raise ConfigError("data.samples_per_prompt", (
                    f"{n}, but checkpoint {tag} holds {held} deferred sequence(s) in groups of "
                    f"{groups} responses a prompt (ppo.advantage_estimator "
                    f"{self.cfg.ppo.advantage_estimator} takes whole groups); resume with "
                    f"data.samples_per_prompt={groups}, as it was written, or start afresh with "
                    f"checkpoint.resume=never"))
            self.pool.load_state_dict(state["pool"])
            self._check_deferral_bound(state, tag)
            limit = self.cfg.generation.max_new_tokens
            longest = max((len(e.tokens) for e in self.pool.running()), default=0)
            if longest >= limit:  # such a row could neither continue nor end where it was cut
                raise ConfigError("generation.max_new_tokens", (
                    f"{limit}, but checkpoint {tag} holds a deferred sequence of {longest} "
                    f"tokens, still running; resume with generation.max_new_tokens above "
                    f"{longest} (as it was written), or start afresh with checkpoint.resume=never"))
            # the frozen scorers' caches of the deferred rows, where this run keeps them: under
            # the stage the scorer rank holds its own and, like any scorer without a row's
            # cache (streaming just turned on, a scorer newly streamed), prefills it afresh
            stale = self._stale_scorer_work(state, tag)
            carried = set(self.cfg.carried_scorer_kinds) - stale
            for kind, scorer_state in state.get("scorers", {}).items():
                if kind in carried:
                    self._carried_scorer(kind).load_state_dict(scorer_state)
            if self.stage is not None:  # finished rows no scorer there saw: scored there now
                self._score_ended_rows_on_stage()

    def _scorer_inputs(self) -> dict:
        """What a frozen scorer's work on a row depends on besides its tokens, by kind: the
        model (a folder by its real path), and for the reference the temperature its
        log-probs are taken at. Saved with the rollout pool (``scorer_inputs``)."""
        m = self.cfg.model
        return {"reward": [_source(m.reward)],
                "reference": [_source(m.reference or m.actor), self.cfg.generation.temperature]}

    def _stale_scorer_work(self, state: dict, tag: str) -> set:
        """The frozen scorers whose work in the resumed pool this run cannot use, its
        ``_scorer_inputs`` changed (``generation.temperature`` and ``model.reward`` /
        ``model.reference`` may change at a resume): their caches of the running rows are not
        loaded (prefilled afresh, as by a scorer newly streamed) and their results of the
        finished rows are dropped (scored whole, at take or on the scorer rank). Checkpoints
        before 2026-11-29 saved no inputs: their temperature is the objective's."""
        saved = state.get("scorer_inputs")
        if saved is None:
            temperature = (state.get("objective") or {}).get("generation.temperature")
            saved = {} if temperature is None else \
                {"reference": [self._scorer_inputs()["reference"][0], temperature]}
        now = self._scorer_inputs()
        stale = {k for k in saved if k in now and list(saved[k]) != now[k]}
        touched = 0
        for entry in self.pool.entries:
            touched += any(entry.results.pop(k, None) is not None for k in sorted(stale))
        def shown(inputs):
            return " at temperature ".join(map(str, inputs))
        for kind in sorted(stale):
            logger.info("checkpoint %s's deferred rows were scored by the %s %s, this run's is %s:"
                        " %d finished row(s) scored anew, the running ones prefilled afresh", tag,
                        kind, shown(saved[kind]), shown(now[kind]), touched)
        return stale

    def _check_deferral_bound(self, state: dict, tag: str) -> None:
        """Refuse a resume whose deferred rows this run could not train within
        ``oppo.max_defer_steps`` (a smaller ``ppo.batch_size`` or bound than the checkpoint's):
        they would be trained later than the bound, deferred again and again."""
        bound, batch = self.cfg.oppo.max_defer_steps, self.cfg.ppo.batch_size
        written = state["pool"].get("batch_size")
        as_written = f" ({written} a rank)" if written not in (None, self.pool.batch_size) else ""
        most = max((e.deferrals for e in self.pool.entries), default=0)
        if most > bound:
            raise ConfigError("oppo.max_defer_steps", (
                f"{bound}, but checkpoint {tag} holds a sequence deferred {most} times already; "
                f"resume with oppo.max_defer_steps={most} or more, as it was written, or start "
                f"afresh with checkpoint.resume=never"))
        late = self.pool.overdue()
        if late is not None:
            k, n = late
            raise ConfigError("ppo.batch_size", (
                f"{batch}, but checkpoint {tag} holds {n} deferred sequence(s) on a rank that "
                f"oppo.max_defer_steps={bound} requires trained within the next {k} step(s), "
                f"more than {k} step(s) of {self.pool.batch_size} rows a rank train; resume "
                f"with the ppo.batch_size it was written with{as_written}, or start afresh "
                f"with checkpoint.resume=never"))

    def _resume_hint(self, what: str) -> str:
        """How to resume from ``what`` (the latest checkpoint): the same command under
        ``checkpoint.resume: auto``; under ``never`` or a tag, that command would start afresh
        or load its tag again."""
        resume = self.cfg.checkpoint.resume
        if resume == "auto":
            return f"the same command resumes from {what}"
        again = "start afresh" if resume == "never" else f"load {resume} again"
        return (f"checkpoint.resume=auto resumes from {what} (this run's "
                f"checkpoint.resume={resume} would {again})")

    def _log_resumed(self, state: dict, tag: str, notes: list) -> None:
        """Say where the run resumed, the controllers' notes, and every optimizer or objective
        setting that differs from the checkpoint's."""
        logger.info("resumed from %s at step %d", tag, self.step_count)
        for note in filter(None, notes):
            logger.info("%s", note)
        keys = {("actor", "lr"): "ppo.actor_lr", ("critic", "lr"): "ppo.critic_lr",
                # one key for both engines' decays, betas and epsilons
                ("actor", "weight_decay"): "ppo.weight_decay", ("actor", "betas"): "ppo.adam_betas",
                ("actor", "eps"): "ppo.adam_eps", ("actor", "lora_lr"): "model.lora_learning_rate",
                ("critic", "lora_lr"): "model.lora_learning_rate"}
        logged = set()
        for (name, setting), key in keys.items():
            engine = self.trained_engines.get(name)
            if engine is not None and setting in engine.resumed_changes and key not in logged:
                logged.add(key)
                # the betas as the YAML gives them
                shown = [list(v) if setting == "betas" else f"{v:g}"
                         for v in reversed(engine.resumed_changes[setting])]
                logger.info("%s: %s, not the %s checkpoint %s was written with", key, *shown, tag)
        saved = state.get("objective") or {}  # none in checkpoints before 2026-11-25
        now = objective_settings(self.cfg.to_dict())
        if state.get("kl_coef") is not None and self.cfg.ppo.kl_target is not None:
            now.pop("ppo.kl_coef")  # only the start: the adaptive coefficient goes on as saved
        for key in (k for k in now if k in saved and
                    _compared(k, saved[k]) != _compared(k, now[k])):
            shown = ["null" if v is None else v for v in (now[key], saved[key])]  # as YAML
            logger.info("%s: %s, not the %s checkpoint %s was written with", key, *shown, tag)

    def _checkpoint_settings(self) -> dict:
        values = self.cfg.to_dict()
        settings = {key: values[key.split(".")[0]][key.split(".")[1]] for key in CHECKPOINT_SETTINGS}
        if self.critic is not None and settings["model.critic"] is None:
            # the critic starts from the reward model: its source is the critic's too
            settings["model.reward"] = values["model"]["reward"]
        for key in ("model.actor", "model.critic", "model.reward"):
            if isinstance(settings.get(key), str):
                settings[key] = _source(settings[key])
        s = self.cfg.system  # whether DeepSpeed's BF16 optimizer wrote the optimizer's files
        settings["system.grad_accum_dtype"] = optimizer_states_kind(
            s.grad_accum_dtype, dtype=s.dtype, zero_stage=s.zero_stage, offload=s.offload) \
            if s.backend == "deepspeed" else s.dtype
        if not (settings["model.actor_lora_dim"] or settings["model.critic_lora_dim"]):
            settings["model.lora_alpha"] = None  # scales no LoRA matrix: free to change
        else:
            if not settings["model.only_optimize_lora"]:
                # the weights of the layers given LoRA are frozen (since 2026-11-29): no
                # optimizer states for them, unlike a checkpoint written while they trained
                settings[LORA_FROZEN] = True
            # a LoRA learning rate puts the LoRA matrices in a group of their own: set or
            # null decides the optimizer's groups (its value may change, as any rate)
            settings[LORA_GROUP] = "null" if self.cfg.model.lora_learning_rate is None else "set"
        if self.evaluating_only:  # no critic is built: what only it follows may differ (and
            # model.reward, which the critic started from, scores); the actor's weights are
            # read from any ZeRO stage's files and cast to this run's dtype
            for key in ("model.critic", "model.critic_lora_dim", "ppo.advantage_estimator",
                        "system.zero_stage", "system.dtype", "system.grad_accum_dtype"):
                del settings[key]
            settings.pop(LORA_FROZEN, None)  # no optimizer is loaded
            settings.pop(LORA_GROUP, None)
        return settings

    def _check_checkpoint_settings(self, tag: str, state: dict) -> None:
        """``ConfigError`` naming every setting of ``CHECKPOINT_SETTINGS`` that differs from
        those ``tag`` was written with (checkpoints from before 2026-11-24 have none)."""
        saved, now = dict(state.get("settings") or {}), self._checkpoint_settings()
        if "system.dtype" in saved and "system.grad_accum_dtype" not in saved:
            # written before the key (2026-11-28): never by DeepSpeed's BF16 optimizer
            saved["system.grad_accum_dtype"] = saved["system.dtype"]
        if LORA_FROZEN in now and LORA_FROZEN not in saved and "model.actor_lora_dim" in saved:
            saved[LORA_FROZEN] = False  # written while the weights of LoRA layers trained
        if LORA_GROUP in now and LORA_GROUP not in saved and "model.actor_lora_dim" in saved:
            saved[LORA_GROUP] = "null"  # written before the key: no group of its own
        changed = [key for key in now if key in saved and saved[key] != now[key]]
        if "system.dtype" in changed and "system.grad_accum_dtype" in changed:
            changed.remove("system.grad_accum_dtype")  # follows the dtype: named once
        if changed:
            first, others = changed[0], changed[1:]
            raise ConfigError(first, (
                f"{now[first]}, but checkpoint {tag} was written with {saved[first]}"
                + "".join(f"; {key}: {now[key]}, written with {saved[key]}" for key in others)
                + ": its actor and critic are those models; "
                + ("evaluate it with the settings it was written with (checkpoint.resume=never "
                   "would evaluate model.actor itself)" if self.evaluating_only else
                   "resume with the settings it was written with, or start afresh "
                   "(checkpoint.resume=never, or another logging.output_dir)")
                + ("; with model.critic null the critic started from model.reward: to score "
                   "with another reward model, set model.critic to the one it started from"
                   if "model.reward" in changed else "")
                + (f"; {_grad_accum_hint(saved['system.grad_accum_dtype'])}"
                   if "system.grad_accum_dtype" in changed else "")
                + ("; it trained the weights of its LoRA layers beside their LoRA matrices, "
                   "which oppo-ds now freezes (as DeepSpeed-Chat does): its optimizer states "
                   "do not fit; resume it with the oppo-ds it was written with"
                   if LORA_FROZEN in changed else "")))

    def save_checkpoint(self) -> None:
        engines = self.trained_engines
        state = {"step": self.step_count, "stream": self.stream.state_dict(),
                 "sample_gen": self.sample_gen.get_state(), "shuffle_gen": self.shuffle_gen.get_state(),
                 "chunk_ctl": self.chunk_ctl.state_dict() if self.chunk_ctl is not None else None,
                 "pool": self.pool.state_dict() if self.pool is not None else None,
                 "ptx_stream": self.ptx_stream.state_dict() if self.ptx_stream is not None else None,
                 "actor_ema": self.ema.state_dict() if self.ema is not None else None,
                 "delta_ctl": self.delta_ctl.state_dict() if self.delta_ctl is not None else None,
                 "kl_coef": self.kl_coef if self.cfg.ppo.kl_target is not None else None,
                 "scorers": {k: s.state_dict() for k, s in self.carried_scorers.items()},
                 "scorer_inputs": self._scorer_inputs(),
                 "settings": self._checkpoint_settings(),
                 "objective": objective_settings(self.cfg.to_dict())}
        tag = f"step{self.step_count}"
        self.ckpt.save(tag, state, engines=engines)
        if self.cfg.checkpoint.save_hf:
            self._save_hf(tag)

    def _save_hf(self, tag: str) -> None:
        """checkpoint.save_hf: the models of ``tag`` in HF format under checkpoints/hf/<tag>,
        written to a temporary folder first, so that a crash mid-export leaves none that looks
        whole."""
        root = os.path.join(self.ckpt.root, "hf")
        final, tmp = os.path.join(root, tag), os.path.join(root, f".{tag}.tmp")
        if self.is_main and os.path.isdir(root):  # this one, and any a crash left behind
            for name in os.listdir(root):
                if name.startswith(".") and name.endswith(".tmp"):
                    shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        self.export(tmp)  # ends with a barrier
        if self.is_main:
            shutil.rmtree(final, ignore_errors=True)  # a checkpoint of this step written again
            os.replace(tmp, final)
            fsync_dir(root)
