"""Our own decode loop over a causal LM's forward with a KV cache.

HF ``generate`` runs a batch from start to end in one call. OPPO needs to stop after a chunk,
hand the new tokens to the scorers, resume, and carry unfinished sequences into the next
step, so decoding is split into ``start_decode`` (prefill) and ``decode_steps`` (advance up
to n tokens) over an explicit ``DecodeState``. Finished rows are dropped from the KV cache as
they finish, so the long tail decodes only what is still running.

Policy log-probs are those of the temperature-scaled distribution (``logits / temperature``)
before top-k / top-p truncation: the distribution PPO optimises (the trainer scales the same
way), not the truncated one sampled from.

Two log-probs per token are kept. ``logprobs`` are the behaviour log-probs: those of the policy
that sampled the token, recorded once (a deferred row's carried tokens keep theirs).
``actor_logprobs`` are the log-probs under the weights this state decodes with, what PPO calls
the old log-probs: equal to ``logprobs`` for every token sampled here, and for a carried
prefix taken from the prefill that rebuilds its KV cache under the current weights. The
trainer uses them in place of one more actor forward after generation when the actor
"streams" (``oppo.stream_to`` holds ``actor``).
"""
from __future__ import annotations

import contextlib
import inspect
import sys
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from ..algo import logprobs as logprobs_module
from ..algo import policy_logits, policy_token_logprobs
from ..finite import FP16_RANGE, LARGE_UPDATE, NonFiniteError
from ..kv_cache import cache_kwargs, output_cache
from .static_decode import StaticDecode
from .static_length import cache_length


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0            # 0 = off
    top_p: float = 1.0        # 1 = off
    sync_every: int = 1       # tokens between two host checks of which rows ended (see
                              # ``decode_steps``); 1 = after every token
    static_cache: bool = False  # every decode forward of one shape (``StaticDecode``)
    cuda_graph: bool = False    # replay that forward as a CUDA graph (needs static_cache)
    static_length: int = 0      # the static cache's length for every rollout (0: each rollout
                                # its own need; one that needs more takes more)
    static_rows: int = 0        # the most rows a rollout of the run decodes (0: unknown): the
                                # static buffers are that wide and serve every smaller rollout

    def __post_init__(self):
        if self.sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {self.sync_every}")
        if self.cuda_graph and not self.static_cache:
            raise ValueError("cuda_graph needs static_cache: a graph replays one shape")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k and the top-p nucleus to -inf. logits: (N, V)."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p; the top token always stays
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_tokens(logits: torch.Tensor, params: SamplingParams,
                  generator: Optional[torch.Generator],
                  uniforms: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens and their policy log-probs. logits: (N, V) -> (N,), (N,). ``uniforms``
    (N,) on the logits' device: draw by ``inverse_cdf_sample`` from these instead of from
    ``generator`` (the block decode's uniforms, drawn ahead)."""
    scaled = _policy_logits(logits, params)
    if params.greedy:
        tokens = scaled.argmax(-1)
        return tokens, _token_logprobs(scaled, tokens)
    probs = filter_logits(scaled, params.top_k, params.top_p).softmax(-1)
    if probs.device.type == "cpu":  # free here; on a GPU NaN log-probs reach the step's check
        _check_distribution(probs)
    if uniforms is not None:
        tokens = inverse_cdf_sample(probs, uniforms)
    # by type: a generator made for "cuda" reports cuda, the logits cuda:0
    elif generator is None or generator.device.type == probs.device.type:
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    else:
        # a CPU generator (the trainer's, whose state its checkpoints hold) with the logits on
        # a GPU: draw one uniform per row on the CPU and invert the CDF on the GPU, instead
        # of moving (N, V) probabilities to the host every token (V = 152k: 39 MB at N = 64)
        u = torch.rand(probs.shape[0], dtype=torch.float64, generator=generator)
        tokens = inverse_cdf_sample(probs, u.to(probs.device))
    return tokens, _token_logprobs(scaled, tokens)


def _check_distribution(probs: torch.Tensor) -> None:
    """``NonFiniteError`` for rows of ``probs`` that are not finite (``torch.multinomial``
    would stop with "probability tensor contains either `inf`, `nan` or element < 0")."""
    bad = int((~torch.isfinite(probs).all(-1)).sum())
    if bad:
        raise NonFiniteError(
            f"the actor's next-token distribution is nan or inf for {bad} of {probs.shape[0]} "
            f"responses while sampling: its logits are not finite: weights that hold NaN or inf, "
            f"an overflow in fp16 ({FP16_RANGE}), or, {LARGE_UPDATE}")


def inverse_cdf_sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` (N, V; rows need not sum to 1 exactly) for uniforms
    ``u`` (N,) in [0, 1): the first token whose cumulative mass exceeds u times the row's
    total. A token of zero probability is never drawn (its cumulative mass equals the one
    before it, which u * total already reached)."""
    cdf = probs.double().cumsum(-1)
    target = (u.double() * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)


@dataclass
class DecodeState:
    """Everything needed to continue decoding a batch. Rows are indexed 0..B-1 by their place
    in the original batch; ``active`` lists the rows still running, in cache order."""
    prompt_ids: torch.Tensor        # (B, P) left-padded prompts
    prompt_mask: torch.Tensor       # (B, P)
    tokens: torch.Tensor            # (B, max_new_tokens) response tokens, pad after the end
    logprobs: torch.Tensor          # (B, max_new_tokens) behaviour log-probs, 0 after the end
    actor_logprobs: torch.Tensor    # (B, max_new_tokens) log-probs under this decode's weights
    lengths: torch.Tensor           # (B,) tokens generated so far
    finished: torch.Tensor          # (B,) bool
    active: torch.Tensor            # (A,) row indices still decoding, in cache order
    past_key_values: object         # KV cache of the active rows
    cache_mask: torch.Tensor        # (A, cached positions) attention mask of the cache
    next_position: torch.Tensor     # (A,) position id of the next token fed
    next_logits: Optional[torch.Tensor]  # (A, V) logits predicting the next token
    targets: Optional[torch.Tensor] = None  # (B,) per-row length limit (a length oracle)
    finish_order: list = field(default_factory=list)  # rows in the order they finished
    stopped: bool = False           # a stop rule ended decoding before every row finished
    static: Optional[StaticDecode] = None  # generation.static_cache: the fixed-shape buffers
                                    # (then every row stays in the cache, ``cache_mask`` None)

    @property
    def done(self) -> bool:
        return self.active.numel() == 0

    @property
    def over(self) -> bool:
        """Nothing more to decode: every row finished, or a stop rule said enough."""
        return self.stopped or self.done

    def response_mask(self) -> torch.Tensor:
        steps = torch.arange(self.tokens.shape[1], device=self.tokens.device)
        return (steps[None, :] < self.lengths[:, None]).to(self.logprobs.dtype)


def cudnn_attention(enabled: bool):
    """A context in which torch's scaled-dot-product attention may use its cuDNN backend
    (``enabled``: torch's own choice, nothing changed) or every backend but it. cuDNN builds a
    plan per new input shape, and a rollout meets new shapes nearly every forward (rows end,
    chunks and prompts change width): on an H100 the decode at new shapes took 72 ms a token
    with it, 25 ms without (``system.cudnn_attention``). Process-wide while it lasts (torch's
    backend switches are), so the colocated scorers' thread is covered too."""
    if enabled:
        return contextlib.nullcontext()
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # a torch without the switch has no cuDNN attention either
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                        SDPBackend.MATH])


@contextlib.contextmanager
def switch_interval(ms: float):
    """Python's thread switch interval set to ``ms`` milliseconds while the context lasts (0:
    unchanged), then restored (``system.switch_interval_ms``). Process-wide, as the
    interpreter's lock is: it sets how long the colocated scorers' thread may keep the
    decoding thread waiting."""
    if not ms:
        yield
        return
    before = sys.getswitchinterval()
    sys.setswitchinterval(ms / 1000.0)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def position_ids_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Positions counting only real tokens, so a left-padded prompt starts at position 0."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def start_decode(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 params: SamplingParams, prefix_ids: Optional[torch.Tensor] = None,
                 prefix_lengths: Optional[torch.Tensor] = None,
                 prefix_logprobs: Optional[torch.Tensor] = None,
                 targets: Optional[torch.Tensor] = None) -> DecodeState:
    """Prefill the prompts and return a state ready for ``decode_steps``.

    With ``prefix_ids`` (B, L) right-padded and ``prefix_lengths`` (B,), each row continues a
    response already begun (a sequence deferred by the rollout pool): prompt and prefix are
    prefilled in one forward under the current weights, which rebuilds the KV cache an update
    made stale, and the prefix becomes the row's first response tokens. ``prefix_logprobs``
    (B, L) are their recorded behaviour log-probs (kept as they are, not recomputed). Every
    prefix must be shorter than ``max_new_tokens`` and must not end at EOS.

    ``targets`` (B,): a length oracle, each row ends after that many tokens (or earlier at
    EOS, or at ``max_new_tokens``): benchmarks of models with random weights, whose own EOS
    would come at random, time a long-tailed length distribution this way."""
    batch, device = prompt_ids.shape[0], prompt_ids.device
    n = params.max_new_tokens
    tokens = torch.full((batch, n), params.pad_token_id, dtype=torch.long, device=device)
    logprobs = torch.zeros(batch, n, dtype=torch.float32, device=device)
    lengths = torch.zeros(batch, dtype=torch.long, device=device)
    context_ids, context_mask = prompt_ids, prompt_mask
    if prefix_ids is not None and prefix_ids.shape[1] > 0:
        # a copy: decoding advances the lengths in place, the caller keeps its prefix lengths
        lengths = prefix_lengths.to(device=device, dtype=torch.long, copy=True)
        if int(lengths.max()) >= n:
            raise ValueError(f"a prefix of {int(lengths.max())} tokens leaves nothing to decode "
                             f"(max_new_tokens={n})")
        width = prefix_ids.shape[1]
        tokens[:, :width] = prefix_ids.to(device)
        if prefix_logprobs is not None:
            logprobs[:, :width] = prefix_logprobs.to(device=device, dtype=torch.float32)
        in_prefix = torch.arange(n, device=device)[None, :] < lengths[:, None]
        tokens = torch.where(in_prefix, tokens, params.pad_token_id)
        logprobs = torch.where(in_prefix, logprobs, 0.0)
        context_ids, context_mask = _left_packed(prompt_ids, prompt_mask, tokens[:, :width],
                                                 in_prefix[:, :width].to(prompt_mask.dtype),
                                                 params.pad_token_id)
    positions = position_ids_from_mask(context_mask)
    width = prefix_ids.shape[1] if prefix_ids is not None else 0
    # the logits the decode reads: the last position's, and a prefix's predictions (the
    # prefill's last prefix width + 1 positions); every position's would be (B, W, V), at a
    # real vocabulary gigabytes that live until the first token (152k x 64 rows x 1024: 20 GB).
    # Where even the prefix's would pass a block of logits (24 rows x 1024 x 128k: 6 GB in
    # bf16), the rows with a prefix are run again apart, a block of them at a time
    apart = width > 0 and batch * (width + 1) * _vocab(model) > logprobs_module.BLOCK_ELEMENTS
    keep = logits_kept(model, 1 if apart else 1 + width)
    actor_logprobs = logprobs.clone()
    if apart:  # before the prefill: the decode's first token must follow the prefill's forward
        # (the hybrid engine's kernels keep their KV cache in their layers, which any other
        # forward of more than one token would replace)
        actor_logprobs[:, :width] = _prefix_logprobs_apart(
            model, dict(input_ids=context_ids, attention_mask=context_mask,
                        position_ids=positions), tokens[:, :width], lengths, params)
    static = None
    if params.static_cache:
        length = max(cache_length(context_ids.shape[1], n, params.sync_every),
                     params.static_length)
        static = StaticDecode.get(model, batch, length, device, params.cuda_graph,
                                  rows=params.static_rows)
        out = static.prefill(model, context_ids, context_mask, positions, **keep)
    else:
        out = model(input_ids=context_ids, attention_mask=context_mask, position_ids=positions,
                    use_cache=True, **keep)
    if width and not apart:
        actor_logprobs[:, :width] = _prefix_logprobs(out.logits, tokens[:, :width], lengths, params)
    state = DecodeState(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, tokens=tokens, logprobs=logprobs,
        actor_logprobs=actor_logprobs, lengths=lengths,
        finished=torch.zeros(batch, dtype=torch.bool, device=device),
        active=torch.arange(batch, device=device),
        past_key_values=output_cache(out),
        cache_mask=None if static is not None else context_mask.clone(),
        next_position=positions[:, -1] + 1,
        # a copy: a view would keep every position's logits, the prefix's too, until the
        # first decode step
        next_logits=out.logits[:, -1, :].clone() if out.logits.shape[1] > 1
        else out.logits[:, -1, :],
        targets=None if targets is None else targets.to(device=device, dtype=torch.long),
        static=static,
    )
    if static is not None:
        static.hold(state)
    return state


def logits_kept(model, keep: int) -> dict:
    """``{"logits_to_keep": keep}`` where ``model``'s forward takes it (Hugging Face causal LMs,
    ours under Megatron, a DeepSpeed engine passing its keywords on), else ``{}``: the model
    returns every position's logits, of which the last ``keep`` are read."""
    params = inspect.signature(model.forward).parameters
    takes = "logits_to_keep" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    return {"logits_to_keep": keep} if takes else {}


def _policy_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The policy's logits (``algo.policy_logits``; before top-k / top-p, which shape only
    what is sampled)."""
    return policy_logits(logits, params.temperature)


def _token_logprobs(scaled: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-probs of ``tokens`` (...,) under ``_policy_logits`` (..., V)."""
    return scaled.log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)


def _prefix_logprobs(logits: torch.Tensor, prefix: torch.Tensor, lengths: torch.Tensor,
                     params: SamplingParams) -> torch.Tensor:
    """Log-probs of each row's prefix tokens under the prefill that just ran over the left-
    packed prompt + prefix (``_left_packed``): logits (B, W_ctx, V), prefix (B, L) right-padded
    with ``lengths`` (B,) real tokens -> (B, L), 0 beyond each row's length. Token j of a row
    whose prefix has n tokens sits at context position W_ctx - n + j, so the logits predicting
    it are one position earlier."""
    context = logits.shape[1]
    steps = torch.arange(prefix.shape[1], device=prefix.device)
    at = (context - lengths[:, None] - 1 + steps[None, :]).clamp(min=0, max=context - 1)
    rows = torch.arange(prefix.shape[0], device=prefix.device)[:, None]
    # gathered, upcast and normalised a block of rows at a time (the prefix positions of
    # every row at once, in fp32, would be 12 bytes for each of rows x width x vocabulary)
    out = policy_token_logprobs(logits, prefix, params.temperature,
                                select=lambda part: logits[rows[part], at[part]])
    return torch.where(steps[None, :] < lengths[:, None], out, 0.0)


def _vocab(model) -> int:
    """The width of ``model``'s logits (its config's ``vocab_size``; a DeepSpeed engine is
    looked through); 0 when it does not say, which keeps the prefill's prefix logits whole."""
    config = getattr(getattr(model, "module", model), "config", None)
    return int(getattr(config, "vocab_size", 0) or 0)


def _prefix_logprobs_apart(model, context: dict, prefix: torch.Tensor, lengths: torch.Tensor,
                           params: SamplingParams) -> torch.Tensor:
    """``_prefix_logprobs`` from forwards of their own, without a cache, of the rows with a
    prefix alone, as many at a time as keep one block of logits (at least one row): the
    prefill then keeps only its last position's. ``context``: the prefill's inputs."""
    out = torch.zeros(prefix.shape, dtype=torch.float32, device=prefix.device)
    keep = prefix.shape[1] + 1
    step = max(1, logprobs_module.BLOCK_ELEMENTS // (keep * max(_vocab(model), 1)))
    for part in (lengths > 0).nonzero().squeeze(-1).split(step):
        logits = model(**{k: v[part] for k, v in context.items()}, use_cache=False,
                       **logits_kept(model, keep)).logits
        out[part] = _prefix_logprobs(logits, prefix[part], lengths[part], params)
    return out


def target_lengths(targets: Sequence[Optional[int]]) -> Optional[torch.Tensor]:
    """``start_decode``'s ``targets`` from per-row length-oracle targets: None when no row has
    one; a row without one gets no limit beyond ``max_new_tokens``."""
    if all(t is None for t in targets):
        return None
    return torch.tensor([2 ** 31 - 1 if t is None else t for t in targets], dtype=torch.long)


def _left_packed(prompt_ids, prompt_mask, suffix_ids, suffix_mask, pad_id):
    """Each row's real prompt tokens followed by its real suffix tokens, left-padded to one
    width: (B, W) ids and mask. Rows of a left-padded prompt batch with right-padded
    suffixes of different lengths would otherwise have holes in the middle."""
    ids = torch.cat([prompt_ids, suffix_ids], dim=1)
    mask = torch.cat([prompt_mask, suffix_mask], dim=1)
    # a stable sort of "is real" moves the padding to the left and keeps the tokens' order
    order = torch.sort(mask.long(), dim=1, stable=True).indices
    ids, mask = ids.gather(1, order), mask.gather(1, order)
    width = int(mask.sum(1).max())
    ids, mask = ids[:, -width:], mask[:, -width:]
    return torch.where(mask.bool(), ids, pad_id), mask


@torch.no_grad()
def decode_steps(model, state: DecodeState, params: SamplingParams,
                 generator: Optional[torch.Generator], max_steps: Optional[int] = None,
                 stop: Optional[Callable[[DecodeState], bool]] = None) -> int:
    """Advance every active row by up to ``max_steps`` tokens (None: until all finish).
    Rows end at an EOS token or at ``max_new_tokens``. ``stop(state)``, asked after every
    token, ends decoding early when it returns True (``state.stopped``; the rollout pool stops
    once it has its batch). Returns the number of tokens appended.

    ``params.sync_every`` > 1 decodes in blocks of that many tokens (``_decode_blocks``): the
    host learns which rows ended once a block instead of once a token, which on a GPU is one
    wait for the device per block. ``stop`` must then be a ``BatchStop`` made with
    ``blocks=True``."""
    if params.sync_every > 1:
        return _decode_blocks(model, state, params, generator, max_steps, stop)
    eos = torch.tensor(params.eos_token_ids, device=state.tokens.device)
    produced, steps = 0, 0
    while not state.over and (max_steps is None or steps < max_steps):
        tok, lp = sample_tokens(state.next_logits, params, generator)
        rows = state.active
        state.tokens[rows, state.lengths[rows]] = tok
        state.logprobs[rows, state.lengths[rows]] = lp
        state.actor_logprobs[rows, state.lengths[rows]] = lp  # sampled under these weights
        state.lengths[rows] += 1
        produced += rows.numel()
        steps += 1
        ended = torch.isin(tok, eos) | (state.lengths[rows] >= params.max_new_tokens)
        if state.targets is not None:
            ended |= state.lengths[rows] >= state.targets[rows]
        if bool(ended.any()):  # a host sync, once per token: cheap next to the forward
            state.finished[rows[ended]] = True
            state.finish_order.extend(rows[ended].tolist())
            keep = (~ended).nonzero().squeeze(-1)
            _select_rows(state, keep)
            tok = tok[keep]
            if state.done:
                state.next_logits = None
                break
        if stop is not None and stop(state):
            state.stopped = True
            break
        _feed(model, state, tok)
    return produced


def _select_rows(state: DecodeState, keep: torch.Tensor) -> None:
    """Keep only the rows ``keep`` (indices into the active set) in the cache."""
    state.active = state.active[keep]
    state.next_position = state.next_position[keep]
    if state.static is not None:  # the row stays in the static cache, unread
        return
    state.cache_mask = state.cache_mask[keep]
    if keep.numel() > 0 and state.past_key_values is not None:
        state.past_key_values.batch_select_indices(keep)


def _feed(model, state: DecodeState, tok: torch.Tensor,
          advance: Optional[torch.Tensor] = None) -> None:
    """One forward of ``tok`` (A,) at the active rows' next positions. ``advance`` (A,) bool:
    rows whose position moves on (default all); the others (rows of a block that ended) feed
    their token at the same position again, so no row goes past the positions its response
    may use."""
    if state.static is not None:
        state.next_logits = state.static.step(model, state.active, tok, state.next_position)
    else:
        ones = torch.ones(tok.shape[0], 1, dtype=state.cache_mask.dtype, device=tok.device)
        state.cache_mask = torch.cat([state.cache_mask, ones], dim=1)
        out = model(input_ids=tok[:, None], attention_mask=state.cache_mask,
                    position_ids=state.next_position[:, None], use_cache=True,
                    **cache_kwargs(model, state.past_key_values))
        state.past_key_values = output_cache(out)
        state.next_logits = out.logits[:, -1, :]
    state.next_position = state.next_position + (1 if advance is None else advance.long())


class _BlockUniforms:
    """The uniforms of one block of ``_decode_blocks``, drawn ahead: at most ``rows x steps``,
    one per running row and token, taken in order (token by token, the running rows in
    cache order) on the device without a host wait. With a CPU generator (the trainer's) the
    stream is the one the per-token loop on a GPU draws (``torch.rand`` of the running rows,
    token after token), whatever the block size: ``settle`` rewinds the generator and advances
    it by what the block used (no generator: torch's default CPU one). A generator on the
    device draws a fresh block each time and is not rewound: its stream depends on the block
    size."""

    def __init__(self, generator: Optional[torch.Generator], count: int, device: torch.device):
        on_host = generator is None or generator.device.type == "cpu"
        self.generator = torch.default_generator if generator is None else generator
        if not on_host:  # a device generator draws on the device: nothing to copy or rewind
            self.saved = None
            self.block = torch.rand(count, dtype=torch.float64, generator=self.generator,
                                    device=device)
        else:
            self.saved = self.generator.get_state()
            self.block = torch.rand(count, dtype=torch.float64,
                                    generator=self.generator).to(device)
        self.used = torch.zeros((), dtype=torch.long, device=device)

    def take(self, running: torch.Tensor) -> torch.Tensor:
        """(A,) uniforms: the next ones for the running rows in order (others get any)."""
        rank = running.long().cumsum(0) - 1
        u = self.block[(self.used + rank).clamp(0, self.block.numel() - 1)]
        self.used = self.used + running.long().sum()
        return u

    def settle(self, used: int) -> None:
        """Leave a host generator as if exactly ``used`` uniforms had been drawn."""
        if self.saved is not None:
            self.generator.set_state(self.saved)
            torch.rand(used, dtype=torch.float64, generator=self.generator)


@torch.no_grad()
def _decode_blocks(model, state: DecodeState, params: SamplingParams,
                   generator: Optional[torch.Generator], max_steps: Optional[int],
                   stop) -> int:
    """``decode_steps`` with one host check every ``params.sync_every`` tokens.

    Within a block no row leaves the batch: a row that ends stays in it, its further tokens
    discarded (its position does not move), and at the block's end the host reads, in one
    copy, at which token each row ended; then each row's tokens up to its end go into the
    state and finished rows leave the cache, in the order they ended (rows ending at the same
    token in cache order: the per-token loop's order). The cost is up to ``sync_every - 1``
    forwards of rows that already ended; what is sampled does not change: tokens, log-probs,
    lengths, finish order and (with a CPU generator) the uniforms used are those of the
    per-token loop sampling by ``inverse_cdf_sample`` from ``torch.rand`` of the running
    rows, which is what that loop does on a GPU (on a CPU it samples with ``torch.multinomial``, a different stream).

    ``stop`` (``BatchStop(blocks=True)``): evaluated on the device after every token
    (``local_device``); at the block's end ``resolve`` gets the first token at which it held
    and returns the token every rank stops at (the latest of theirs); the block's tokens
    after it are not kept: the state is the per-token loop's when it stopped (its KV cache is
    dropped: a stopped state is not decoded further)."""
    if stop is not None and not getattr(stop, "blocks", False):
        raise ValueError("sync_every > 1 asks the stop rule once per block: it must be a "
                         "BatchStop made with blocks=True")
    eos = torch.tensor(params.eos_token_ids, device=state.tokens.device)
    produced, steps = 0, 0
    while not state.over and (max_steps is None or steps < max_steps):
        size = params.sync_every if max_steps is None else min(params.sync_every,
                                                              max_steps - steps)
        produced += _decode_block(model, state, params, generator, size, stop, eos)
        steps += size
    return produced


def _decode_block(model, state: DecodeState, params: SamplingParams,
                  generator: Optional[torch.Generator], size: int, stop,
                  eos: torch.Tensor) -> int:
    """One block of ``_decode_blocks``: ``size`` tokens, one host wait. The block's tokens
    and log-probs go to buffers of their own and into the state at its end, up to each row's
    end (or the stop token), so nothing has to be undone. Returns the tokens appended."""
    device, n = state.tokens.device, params.max_new_tokens
    rows = state.active
    count = rows.numel()
    start = state.lengths[rows]
    room = n - start  # tokens each row may still add: it ends at the one that fills it
    if state.targets is not None:
        room = torch.minimum(room, state.targets[rows] - start)
    tokens = torch.empty(count, size, dtype=torch.long, device=device)
    logprobs = torch.empty(count, size, dtype=torch.float32, device=device)
    running = torch.ones(count, dtype=torch.bool, device=device)
    ended_at = torch.full((count,), size, dtype=torch.long, device=device)
    first_ok = torch.full((), size, dtype=torch.long, device=device)
    uniforms = None if params.greedy else _BlockUniforms(generator, count * size, device)
    for t in range(size):
        u = None if uniforms is None else uniforms.take(running)
        tok, lp = sample_tokens(state.next_logits, params, generator, uniforms=u)
        tokens[:, t], logprobs[:, t] = tok, lp
        ended = (torch.isin(tok, eos) | (room <= t + 1)) & running
        ended_at = torch.where(ended, t, ended_at)
        running = running & ~ended
        if stop is not None:
            ok = stop.local_device(state.finished.index_put((rows,), ~running))
            first_ok = torch.where((first_ok == size) & ok, t, first_ok)
        if t < size - 1:
            _feed(model, state, tok, advance=running)
    # the block's one host wait: where each row ended, and what indexes the writes below
    info = torch.cat([ended_at, rows, start, first_ok.view(1)]).tolist()
    ends, row_ids, starts, first = (info[:count], info[count:2 * count],
                                    info[2 * count:3 * count], info[-1])
    last = size - 1
    if stop is not None:
        at_token = stop.resolve(first if first < size else None)
        if at_token is not None:
            last, state.stopped = at_token, True
    kept = [min(e, last) + 1 for e in ends]  # per row: tokens up to its end or ``last``
    used = sum(kept)
    if uniforms is not None:
        uniforms.settle(used)
    _write_block(state, row_ids, starts, tokens, logprobs, kept, [e <= last for e in ends])
    # in the order they ended; rows ending at the same token in cache order (a stable sort)
    ended_rows = sorted((i for i, e in enumerate(ends) if e <= last), key=lambda i: ends[i])
    state.finish_order.extend(row_ids[i] for i in ended_rows)
    keep = torch.tensor([i for i, e in enumerate(ends) if e > last], dtype=torch.long,
                        device=device)
    if state.stopped:  # its cache holds tokens past the stop: nothing decodes a stopped state
        state.past_key_values, state.next_logits = None, None
    if keep.numel() < count:
        _select_rows(state, keep)
        tok = tok[keep]
    if state.over:
        state.next_logits = None
    else:
        _feed(model, state, tok)
    return used


def _write_block(state: DecodeState, rows: list[int], starts: list[int], tokens: torch.Tensor,
                 logprobs: torch.Tensor, kept: list[int], finished: list[bool]) -> None:
    """A block's first ``kept[i]`` tokens (of ``tokens`` (A, size)) of the state's row
    ``rows[i]`` into it after its ``starts[i]`` tokens; the rows' lengths and which of them
    ``finished``. Indexed from the host's lists: one copy to the device, no wait."""
    size = tokens.shape[1]
    at_rows, at_cols, src = [], [], []
    for i, (row, begin, k) in enumerate(zip(rows, starts, kept)):
        at_rows += [row] * k
        at_cols += range(begin, begin + k)
        src += range(i * size, i * size + k)
    lengths = [b + k for b, k in zip(starts, kept)]
    flat = torch.tensor(at_rows + at_cols + src + rows + lengths + list(finished),
                        dtype=torch.long).to(tokens.device)  # one copy
    at_rows_t, at_cols_t, src_t = flat[:3 * len(src)].view(3, -1)
    rows_t, lengths_t, finished_t = flat[3 * len(src):].view(3, -1)
    state.tokens[at_rows_t, at_cols_t] = tokens.view(-1)[src_t]
    state.logprobs[at_rows_t, at_cols_t] = logprobs.view(-1)[src_t]
    state.actor_logprobs[at_rows_t, at_cols_t] = logprobs.view(-1)[src_t]  # these weights'
    state.lengths[rows_t] = lengths_t
    state.finished[rows_t] = finished_t.bool()


@dataclass
class Generation:
    prompt_ids: torch.Tensor     # (B, P) left-padded
    prompt_mask: torch.Tensor    # (B, P)
    response_ids: torch.Tensor   # (B, T) right-padded with pad_token_id
    response_mask: torch.Tensor  # (B, T) 1.0 on generated tokens (EOS included)
    logprobs: torch.Tensor       # (B, T) behaviour log-probs
    lengths: torch.Tensor        # (B,)


def generate(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams,
             generator: Optional[torch.Generator] = None,
             targets: Optional[torch.Tensor] = None) -> Generation:
    """Decode a whole batch to the end (the sequential baseline's generation phase)."""
    state = start_decode(model, prompt_ids, prompt_mask, params, targets=targets)
    decode_steps(model, state, params, generator)
    return finish(state)


def finish(state: DecodeState, rows: Optional[Sequence[int]] = None) -> Generation:
    """Package rows (default: all) of a state, trimming response columns to the longest."""
    idx = torch.arange(state.tokens.shape[0]) if rows is None else torch.as_tensor(rows)
    idx = idx.to(state.tokens.device)
    width = max(int(state.lengths[idx].max()), 1)
    return Generation(prompt_ids=state.prompt_ids[idx], prompt_mask=state.prompt_mask[idx],
                      response_ids=state.tokens[idx, :width],
                      response_mask=state.response_mask()[idx, :width],
                      logprobs=state.logprobs[idx, :width], lengths=state.lengths[idx])
