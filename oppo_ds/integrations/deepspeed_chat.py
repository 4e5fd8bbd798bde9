"""OPPO inside DeepSpeed-Chat step 3 (DeepSpeedExamples ``applications/DeepSpeed-Chat``).

DeepSpeed-Chat's ``DeepSpeedPPOTrainer.generate_experience(prompts, mask, step)`` generates a
whole batch with HF ``generate``, then runs the actor, reference, critic and reward model
over the finished sequences. ``OppoExperience.generate_experience`` takes its place with the
same arguments and returns the same dict, but builds it the OPPO way on DeepSpeed-Chat's own
engines (``rlhf_engine.actor / ref / critic / reward``):

  * the actor decodes in chunks of ``chunk_size`` tokens (``rollout.generate``), and after
    each chunk the reward model, the reference and the critic prefill the new tokens into
    their own KV caches (``rollout.scorer.StreamingScorer``): when a sequence ends, only its
    last chunk is left to score (intra-step overlap);
  * with ``overcommit`` = Delta > 0 a call decodes the sequences carried from the last call
    plus its new prompts, returns as soon as all but Delta have finished, and defers the
    others, tokens kept, to the next call (``rollout.pool.RolloutPool``; inter-step overlap).

The experience contract (read from ``dschat/rlhf/ppo_trainer.py`` at DeepSpeedExamples
3d83278; B rows, P = prompt width, L = P + longest answer):
  prompts        (B, P) long   left-padded with the tokenizer's pad id
  input_ids      (B, L) long   prompt + answer, answers right-padded with pad
  attention_mask (B, L) long   ``input_ids != pad`` (for OPT, pad = EOS = BOS: the prompt's
                               BOS and the answer's EOS are masked, as DeepSpeed-Chat does)
  logprobs       (B, L-1)      actor log-prob of token t+1 from the output at t
  ref_logprobs   (B, L-1)      the same under the reference
  value          (B, L-1)      critic value at each position t
  rewards        (B,)          reward model's value at the last answer token before the
                               first pad (``RewardModel.forward_value``'s chosen_end_scores)
Dtypes are the models' (fp32 log-probs with ``--compute_fp32_loss``). What differs, by design:
  * ``logprobs`` is DeepSpeed-Chat's own recomputation (one actor forward, train mode);
  * ``ref_logprobs`` / ``value`` are streamed and filled where ``train_rlhf`` reads them, from
    column P-1 to the row's end (``ends``); the columns before (prompt) and after (padding)
    are 0, whether streamed or scored whole (``compute_rewards`` and the GAE never read a
    prompt column, and ``train_rlhf`` zeroes values and rewards after ``ends``);
  * a sampled pad token ends the answer (DeepSpeed-Chat's reward reads only up to the first
    pad anyway); the critic streams in eval mode, so with dropout > 0 its values are the
    dropout-free ones (DeepSpeed-Chat computes them after ``trainer.train()``);
  * under overcommitment a call returns ``need = pool - Delta`` sequences: B in steady state,
    B - Delta on the first call, and prompts of several calls mixed; the last Delta
    prompts of a run stay unfinished;
  * the models' modes are set on the modules, past a hybrid engine's ``eval`` / ``train``
    (which would swap in DeepSpeed's inference layers, see ``_set_mode``): the decode and
    the scorers run the model's own forward, without the hybrid engine's kernels;
  * ZeRO-3 models decode and stream gathered whole on every rank, without ZeRO-3's hooks,
    for the length of the rollout (each rank's pool makes its own number of forwards, which
    per-layer all-gathers could not follow): a full copy of each per rank meanwhile.
Positions: the scorers feed explicit position ids counted over real tokens, which is what
OPT computes from the attention mask and, for rotary models (Llama, Qwen2), gives the same
attention as DeepSpeed-Chat's column positions up to float rounding (rotary attention
depends only on position differences). Models with absolute learned positions that ignore
the mask (GPT-2) would score left-padded prompts differently from DeepSpeed-Chat.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import time
from types import SimpleNamespace
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F

from ..kv_cache import cache_kwargs, output_cache
from ..rollout.controllers import ChunkSizeController, DeltaController, Pipeline
from ..rollout.generate import SamplingParams, cudnn_attention
from ..rollout.pool import BatchStop, PoolEntry, RolloutPool, pool_stream_setup
from ..rollout.scorer import StreamingScorer
from ..rollout.static_decode import check_graph_device
from ..rollout.static_length import run_cache_length
from ..rollout.streaming import stream_continue
from .dschat_flags import auto_int, positive_int

logger = logging.getLogger(__name__)

STREAM_KINDS = ("reward", "reference", "critic")


# ---------------------------------------------------------------- command line

def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add OPPO's flags to DeepSpeed-Chat step 3's parser (returns the parser)."""
    group = parser.add_argument_group("OPPO (oppo_ds)")
    group.add_argument("--enable_oppo", action="store_true",
                       help="Generate experience with OPPO: chunked decoding with streaming "
                            "reward/reference/critic scoring and overcommitment.")
    group.add_argument("--oppo_chunk_size", type=auto_int, default="auto",
                       help="Tokens decoded between two hand-overs to the scorers, or auto "
                            "(chosen online from a cost model and periodic trials).")
    group.add_argument("--oppo_overcommit", type=auto_int, default=0,
                       help="Delta: sequences kept decoding into the next generate_experience "
                            "call instead of waiting for them; auto follows the reward trend "
                            "(0 = every sequence of a call finishes in that call).")
    group.add_argument("--oppo_placement", choices=("auto", "inline", "colocated"), default="auto",
                       help="Where scorer prefill runs: inline (between chunks) or colocated "
                            "(side CUDA stream); auto = colocated on GPU, inline on CPU.")
    group.add_argument("--oppo_sync_every", type=positive_int, default=1,
                       help="Tokens decoded between two host checks of which answers ended "
                            "(1 = every token; N > 1: one wait for the GPU per N tokens, the "
                            "same answers; see oppo_ds's generation.sync_every).")
    group.add_argument("--oppo_static_cache", action="store_true",
                       help="Decode every token at one shape: a fixed-length KV cache, answers "
                            "that ended kept in the batch; the same answers (see oppo_ds's "
                            "generation.static_cache).")
    group.add_argument("--oppo_cuda_graph", action="store_true",
                       help="With --oppo_static_cache: replay the actor's one-token forward as "
                            "a CUDA graph, one launch a token (generation.cuda_graph).")
    group.add_argument("--oppo_cudnn_attention", action="store_true",
                       help="Let the rollout's attention use torch's cuDNN backend, which plans "
                            "every new shape (off by default; system.cudnn_attention).")
    return parser


