"""Streaming scorers: a downstream model that scores sequences chunk by chunk.

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

Protocol (rows are ids: the indices 0..B-1 of ``begin``'s batch, or any unique ids >= 0
given to ``add``)::

    scorer.begin(prompt_ids, prompt_mask)      # prefill the prompts, rows 0..B-1
    scorer.consume(rows, tokens, lengths)      # after every decode chunk
    results = scorer.finish(ended_rows)        # {row: tensor}; frees those rows' cache

Across steps (inter-step overlap: a step ends when B of its B+D sequences have finished, the
others are deferred to the next step) the rows held stay cached, and the next step's rows
join them with ``add(ids, prompt_ids, prompt_mask[, prefix_ids, prefix_lengths])``. The
frozen scorers (reward, reference) carry a deferred row's KV as it is; the critic trains, so
its deferred rows are ``drop``ped and re-``add``ed with their partial response as the prefix.
``state_dict(rows)`` / ``load_state_dict`` move rows to another scorer object (a checkpoint,
another rank) with everything needed to go on.

The output at a token's position is what scores the NEXT token (logits predict it, the critic's
value is the state before it), so the scorer keeps, per cached row, the output at the last
position it has fed (``pending``) and pairs it with the first token of the row's next chunk.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..algo import policy_token_logprobs
from ..config import SCORER_KINDS
from ..kv_cache import cache_kwargs, output_cache
from .generate import position_ids_from_mask


class StreamingScorer:
    """A downstream model that scores sequences chunk by chunk from its own KV cache.

    State of the rows in the cache (N of them, in cache order):
      rows (N,)           id of each cache row (unique, >= 0: a batch index or a sequence id)
      cache_mask (N, S)   attention mask over the S cached positions (0 on padding)
      next_position (N,)  position id of the row's next real token
      pending             output at the row's last fed position: (N, V) logits (reference)
                          or (N,) values (reward, critic)
    """

    def __init__(self, model, kind: str, temperature: float = 1.0):
        if kind not in SCORER_KINDS:
            raise ValueError(f"kind must be one of {', '.join(SCORER_KINDS)}, got {kind!r}")
        if has_sliding_window(model):
            raise ValueError(
                f"oppo.streaming: the {kind} model ({type(model).__name__}) has sliding-window "
                f"attention layers. A streamed row's cache can hold masked columns between its "
                f"tokens (a deferred row's partial response, padded to the longest), and the "
                f"window counts columns, not tokens: its scores would differ from scoring the "
                f"whole sequence. Leave {kind} out of oppo.stream_to (the reward model always "
                f"streams: set oppo.streaming: false), or, where every prompt + response is "
                f"shorter than the window (the window then changes nothing), set "
                f"sliding_window to null in the model's config.json")
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
        self._index: dict[int, int] = {}                   # row id -> cache row
        self._scored: dict[int, list[torch.Tensor]] = {}   # per-token outputs, per chunk

    @property
    def num_rows(self) -> int:
        """Rows currently held in the KV cache."""
        return int(self.rows.numel())

    @property
    def cache_width(self) -> int:
        """Cached positions per row (S), padding included: what compaction bounds."""
        return 0 if self.cache_mask is None else int(self.cache_mask.shape[1])

    def reset(self) -> None:
        """Drop every row (e.g. an aborted rollout)."""
        self._clear()

    def _forward(self, input_ids, attention_mask, position_ids, **kwargs):
        """One cached forward; returns the per-position outputs, (N, L, V) or (N, L)."""
        outputs, self.cache = self._run(input_ids, attention_mask, position_ids, self.cache,
                                        **kwargs)
        return outputs

    def _run(self, input_ids, attention_mask, position_ids, cache, **kwargs):
        """A forward on ``cache`` (None: a fresh one); returns (outputs, cache)."""
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids, use_cache=True,
                         **cache_kwargs(self.model, cache), **kwargs)
        return (out.logits if self.kind == "reference" else out.values), output_cache(out)

    @torch.no_grad()
    def begin(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> None:
        """Prefill left-padded prompts (B, P) with mask (B, P); rows become 0..B-1."""
        if self.num_rows:
            raise ValueError(f"{self.kind} scorer still holds {self.num_rows} rows; finish or "
                             f"reset them before begin")
        self.add(range(prompt_ids.shape[0]), prompt_ids, prompt_mask)

    @torch.no_grad()
    def add(self, rows, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
            prefix_ids: Optional[torch.Tensor] = None,
            prefix_lengths: Optional[torch.Tensor] = None) -> None:
        """Prefill N new rows and merge them into the cache, next to the rows it holds.

        rows (N,): new unique ids (>= 0). prompt_ids / prompt_mask (N, P): left-padded.
        prefix_ids (N, L), prefix_lengths (N,): response tokens the rows already have
        (right-padded; 0..L each), e.g. a sequence deferred from the previous step whose
        scorer state was not carried (the critic trains, so its old KV is stale). They go
        through the same forward as the prompt, and their per-token outputs open the row's
        scores just as if they had been consumed in chunks.
        The fresh rows' cache and the held one are compacted first (``compact``), then the
        narrower is left-padded with masked zero K/V so both have one width.
        """
        ids = self._new_rows(rows)
        n = prompt_ids.shape[0]
        if len(ids) != n or prompt_mask.shape != prompt_ids.shape:
            raise ValueError(f"add: {len(ids)} rows, prompt_ids {tuple(prompt_ids.shape)}, "
                             f"prompt_mask {tuple(prompt_mask.shape)}: need N rows and (N, P) "
                             f"for both")
        if n == 0:
            return
        if not bool(prompt_mask[:, -1].all()):
            # pending is read at the prompt's last column, and the prefix continues from it
            raise ValueError("add: prompts must be left-padded (every row's last prompt "
                             "column real)")
        device = prompt_ids.device
        if prefix_ids is None:
            if prefix_lengths is not None:
                raise ValueError("add: prefix_lengths given without prefix_ids")
            prefix_ids = prompt_ids.new_zeros(n, 0)
            prefix_lengths = torch.zeros(n, dtype=torch.long, device=device)
        else:
            if prefix_lengths is None:
                raise ValueError("add: prefix_ids given without prefix_lengths")
            prefix_lengths = torch.as_tensor(prefix_lengths, dtype=torch.long).to(device)
            if prefix_ids.dim() != 2 or prefix_ids.shape[0] != n \
                    or prefix_lengths.shape != (n,):
                raise ValueError(f"add: prefix_ids {tuple(prefix_ids.shape)} and "
                                 f"prefix_lengths {tuple(prefix_lengths.shape)} for {n} rows")
            if bool((prefix_lengths < 0).any()) or bool((prefix_lengths > prefix_ids.shape[1])
                                                         .any()):
                raise ValueError(f"add: prefix_lengths must lie in 0..{prefix_ids.shape[1]}, "
                                 f"got {prefix_lengths.tolist()}")
        # columns past the longest prefix would be padding in every row
        width = int(prefix_lengths.max())
        prefix_ids = prefix_ids[:, :width].to(device=device, dtype=prompt_ids.dtype)
        prefix_mask = torch.arange(width, device=device)[None, :] < prefix_lengths[:, None]
        input_ids = torch.cat([prompt_ids, prefix_ids], dim=1)
        mask = torch.cat([prompt_mask, prefix_mask.to(prompt_mask.dtype)], dim=1)
        # the prefix's padding repeats the last real position, as consume's padding does
        positions = position_ids_from_mask(mask)
        # only the outputs from the last prompt position on are read: (N, P + L, V) logits of
        # a real vocabulary would be the largest tensor of the whole rollout
        extra = {"logits_to_keep": width + 1} if self.kind == "reference" else {}
        outputs, cache = self._run(input_ids, mask, positions, None, **extra)
        tail = outputs[:, -(width + 1):]  # outputs at positions P-1 .. P+L-1
        scored: dict[int, list[torch.Tensor]] = {row: [] for row in ids}
        if self.kind != "reward" and width:
            per_token = self._per_token(tail[:, 0], tail[:, 1:], prefix_ids)
            for row, values, length in zip(ids, per_token, prefix_lengths.tolist()):
                if length:
                    scored[row].append(values[:length])
        pending = tail[torch.arange(n, device=device), prefix_lengths]  # a copy, not a view
        self._merge(ids, cache, mask, positions[:, -1] + 1, pending, scored)

    @torch.no_grad()
    def consume(self, rows: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor) -> None:
        """Prefill the next chunk of the listed rows.

        rows (A,): row ids, each in the cache, any order. tokens (A, c): the
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
            per_token = self._per_token(before, outputs, tokens)
            for row, scored, length in zip(rows.tolist(), per_token, lengths.tolist()):
                self._scored[row].append(scored[:length])
        last = torch.arange(idx.numel(), device=device)
        self.pending[idx] = outputs[last, lengths - 1]
        self.next_position[idx] += lengths

    def _per_token(self, before: torch.Tensor, outputs: torch.Tensor,
                   tokens: torch.Tensor) -> torch.Tensor:
        """Scores (A, w) of tokens (A, w) from the outputs just before each: ``before``
        (A[, V]), pending from the last chunk, then the chunk's own outputs (A, w[, V])."""
        def prev(part) -> torch.Tensor:
            return torch.cat([before[part, None], outputs[part, :-1]], dim=1)

        if self.kind == "reference":
            # as experience.response_logprobs; a block of rows at a time (the chunk's logits
            # in fp32 at once would be 12 bytes for each of rows x chunk x vocabulary)
            return policy_token_logprobs(outputs, tokens, self.temperature, select=prev)
        return prev(slice(None)).float()

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
        self._remove(idx)
        return results

    @torch.no_grad()
    def drop(self, rows: Sequence[int] | torch.Tensor) -> None:
        """Release rows without results: a deferred sequence whose state is rebuilt rather
        than carried (the critic's), or one carried elsewhere after ``state_dict``."""
        rows = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
        if rows.numel() == 0:
            return
        idx = self._cache_rows(rows)
        for row in rows.tolist():
            del self._scored[row]
        self._remove(idx)

    @torch.no_grad()
    def compact(self) -> int:
        """Drop the cache columns masked in every row; returns how many went.

        Exact: a masked key gets weight exp(-inf) = 0 in every query's softmax, and position
        ids are explicit (``next_position``), not cache indices. Columns pile up where rows
        that held them left: a finished row's share of earlier chunks, the left padding of
        a long prompt. Without this a cache that carries rows from step to step only grows.
        """
        if self.cache is None:
            return 0
        before = self.cache_width
        self.cache_mask = _drop_masked_columns(self.cache, self.cache_mask)
        return before - self.cache_width

    @torch.no_grad()
    def state_dict(self, rows: Optional[Sequence[int] | torch.Tensor] = None) -> dict:
        """What continuing the rows (default: all cached) needs, as a torch.save-able dict
        of CPU tensors and plain python values; the rows stay cached (``drop`` them if they
        continue elsewhere).

        Keys: ``kind``, ``temperature``, ``rows`` [N ids], ``lengths`` [N]: the real cached
        positions of each row; ``keys`` / ``values``: one tensor per layer, (sum(lengths),
        heads, head_dim), the rows' real positions packed in order (padding is not saved:
        a row carried over many steps holds only its own tokens); ``next_position`` (N,),
        ``pending`` (N[, V]), ``scored``: per row a (T_row,) float tensor of the outputs
        scored so far (empty for the reward).
        """
        rows = self.rows if rows is None else torch.as_tensor(rows, dtype=torch.long)
        rows = rows.reshape(-1)
        ids = rows.tolist()
        idx = self._cache_rows(rows) if ids else rows.new_zeros(0)
        state = {"kind": self.kind, "temperature": self.temperature, "rows": ids}
        if not ids:
            return {**state, "lengths": [], "keys": [], "values": [], "next_position":
                    torch.zeros(0, dtype=torch.long), "pending": None, "scored": []}
        real = self.cache_mask[idx].bool()
        layers = _plain_layers(self.cache)
        # (N, H, S, D) -> (N, S, H, D): a boolean (N, S) index then packs the real positions
        pack = lambda t: t[idx].transpose(1, 2)[real].cpu()  # noqa: E731
        empty = torch.zeros(0)
        state.update(
            lengths=real.sum(1).tolist(),
            keys=[pack(layer.keys) for layer in layers],
            values=[pack(layer.values) for layer in layers],
            next_position=self.next_position[idx].cpu(),
            pending=self.pending[idx].cpu(),
            scored=[torch.cat(self._scored[row] or [empty.to(self.pending.device)]).cpu()
                    for row in ids])
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Add the rows of a ``state_dict`` back to the cache, merged with the rows held (on
        the model's device; K/V in the cache's dtype). Their scoring then goes on exactly as
        if it had never left: the saved K/V are the same numbers, at the same positions."""
        if state.get("kind") != self.kind:
            raise ValueError(f"state of a {state.get('kind')!r} scorer cannot be loaded into "
                             f"a {self.kind!r} scorer")
        if self.kind == "reference" and state.get("temperature") != self.temperature:
            raise ValueError(f"reference state scored at temperature {state.get('temperature')}"
                             f", this scorer uses {self.temperature}")
        ids = self._new_rows(state["rows"])
        if not ids:
            return
        param = next(self.model.parameters())
        device = param.device
        dtype = self.cache.layers[0].keys.dtype if self.cache is not None else param.dtype
        layers = _num_layers(self.model, self.cache)
        if layers is not None and len(state["keys"]) != layers:
            raise ValueError(f"state holds K/V of {len(state['keys'])} layers, the "
                             f"{self.kind} model has {layers}")
        lengths = torch.tensor(state["lengths"], dtype=torch.long, device=device)
        width = int(lengths.max())
        # right-aligned: the same layout as a left-padded prompt
        real = torch.arange(width, device=device)[None, :] >= (width - lengths)[:, None]

        def unpack(packed: torch.Tensor) -> torch.Tensor:
            packed = packed.to(device=device, dtype=dtype)
            out = packed.new_zeros(len(ids), width, *packed.shape[1:])
            out[real] = packed
            return out.transpose(1, 2).contiguous()  # (N, H, S, D)

        from transformers import DynamicCache

        cache = DynamicCache(ddp_cache_data=[(unpack(k), unpack(v))
                                             for k, v in zip(state["keys"], state["values"])])
        # copies: the cache updates these in place, and the state may be loaded again
        pending = state["pending"].to(device, copy=True)
        if self.pending is not None:
            pending = pending.to(self.pending.dtype)
        scored = {row: [t.to(device)] if t.numel() else []
                  for row, t in zip(ids, state["scored"])}
        mask_dtype = self.cache_mask.dtype if self.cache_mask is not None else torch.long
        self._merge(ids, cache, real.to(mask_dtype),
                    state["next_position"].to(device=device, dtype=torch.long, copy=True),
                    pending, scored)

    def _new_rows(self, rows) -> list[int]:
        """Check ids about to enter the cache: unique, >= 0, not cached yet."""
        if not isinstance(rows, torch.Tensor):
            rows = list(rows)
        ids = torch.as_tensor(rows, dtype=torch.long).reshape(-1).tolist()
        seen = set()
        for row in ids:
            if row < 0:
                raise ValueError(f"row ids must be >= 0, got {row}")
            if row in seen:
                raise ValueError(f"row {row} appears twice among the rows to add")
            if row in self._index:
                raise ValueError(f"row {row} is already in the {self.kind} scorer's cache "
                                 f"(finish or drop it first)")
            seen.add(row)
        return ids

    def _merge(self, ids: list[int], cache, mask: torch.Tensor, next_position: torch.Tensor,
               pending: torch.Tensor, scored: dict[int, list[torch.Tensor]]) -> None:
        """Append rows (their own cache, mask (n, S'), ...) to the held ones, along the batch
        dimension of every layer's K/V."""
        mask = _drop_masked_columns(cache, mask)
        if self.cache is None:
            self.cache, self.cache_mask = cache, mask
            self.rows = torch.tensor(ids, dtype=torch.long, device=mask.device)
            self.next_position, self.pending = next_position, pending
        else:
            self.compact()
            width = max(self.cache_width, mask.shape[1])
            self.cache_mask = _pad_left(self.cache, self.cache_mask, width)
            mask = _pad_left(cache, mask.to(self.cache_mask.dtype), width)
            for held, new in zip(_plain_layers(self.cache), _plain_layers(cache), strict=True):
                held.keys = torch.cat([held.keys, new.keys], dim=0)
                held.values = torch.cat([held.values, new.values], dim=0)
            self.cache_mask = torch.cat([self.cache_mask, mask], dim=0)
            self.rows = torch.cat([self.rows, torch.tensor(ids, dtype=torch.long,
                                                           device=self.rows.device)])
            self.next_position = torch.cat([self.next_position, next_position])
            self.pending = torch.cat([self.pending, pending.to(self.pending.dtype)])
        self._index = {r: i for i, r in enumerate(self.rows.tolist())}
        self._scored.update(scored)

    def _cache_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Cache positions (A,) of row ids (A,)."""
        try:
            idx = [self._index[r] for r in rows.tolist()]
        except KeyError as err:
            raise KeyError(f"row {err.args[0]} is not in the {self.kind} scorer's cache "
                           f"(never added, or already finished)") from None
        return torch.tensor(idx, dtype=torch.long, device=self.rows.device)

    def _remove(self, idx: torch.Tensor) -> None:
        """Release cache rows ``idx``."""
        gone = torch.zeros(self.num_rows, dtype=torch.bool)
        gone[idx.cpu()] = True
        self._keep((~gone).nonzero().squeeze(-1).to(self.rows.device))

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


def has_sliding_window(model) -> bool:
    """Whether ``model``'s attention has sliding-window layers: the cache its config builds
    (``DynamicCache(config=...)``, as the model's own forward would) has such a layer. A model
    without a Hugging Face config (a test's stand-in) has none."""
    from transformers import DynamicCache

    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "num_hidden_layers"):
        return False
    try:
        layers = DynamicCache(config=config).layers
    except Exception:  # a config the cache cannot read: no claim either way
        return False
    return any(getattr(layer, "is_sliding", False) for layer in layers)


def _plain_layers(cache) -> list:
    """The cache's layers, each holding the whole (N, H, S, D) K/V of its rows. Merging,
    compacting and saving edit those tensors column by column; a sliding-window or
    quantized layer keeps something else, which those edits would corrupt."""
    from transformers.cache_utils import DynamicLayer

    layers = list(cache.layers)
    for layer in layers:
        if type(layer) is not DynamicLayer or layer.keys is None:
            raise NotImplementedError(f"carrying or compacting scorer rows needs a "
                                      f"DynamicCache of full-attention DynamicLayers, got "
                                      f"{type(cache).__name__} with a {type(layer).__name__}")
    return layers


def _drop_masked_columns(cache, mask: torch.Tensor) -> torch.Tensor:
    """Remove the columns of ``cache`` masked in every row; returns the mask of the rest."""
    keep = mask.bool().any(0)
    if bool(keep.all()):  # a host sync, once per add
        return mask
    cols = keep.nonzero().squeeze(-1)
    for layer in _plain_layers(cache):
        layer.keys = layer.keys.index_select(2, cols)
        layer.values = layer.values.index_select(2, cols)
    return mask[:, cols]


def _pad_left(cache, mask: torch.Tensor, width: int) -> torch.Tensor:
    """Widen ``cache`` to ``width`` columns by masked zero K/V on the left; returns the mask.
    Left, not right: the rows' next chunk is appended on the right of every row alike."""
    extra = width - mask.shape[1]
    if extra == 0:
        return mask
    for layer in _plain_layers(cache):
        for name in ("keys", "values"):
            t = getattr(layer, name)
            pad = t.new_zeros(t.shape[0], t.shape[1], extra, t.shape[3])
            setattr(layer, name, torch.cat([pad, t], dim=2))
    return torch.cat([mask.new_zeros(mask.shape[0], extra), mask], dim=1)


def _num_layers(model, cache) -> Optional[int]:
    """Decoder layers the scorer's cache holds: the model's own (``cache_layers``: a
    pipeline stage's, under Megatron pipeline parallel), else its config's (None when it
    does not say)."""
    if cache is not None:
        return len(cache.layers)
    if getattr(model, "cache_layers", None) is not None:
        return model.cache_layers
    config = getattr(model, "config", None)
    if config is None:
        return None
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    return getattr(config, "num_hidden_layers", None)
