"""Streaming scorers: the intra-step overlap of OPPO.

The sequential step scores a response only once the whole batch has finished decoding. A
``StreamingScorer`` instead takes each chunk of newly decoded tokens as soon as the actor has
produced it and prefills it into the scorer's own KV cache, so when a sequence ends only its
last chunk is left to score. The result is the same number whole-sequence scoring gives
(``experience.sequence_scores`` / ``response_logprobs`` / ``response_values``): the same
weights see the same tokens at the same positions under the same attention mask; only the
floating-point order of the matmuls differs.

One scorer per downstream model, by ``kind``:
  * ``"reward"``    (``ValueHeadModel``): per finished row, the value at its last response token,
                    a scalar;
  * ``"reference"`` (causal LM): per finished row, the log-probs (T_row,) of its response tokens
                    under ``logits / temperature``;
  * ``"critic"``    (``ValueHeadModel``): per finished row, the values (T_row,) with
                    ``values[t] = V(prompt + response[:t])``.

Protocol (rows are indices into the original batch of ``begin``)::

    scorer.begin(prompt_ids, prompt_mask)      # prefill the prompts
    scorer.consume(rows, tokens, lengths)      # after every decode chunk
    results = scorer.finish(ended_rows)        # {row: tensor}; frees those rows' cache

The output at a token's position is what scores the NEXT token (logits predict it, the critic's
value is the state before it), so the scorer keeps, per cached row, the output at the last
position it has fed (``pending``) and pairs it with the first token of the row's next chunk.

``stream_generate`` is the ``inline`` placement: scorer prefill runs between decode chunks in
the calling thread, which is the correctness reference for the concurrent placements.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ..algo import logprobs_from_logits
from .generate import (DecodeState, Generation, SamplingParams, decode_steps, finish,
                       position_ids_from_mask, start_decode)

SCORER_KINDS = ("reward", "reference", "critic")


class StreamingScorer:
    """A downstream model that scores sequences chunk by chunk from its own KV cache.

    State of the rows in the cache (N of them, in cache order):
      rows (N,)           original batch index of each cache row
      cache_mask (N, S)   attention mask over the S cached positions (0 on padding)
      next_position (N,)  position id of the row's next real token
      pending             output at the row's last fed position: (N, V) logits (reference)
                          or (N,) values (reward, critic)
    """

    def __init__(self, model, kind: str, temperature: float = 1.0):
        if kind not in SCORER_KINDS:
            raise ValueError(f"kind must be one of {', '.join(SCORER_KINDS)}, got {kind!r}")
        self.model = model
        self.kind = kind
        self.temperature = temperature
        self._clear()

    def _clear(self) -> None:
        self.rows = torch.empty(0, dtype=torch.long)
        self.cache = None
        self.cache_mask: Optional[torch.Tensor] = None
        self.next_position: Optional[torch.Tensor] = None
        self.pending: Optional[torch.Tensor] = None
        self._index: dict[int, int] = {}                   # original row -> cache row
        self._scored: dict[int, list[torch.Tensor]] = {}   # per-token outputs, per chunk

    @property
    def num_rows(self) -> int:
        """Rows currently held in the KV cache."""
        return int(self.rows.numel())

    def reset(self) -> None:
        """Drop every row (e.g. an aborted rollout)."""
        self._clear()

    def _forward(self, input_ids, attention_mask, position_ids, **kwargs):
        """One cached forward; returns the per-position outputs, (N, L, V) or (N, L)."""
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids, past_key_values=self.cache, use_cache=True,
                         **kwargs)
        self.cache = out.past_key_values
        return out.logits if self.kind == "reference" else out.values

    @torch.no_grad()
    def begin(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> None:
        """Prefill left-padded prompts (B, P) with mask (B, P); rows become 0..B-1."""
        if self.num_rows:
            raise ValueError(f"{self.kind} scorer still holds {self.num_rows} rows; finish or "
                             f"reset them before begin")
        positions = position_ids_from_mask(prompt_mask)
        # only the last prompt position's logits are needed: (B, P, V) logits of a real
        # vocabulary would be the largest tensor of the whole rollout
        extra = {"logits_to_keep": 1} if self.kind == "reference" else {}
        outputs = self._forward(prompt_ids, prompt_mask, positions, **extra)
        batch = prompt_ids.shape[0]
        self.rows = torch.arange(batch, device=prompt_ids.device)
        self._index = {i: i for i in range(batch)}
        self._scored = {i: [] for i in range(batch)}
        self.cache_mask = prompt_mask.clone()
        self.next_position = positions[:, -1] + 1
        self.pending = outputs[:, -1].clone()  # not a view that would keep `outputs` alive

    @torch.no_grad()
    def consume(self, rows: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor) -> None:
        """Prefill the next chunk of the listed rows.

        rows (A,): original row indices, each in the cache, any order. tokens (A, c): the
        chunk, right-padded; row i's valid tokens are tokens[i, :lengths[i]]. lengths (A,):
        1..c (from the decoder only a row that ended inside the chunk has fewer than c, but
        any row may: the next chunk continues from its last real token).
        Cache rows not listed take an all-padding chunk (mask 0): every row of a batched cache
        grows by the same number of positions, and a masked position changes no score (it
        costs compute and cache memory, so callers should list every cached row they can).
        """
        idx = self._cache_rows(rows)
        # the longest row sets the chunk width; a host sync, once per chunk
        width = int(lengths.max())
        device = self.cache_mask.device
        tokens, lengths, n = tokens[:, :width].to(device), lengths.to(device), self.num_rows
        ids = torch.zeros(n, width, dtype=tokens.dtype, device=device)
        ids[idx] = tokens
        valid = torch.zeros(n, dtype=torch.long, device=device)
        valid[idx] = lengths
        chunk_mask = (torch.arange(width, device=device)[None, :] < valid[:, None])
        chunk_mask = chunk_mask.to(self.cache_mask.dtype)
        # real tokens continue the row's own positions; padding repeats the last one, which
        # keeps absolute position ids (GPT-2) within the range the sequence reaches
        positions = self.next_position[:, None] + (chunk_mask.long().cumsum(1) - 1).clamp(min=0)
        self.cache_mask = torch.cat([self.cache_mask, chunk_mask], dim=1)
        outputs = self._forward(ids, self.cache_mask, positions)[idx]  # (A, w[, V])

        before = self.pending[idx]
        if self.kind != "reward":
            # the output before each chunk token: pending, then the chunk's own outputs
            prev = torch.cat([before[:, None], outputs[:, :-1]], dim=1)
            if self.kind == "reference":
                # same ops, same order as experience.response_logprobs
                logits = prev / self.temperature if self.temperature > 0 else prev
                per_token = logprobs_from_logits(logits, tokens)
            else:
                per_token = prev.float()
            for row, scored, length in zip(rows.tolist(), per_token, lengths.tolist()):
                self._scored[row].append(scored[:length])
        last = torch.arange(idx.numel(), device=device)
        self.pending[idx] = outputs[last, lengths - 1]
        self.next_position[idx] += lengths

    @torch.no_grad()
    def finish(self, rows: Sequence[int] | torch.Tensor) -> dict[int, torch.Tensor]:
        """Results of rows whose response has ended (all its tokens consumed), and release
        them from the cache. Returns {row: () float32 reward | (T_row,) float32 scores}."""
        rows = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
        if rows.numel() == 0:
            return {}
        idx = self._cache_rows(rows)
        if self.kind == "reward":
            results = dict(zip(rows.tolist(), self.pending[idx].float().unbind()))
            for row in results:
                del self._scored[row]
        else:
            empty = torch.zeros(0, device=self.pending.device)
            results = {row: torch.cat(self._scored.pop(row) or [empty]) for row in rows.tolist()}
        gone = torch.zeros(self.num_rows, dtype=torch.bool)
        gone[idx.cpu()] = True
        self._keep((~gone).nonzero().squeeze(-1).to(self.rows.device))
        return results

    def _cache_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Cache positions (A,) of original rows (A,)."""
        try:
            idx = [self._index[r] for r in rows.tolist()]
        except KeyError as err:
            raise KeyError(f"row {err.args[0]} is not in the {self.kind} scorer's cache "
                           f"(never begun, or already finished)") from None
        return torch.tensor(idx, dtype=torch.long, device=self.rows.device)

    def _keep(self, keep: torch.Tensor) -> None:
        """Keep only cache rows ``keep``; the others' KV memory is freed now."""
        if keep.numel() == 0:
            self._clear()
            return
        if keep.numel() < self.num_rows:
            self.cache.batch_select_indices(keep)
            self.rows = self.rows[keep]
            self.cache_mask = self.cache_mask[keep]
            self.next_position = self.next_position[keep]
            self.pending = self.pending[keep]
            self._index = {r: i for i, r in enumerate(self.rows.tolist())}