def enable_oppo(trainer, args) -> Optional["OppoExperience"]:
    """With ``--enable_oppo``, route ``trainer.generate_experience`` through OPPO (returns the
    ``OppoExperience``, also kept as ``trainer.oppo``); without it, do nothing."""
    if not getattr(args, "enable_oppo", False):
        return None
    oppo = OppoExperience.from_trainer(trainer, args)
    trainer.generate_experience = oppo.generate_experience
    trainer.oppo = oppo
    return oppo


# ---------------------------------------------------------------- model views

def _unwrap(engine):
    """The module inside a DeepSpeed engine (or the module itself)."""
    return getattr(engine, "module", engine)


def _zero_stage(engine) -> int:
    stage = getattr(engine, "zero_optimization_stage", None)
    return int(stage()) if callable(stage) else 0


def _host_timed(**engines) -> list[str]:
    """DeepSpeed's throughput timer, on in DeepSpeed-Chat's engines, synchronizes the whole
    device in a hook before every forward of its module from the third optimizer step on
    (their ``deepspeed.initialize`` gets no dataloader): once a token in the actor's decode,
    and in the colocated scorers' forwards, each then waiting for the other's kernels. The
    timer stays on (DeepSpeed's samples/sec lines), timed on the host instead. Returns the
    names of the engines changed."""
    changed = []
    for name, engine in engines.items():
        timer = getattr(engine, "tput_timer", None)
        if timer is not None and timer.config.enabled and timer.config.synchronized:
            timer.config.synchronized = False
            changed.append(name)
    if changed:
        logger.info("oppo: DeepSpeed's throughput timer of %s no longer synchronizes the device "
                    "before each forward (its samples/sec are host time)", ", ".join(changed))
    return changed


def _set_mode(engine, training: bool) -> None:
    """Train or eval mode on the module inside ``engine``, past the engine's own ``eval`` and
    ``train``. Under ``--enable_hybrid_engine`` (``DeepSpeedHybridEngine``, on a GPU, for an
    architecture DeepSpeed has kernels for) ``eval()`` replaces each decoder layer's forward by
    DeepSpeed's injected inference layer, which keeps a KV cache of its own and ignores the
    one the chunked decoder and the streaming scorers pass, and ``train()`` swaps back and
    converts the weights for training. OPPO's decode and the experience run the model's own
    forward (the streamed scores equal whole-sequence scoring only with it); the engine's
    forward and training are what DeepSpeed-Chat's are: a plain ``DeepSpeedEngine.eval`` /
    ``train`` only sets the module's mode, as here."""
    _unwrap(engine).train(training)


def _dtype(engine) -> torch.dtype:
    return next(_unwrap(engine).parameters()).dtype


class ValueView:
    """DeepSpeed-Chat's ``RewardModel`` (``rwtransformer`` body + ``v_head``) seen as the
    value-head model a ``StreamingScorer`` expects: a cached forward with explicit position
    ids returning ``.values`` (N, L) and ``.past_key_values``. Its own ``forward_value``
    neither returns the cache nor takes positions, so the view calls the two parts itself."""

    def __init__(self, reward_model):
        self.model = _unwrap(reward_model)
        self.config = self.model.rwtransformer.config

    def parameters(self):
        return self.model.parameters()

    def __call__(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None,
                 use_cache=False, **_):
        out = self.model.rwtransformer(input_ids=input_ids, attention_mask=attention_mask,
                                       position_ids=position_ids, use_cache=use_cache,
                                       **cache_kwargs(self.model.rwtransformer, past_key_values))
        values = self.model.v_head(out[0]).squeeze(-1)
        return SimpleNamespace(values=values, past_key_values=output_cache(out))


class DSChatScorer:
    """A ``StreamingScorer`` fed what DeepSpeed-Chat's whole-sequence forward attends to.

    Its attention mask is ``input_ids != pad``: prompt tokens equal to pad (OPT's BOS) are
    masked, and so is an answer's end token when it is the pad (OPT's EOS). The reward and
    the critic therefore take a chunk only up to a pad (``skip_pad``); the reference takes
    every token, because DeepSpeed-Chat scores the EOS token's log-prob from the output
    before it. DeepSpeed-Chat's trainer also reads one column past the last non-pad answer
    token: the critic's value AT that token, and the reference log-prob of the token after
    it (the pad that follows, when the answer's end is not the pad itself). A streaming
    scorer gives outputs before each token it consumed, so ``finish`` first feeds one more
    pad token to the reference and the critic: causal attention keeps it invisible to every
    output before it, and ``OppoExperience`` keeps only the columns the trainer reads."""

    def __init__(self, scorer: StreamingScorer, pad_id: int):
        self.inner, self.kind, self.pad_id = scorer, scorer.kind, pad_id
        self.skip_pad = scorer.kind in ("reward", "critic")

    @property
    def rows(self) -> torch.Tensor:
        return self.inner.rows

    def add(self, rows, prompt_ids, prompt_mask, prefix_ids=None, prefix_lengths=None) -> None:
        mask = prompt_mask * (prompt_ids != self.pad_id).to(prompt_mask.dtype)
        # the scorer reads a row's last prompt column: it stays real even if it is the pad
        mask[:, -1] = prompt_mask[:, -1]
        self.inner.add(rows, prompt_ids, mask, prefix_ids, prefix_lengths)

    def consume(self, rows: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor) -> None:
        if self.skip_pad:
            width = tokens.shape[1]
            real = (torch.arange(width, device=tokens.device)[None, :] < lengths[:, None]) \
                & (tokens != self.pad_id)
            lengths = real.long().cumprod(1).sum(1)  # tokens before the first pad
            keep = lengths > 0
            if not bool(keep.all()):
                rows, tokens, lengths = rows[keep], tokens[keep], lengths[keep]
        if rows.numel():
            self.inner.consume(rows, tokens, lengths)

    def finish(self, rows) -> dict:
        rows = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
        if self.kind != "reward" and rows.numel():
            one = torch.full((rows.numel(), 1), self.pad_id, dtype=torch.long, device=rows.device)
            self.inner.consume(rows, one, torch.ones(rows.numel(), dtype=torch.long,
                                                     device=rows.device))
        return self.inner.finish(rows)