@dataclass
class ScorerTiming:
    busy_s: float = 0.0  # all the scorer's work: prompt prefill, chunk prefills, finishing
    tail_s: float = 0.0  # the part after the actor's last token: what the step waits for


@dataclass
class StreamTiming:
    decode_s: float = 0.0  # the actor's prefill and chunked decode
    wall_s: float = 0.0
    chunks: int = 0
    scorers: dict[str, ScorerTiming] = field(default_factory=dict)


def _chunk_tokens(state: DecodeState, rows: torch.Tensor,
                  before: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens rows (A,) appended since their lengths were ``before`` (A,):
    (A, c) right-padded, and (A,) counts."""
    counts = state.lengths[rows] - before
    width = int(counts.max())
    cols = before[:, None] + torch.arange(width, device=before.device)[None, :]
    cols = cols.clamp(max=state.tokens.shape[1] - 1)  # padding of rows that ended early
    return state.tokens[rows[:, None], cols], counts


def _clock(device: torch.device) -> float:
    """Seconds, after the device's queued work: CUDA kernels run asynchronously, so without
    the sync one model's work would be charged to whoever reads the clock next."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def stream_generate(actor, scorers: Sequence[StreamingScorer], prompt_ids: torch.Tensor,
                    prompt_mask: torch.Tensor, params: SamplingParams,
                    generator: Optional[torch.Generator], chunk_size: int):
    """Decode a batch in chunks of ``chunk_size`` tokens and stream every chunk to the
    scorers between chunks (the ``inline`` placement).

    Returns (Generation, results, StreamTiming); results[kind] for each scorer's kind:
    reward (B,) float32, reference / critic (B, T) float32 right-padded with 0, where T is the
    Generation's response width. Sampling is exactly that of ``generate`` with the same
    generator: chunking only decides when the scorers see the tokens.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    kinds = [s.kind for s in scorers]
    if len(set(kinds)) != len(kinds):
        raise ValueError(f"one scorer per kind, got {kinds}")
    timing = StreamTiming(scorers={k: ScorerTiming() for k in kinds})
    device = prompt_ids.device
    start = _clock(device)

    def scorer_work(scorer, fn, *args, tail=False):
        t0 = _clock(device)
        out = fn(*args)
        spent = _clock(device) - t0
        timing.scorers[scorer.kind].busy_s += spent
        if tail:
            timing.scorers[scorer.kind].tail_s += spent
        return out

    t0 = _clock(device)
    state = start_decode(actor, prompt_ids, prompt_mask, params)
    timing.decode_s += _clock(device) - t0
    for scorer in scorers:
        scorer_work(scorer, scorer.begin, prompt_ids, prompt_mask)

    finished: dict[str, dict[int, torch.Tensor]] = {k: {} for k in kinds}
    while not state.done:
        rows = state.active.clone()
        before = state.lengths[rows].clone()
        t0 = _clock(device)
        decode_steps(actor, state, params, generator, max_steps=chunk_size)
        timing.decode_s += _clock(device) - t0
        timing.chunks += 1
        tokens, counts = _chunk_tokens(state, rows, before)
        ended = rows[state.finished[rows]]
        # inline: once the actor is done, all that is left is the scorers' tail
        for scorer in scorers:
            scorer_work(scorer, scorer.consume, rows, tokens, counts, tail=state.done)
            finished[scorer.kind].update(
                scorer_work(scorer, scorer.finish, ended, tail=state.done))

    gen = finish(state)
    results = {kind: _assemble(kind, finished[kind], gen) for kind in kinds}
    timing.wall_s = _clock(device) - start
    return gen, results, timing


def _assemble(kind: str, per_row: dict[int, torch.Tensor], gen: Generation) -> torch.Tensor:
    """Per-row results as one batch tensor: (B,) rewards or (B, T) right-padded scores."""
    batch, width = gen.response_ids.shape
    device = gen.response_ids.device
    if kind == "reward":
        return torch.stack([per_row[i] for i in range(batch)]).to(device)
    out = torch.zeros(batch, width, dtype=torch.float32, device=device)
    for i in range(batch):
        out[i, :per_row[i].numel()] = per_row[i]
    return out