# what HF generate does beyond temperature, top-k and top-p, with each setting's neutral value:
# the chunked decode samples from the policy itself (whose log-probs PPO uses) and applies none
_NOT_APPLIED = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "typical_p": 1.0,
                "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "min_p": None, "min_length": 0,
                "min_new_tokens": None, "bad_words_ids": None, "suppress_tokens": None,
                "begin_suppress_tokens": None, "forced_bos_token_id": None,
                "forced_eos_token_id": None, "exponential_decay_length_penalty": None,
                "sequence_bias": None}


def _generation_setting(gen, key: str):
    """``gen``'s ``key`` as HF generate takes it: its own value, else transformers' default
    (``top_k`` 50 when sampling: a config that does not set it samples from the top 50)."""
    value = getattr(gen, key, None)
    defaults = getattr(gen, "_get_default_generation_params", None)
    if value is None and callable(defaults):
        value = defaults().get(key)
    return value


def sampling_from_actor(actor, tokenizer, max_answer_seq_len: int) -> SamplingParams:
    """The decoding DeepSpeed-Chat's ``actor.module.generate(...)`` does: the actor's own
    generation config (greedy unless it says ``do_sample``; always greedy for Llama, which
    DeepSpeed-Chat forces) with transformers' defaults for what it leaves unset (top-k 50),
    ending at its EOS ids; the tokenizer's pad also ends an answer. Its other logits
    processors (a repetition penalty, a minimum length, ...) are not applied: one warning
    names those it sets."""
    module = _unwrap(actor)
    gen = getattr(module, "generation_config", None)
    do_sample = bool(getattr(gen, "do_sample", False)) and module.config.model_type != "llama"
    ignored = {key: getattr(gen, key) for key, neutral in _NOT_APPLIED.items()
               if getattr(gen, key, None) not in (None, neutral)}
    if ignored:
        logger.warning("the actor's generation config sets %s, which HF generate applies and "
                       "the chunked decode does not: it samples from the policy itself, whose "
                       "log-probs PPO trains on (temperature, top-k and top-p apply)",
                       ", ".join(f"{k}={v}" for k, v in ignored.items()))
    eos = getattr(gen, "eos_token_id", None)
    if eos is None:
        eos = module.config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    pad = tokenizer.pad_token_id
    ends = tuple(dict.fromkeys([*eos, pad]))
    if not do_sample:
        return SamplingParams(max_new_tokens=max_answer_seq_len, eos_token_ids=ends,
                              pad_token_id=pad, temperature=0.0)
    temperature, top_k, top_p = (_generation_setting(gen, key)
                                 for key in ("temperature", "top_k", "top_p"))
    return SamplingParams(max_new_tokens=max_answer_seq_len, eos_token_ids=ends, pad_token_id=pad,
                          temperature=float(1.0 if temperature is None else temperature),
                          top_k=int(top_k or 0), top_p=float(1.0 if top_p is None else top_p))


def gather_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[label]: (B, T, V), (B, T) -> (B, T)."""
    return F.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


class _Prompt(SimpleNamespace):
    """What ``RolloutPool.top_up`` reads: ``id`` and ``input_ids``."""


# ---------------------------------------------------------------- the experience maker

class OppoExperience:
    """DeepSpeed-Chat's ``generate_experience`` with OPPO's rollout (see the module docstring).

    actor / ref / critic / reward: DeepSpeed-Chat's engines (the critic and reward wrap its
    ``RewardModel``); tokenizer: its tokenizer (``pad_token_id``). chunk_size: int or
    ``"auto"``; overcommit: Delta, int or ``"auto"`` (then within [0, ``delta_max``],
    default a quarter of the first batch); stream_to: which of reference / critic stream
    besides the reward (the others score whole sequences after decoding); placement:
    ``inline`` or ``colocated``; sync_every: tokens decoded between two host checks of
    which answers ended (``generation.sync_every``); static_cache, cuda_graph: the actor's
    decode at one shape, replayed as a CUDA graph (``generation.static_cache``,
    ``generation.cuda_graph``); cudnn_attention: let the rollout's and the experience's
    forwards use torch's cuDNN attention (``system.cudnn_attention``; off: it plans every new
    shape). ``stats`` holds the last call's figures."""

    def __init__(self, actor, ref, critic, reward, tokenizer, *, max_answer_seq_len: int,
                 chunk_size: Union[int, str] = "auto", overcommit: Union[int, str] = 0,
                 placement: str = "auto", stream_to: Sequence[str] = ("reference", "critic"),
                 max_defer_steps: int = 2, delta_max: Optional[int] = None, sync_every: int = 1,
                 static_cache: bool = False, cuda_graph: bool = False,
                 cudnn_attention: bool = False, compute_fp32_loss: bool = False,
                 print_answers: bool = False, print_answers_interval: int = 1,
                 seed: Optional[int] = None, trainer=None):
        self.actor, self.ref, self.critic, self.reward = actor, ref, critic, reward
        self.tokenizer, self.trainer = tokenizer, trainer
        self.pad_id = tokenizer.pad_token_id
        if self.pad_id is None:
            raise ValueError("the tokenizer has no pad token (DeepSpeed-Chat's load_hf_tokenizer "
                             "sets one)")
        self.rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        if chunk_size != "auto" and int(chunk_size) < 1:
            raise ValueError(f"chunk_size must be >= 1 or auto, got {chunk_size}")
        unknown = set(stream_to) - {"reference", "critic"}
        if unknown:
            raise ValueError(f"stream_to: unknown scorer(s) {sorted(unknown)}; allowed: "
                             f"reference, critic")
        device = next(_unwrap(actor).parameters()).device
        self.device = device
        self.placement = placement if placement != "auto" else \
            ("colocated" if device.type == "cuda" else "inline")
        self.stream_to = tuple(stream_to)
        if cuda_graph:  # at once, not at the first call's decode
            check_graph_device(device, "cuda_graph (--oppo_cuda_graph)",
                               "leave --oppo_cuda_graph out")
        self.host_timed = _host_timed(actor=actor, ref=ref, critic=critic, reward=reward)
        self.sampling = dataclasses.replace(
            sampling_from_actor(actor, tokenizer, max_answer_seq_len), sync_every=sync_every,
            static_cache=static_cache, cuda_graph=cuda_graph)
        self.compute_fp32_loss, self.cudnn_attention = compute_fp32_loss, cudnn_attention
        self.print_answers, self.print_every = print_answers, max(1, print_answers_interval)
        self.generator = torch.Generator().manual_seed((seed or 0) * 1000 + self.rank)
        self.chunk_size = chunk_size
        self.chunk_ctl = ChunkSizeController(overlapped=self.placement != "inline") \
            if chunk_size == "auto" else None
        self.overcommit, self.delta_max = overcommit, delta_max
        self.delta_ctl: Optional[DeltaController] = None  # made on the first call (needs B)
        self.pool = RolloutPool(batch_size=1, max_defer_steps=max_defer_steps)
        self.max_defer_steps = max_defer_steps
        self.carried: dict[str, DSChatScorer] = {}  # frozen scorers' caches live across calls
        self.calls = 0
        self.last_generated_experience: Optional[dict] = None
        self.generate_time = 0.0
        self.stats: dict = {}

    @classmethod
    def from_trainer(cls, trainer, args) -> "OppoExperience":
        """From DeepSpeed-Chat's ``DeepSpeedPPOTrainer`` and its parsed step-3 arguments."""
        return cls(trainer.actor_model, trainer.ref_model, trainer.critic_model,
                   trainer.reward_model, trainer.tokenizer,
                   max_answer_seq_len=args.max_answer_seq_len,
                   chunk_size=getattr(args, "oppo_chunk_size", "auto"),
                   overcommit=getattr(args, "oppo_overcommit", 0),
                   placement=getattr(args, "oppo_placement", "auto"),
                   sync_every=getattr(args, "oppo_sync_every", 1),
                   static_cache=getattr(args, "oppo_static_cache", False),
                   cuda_graph=getattr(args, "oppo_cuda_graph", False),
                   cudnn_attention=getattr(args, "oppo_cudnn_attention", False),
                   compute_fp32_loss=getattr(args, "compute_fp32_loss", False),
                   print_answers=getattr(args, "print_answers", False),
                   print_answers_interval=getattr(args, "print_answers_interval", 1),
                   seed=getattr(args, "seed", None), trainer=trainer)

    # ------------------------------------------------------------ the call DeepSpeed-Chat makes

    def generate_experience(self, prompts: torch.Tensor, mask: torch.Tensor, step: int) -> dict:
        """DeepSpeed-Chat's contract: left-padded prompts (B, P) and their mask in, the
        experience dict out (see the module docstring)."""
        for engine in (self.actor, self.critic, self.reward, self.ref):
            _set_mode(engine, training=False)
        start = time.time()
        with cudnn_attention(self.cudnn_attention):  # see system.cudnn_attention
            taken, streamed = self._rollout(prompts, mask)
        self.generate_time = time.time() - start
        if self.trainer is not None:
            self.trainer.generate_time = self.generate_time
        batch = self._batch(taken, streamed, max(prompts.shape[1], 2))
        if batch is None:
            if self.last_generated_experience is None:
                raise RuntimeError(f"every answer of step {step} is too short (<= 1 token) "
                                   f"and there is no earlier experience to reuse")
            logger.warning("step %d: every answer is too short; reusing the last experience", step)
            last = self.last_generated_experience
            batch = (last["prompts"], last["seq"], None)
        else:
            self.last_generated_experience = {"prompts": batch[0], "seq": batch[1]}
        prompts_out, seq, streamed_rows = batch
        if self.print_answers and step % self.print_every == 0:
            width = prompts_out.shape[1]
            decode = self.tokenizer.batch_decode
            print(f"--- prompt --> step={step}, rank={self.rank}, "
                  f"{decode(prompts_out, skip_special_tokens=True)}")
            print(f"--- ans    --> step={step}, rank={self.rank}, "
                  f"{decode(seq[:, width:], skip_special_tokens=True)}")
        if self.rank == 0:
            st = self.stats
            print(f"OPPO step {step} | chunk_size {st['chunk_size']} | delta {st['delta']} | "
                  f"returned {st['returned']} | deferred {st['deferred']} | decoded "
                  f"{st['decoded_tokens']} tokens | scoring hidden "
                  f"{st['scoring_hidden_frac']:.2f}", flush=True)
        # as DeepSpeed-Chat: its log-prob forward runs in train mode
        _set_mode(self.actor, training=True)
        _set_mode(self.critic, training=True)
        with cudnn_attention(self.cudnn_attention):
            experience = self._experience(prompts_out, seq, streamed_rows)
        if self.delta_ctl is not None:
            decision = self.delta_ctl.observe(self._mean_over_ranks(experience["rewards"]))
            if decision and self.rank == 0:
                print(f"OPPO step {step}: {decision}", flush=True)
        return experience

    def _mean_over_ranks(self, rewards: torch.Tensor) -> float:
        """The batch's mean reward over all ranks, so that every rank's Delta moves alike."""
        total = torch.stack([rewards.float().sum(),
                             torch.tensor(float(rewards.numel()), device=rewards.device)])
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(total)
        return float(total[0] / total[1])

    # ------------------------------------------------------------ rollout

    def _rollout(self, prompts: torch.Tensor, mask: torch.Tensor):
        """Top the pool up with this call's prompts, decode until all but Delta have
        finished; returns the taken entries and their streamed results."""
        self.calls += 1
        new = [_Prompt(id=f"{self.calls}:{i}", input_ids=row[m.bool()].tolist())
               for i, (row, m) in enumerate(zip(prompts.cpu(), mask.cpu()))]
        pool = self.pool
        pool.top_up(new, len(pool) + len(new))
        if self.overcommit == "auto" and self.delta_ctl is None:
            cap = self.delta_max if self.delta_max is not None else max(1, len(new) // 4)
            self.delta_ctl = DeltaController(delta_min=0, delta_max=cap)
        delta = self.delta_ctl.delta if self.delta_ctl is not None else int(self.overcommit)
        most = self.delta_ctl.delta_max if self.delta_ctl is not None else delta
        if self.calls == 1 and most > len(new):  # as oppo-train's: more due than a call takes
            flag = "--oppo_overcommit" if self.delta_ctl is None else "delta_max"
            raise ValueError(
                f"{flag} {most} is more than the {len(new)} prompts a call generates for "
                f"(--per_device_generation_batch_size): more carried answers than a call "
                f"returns could reach max_defer_steps ({self.max_defer_steps}) together, and "
                f"the bound would not hold; use at most {len(new)}")
        if self.sampling.static_cache and not self.sampling.static_length:
            # one static cache for every call: one length (DeepSpeed-Chat pads its prompts
            # to max_prompt_seq_len; deferred answers are packed after their prompts) and one
            # width (a call's prompts and the most deferred answers it can carry)
            self.sampling = dataclasses.replace(self.sampling, static_length=run_cache_length(
                prompts.shape[1], self.sampling.max_new_tokens, self.sampling.sync_every,
                carries=self.overcommit != 0), static_rows=len(new) + most)
        need = max(1, len(pool) - delta)
        pool.batch_size = need
        running, waiting = pool.running(), pool.waiting()
        forced = [i for i, e in enumerate(running) if e.forced(self.max_defer_steps)]
        stop = BatchStop(need, len(waiting), forced, sync=False,
                         blocks=self.sampling.sync_every > 1)
        chunk = self.chunk_ctl.next_chunk_size() if self.chunk_ctl is not None \
            else int(self.chunk_size)
        before = sum(len(e.tokens) for e in running)
        timing = None
        t0 = time.perf_counter()
        with self._gathered():  # every rank enters, whether or not it has rows to decode
            if running and not stop(None):
                inputs = pool.decode_inputs(running, self.pad_id, self.device)
                state, results, timing = self._stream(running, inputs, chunk, stop)
                pool.absorb(running, state, version=self.calls, step=self.calls)
                for entry in running:
                    entry.results.update({kind: per_row[entry.uid]
                                          for kind, per_row in results.items()
                                          if entry.uid in per_row})
        seconds = time.perf_counter() - t0
        produced = sum(len(e.tokens) for e in running) - before
        taken = pool.take()
        pool.check()
        if timing is not None and self.chunk_ctl is not None and produced:
            scorers = len(timing.scorers)
            self.chunk_ctl.observe(chunk, seconds / produced, timing.chunks * scorers,
                                   produced * scorers, timing.scoring_busy_s, scorers=scorers,
                                   pipeline=Pipeline.from_timing(timing))
        self.stats = {"chunk_size": chunk, "delta": delta, "returned": len(taken),
                      "deferred": len(pool), "decoded_tokens": produced, "rollout_s": seconds,
                      "scoring_hidden_frac": timing.scoring_hidden_frac if timing else 0.0}
        return taken, {e.uid: e.results for e in taken}

    def _gathered(self):
        """The rollout's ZeRO-3 models whole on every rank for the whole call, their forwards
        free of collectives (``gathered_without_hooks``; every rank enters it). Without it
        each forward of a ZeRO-3 model is collective (its layers are all-gathered), while the
        ranks' pools make different numbers of forwards (each stops decoding at its own token
        and streams only its own running rows): the collectives would not pair up. Costs a
        full copy of each gathered model's weights per rank during the rollout, as the
        actor's under DeepSpeed-Chat's hybrid engine and oppo-train's ZeRO-3 rollout."""
        models = [self.actor, self.reward] + [m for kind, m in (("reference", self.ref),
                                                                ("critic", self.critic))
                                              if kind in self.stream_to]
        zero3 = list({id(m): m for m in models if _zero_stage(m) == 3}.values())
        if not zero3:
            return contextlib.nullcontext()
        from ..engines.deepspeed_engine import gathered_without_hooks

        return gathered_without_hooks(zero3)

    def _on_every_rank(self, engine, needed: bool) -> bool:
        """Whether any rank needs a forward of ``engine``: under ZeRO-3 with several ranks a
        forward is collective, so every rank runs it when one does."""
        if self.world == 1 or _zero_stage(engine) != 3:
            return needed
        flag = torch.tensor([int(needed)], device=self.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    def _stream(self, running: list[PoolEntry], inputs: dict, chunk: int, stop: BatchStop):
        frozen = ["reward"] + [k for k in self.stream_to if k == "reference"]
        # the critic trains between calls: its cache is rebuilt, prefixes included
        critic = DSChatScorer(StreamingScorer(ValueView(self.critic), "critic"), self.pad_id) \
            if "critic" in self.stream_to else None
        uids, scorers, setup = pool_stream_setup(running, inputs, self._carried_scorer, frozen,
                                                 critic=critic, device=self.device)
        return stream_continue(_unwrap(self.actor), scorers, setup, inputs, uids, self.sampling,
                               self.generator, chunk, placement=self.placement, stop=stop)

    def _carried_scorer(self, kind: str) -> DSChatScorer:
        if kind not in self.carried:
            model = ValueView(self.reward) if kind == "reward" else _unwrap(self.ref)
            self.carried[kind] = DSChatScorer(StreamingScorer(model, kind), self.pad_id)
        return self.carried[kind]

    # ------------------------------------------------------------ DeepSpeed-Chat's tensors

    def _batch(self, taken: list[PoolEntry], streamed: dict, min_width: int):
        """(prompts (N, P), seq (N, L), streamed results per kept row) of the taken entries
        whose answer has more than one non-pad token (DeepSpeed-Chat drops the others), or
        None when none has."""
        # rows in the order their prompts arrived (DeepSpeed-Chat's order when Delta = 0)
        keep = sorted((e for e in taken if sum(1 for t in e.tokens if t != self.pad_id) > 1),
                      key=lambda e: e.uid)
        if not keep:
            return None
        width = max([min_width] + [len(e.prompt) for e in keep])
        answer = max(len(e.tokens) for e in keep)
        seq = torch.full((len(keep), width + answer), self.pad_id, dtype=torch.long)
        for i, e in enumerate(keep):
            seq[i, width - len(e.prompt):width] = torch.tensor(e.prompt, dtype=torch.long)
            seq[i, width:width + len(e.tokens)] = torch.tensor(e.tokens, dtype=torch.long)
        seq = seq.to(self.device)
        return seq[:, :width].clone(), seq, [streamed[e.uid] for e in keep]

    @torch.no_grad()
    def _experience(self, prompts: torch.Tensor, seq: torch.Tensor,
                    streamed: Optional[list[dict]]) -> dict:
        attention_mask = seq.not_equal(self.pad_id).long()
        width, columns = prompts.shape[1], seq.shape[1] - 1
        logits = self.actor(seq, attention_mask=attention_mask).logits
        if self.compute_fp32_loss:
            logits = logits.to(torch.float)
        out = {"prompts": prompts,
               "logprobs": gather_log_probs(logits[:, :-1, :], seq[:, 1:])}
        lp_dtype = torch.float if self.compute_fp32_loss else _dtype(self.ref)
        kinds = {"reference": ("ref_logprobs", lp_dtype), "critic": ("value", _dtype(self.critic)),
                 "reward": ("rewards", _dtype(self.reward))}
        # train_rlhf reads columns P-1 .. P-1+n of a row with n non-pad answer tokens
        reads = (attention_mask[:, width:].sum(1) + 1).tolist()
        for kind, (key, dtype) in kinds.items():
            rows = [r.get(kind) for r in streamed] if streamed is not None else [None] * len(seq)
            whole = None
            engine = {"reference": self.ref, "critic": self.critic, "reward": self.reward}[kind]
            if self._on_every_rank(engine, any(r is None for r in rows)):
                whole = self._score_whole(kind, seq, attention_mask, width)
            if kind == "reward":
                value = torch.stack([(whole[i] if r is None else r).to(device=seq.device,
                                                                        dtype=dtype)
                                     for i, r in enumerate(rows)])
            else:
                value = torch.zeros(len(seq), columns, dtype=dtype, device=seq.device)
                for i, r in enumerate(rows):
                    if r is None:  # the row's read window of the whole-sequence scores
                        r = whole[i, width - 1:]
                    n = min(r.numel(), reads[i], columns - (width - 1))
                    value[i, width - 1:width - 1 + n] = r[:n].to(dtype)
            out[key] = value.to(dtype).to(seq.device)
        out["input_ids"], out["attention_mask"] = seq, attention_mask
        return {k: out[k] for k in ("prompts", "logprobs", "ref_logprobs", "value", "rewards",
                                    "input_ids", "attention_mask")}

    def _score_whole(self, kind: str, seq: torch.Tensor, attention_mask: torch.Tensor,
                     prompt_length: int) -> torch.Tensor:
        """DeepSpeed-Chat's own whole-sequence scoring, for rows that have no streamed result
        (a scorer not in ``stream_to``, a deferred row whose critic values went stale, or a
        reused experience)."""
        if kind == "reference":
            logits = self.ref(seq, attention_mask=attention_mask).logits
            if self.compute_fp32_loss:
                logits = logits.to(torch.float)
            return gather_log_probs(logits[:, :-1, :], seq[:, 1:])
        if kind == "critic":
            return self.critic.forward_value(seq, attention_mask,
                                             return_value_only=True).detach()[:, :-1]
        return self.reward.forward_value(seq, attention_mask,
                                         prompt_length=prompt_length)["chosen_end_scores"].detach()
