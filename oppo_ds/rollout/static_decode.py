"""The actor's decode at one shape: a KV cache of fixed length and a batch that does not shrink
(``generation.static_cache``), optionally replayed as one CUDA graph (``generation.cuda_graph``).

The default decode (``generate.decode_steps``) drops a row from its KV cache when the row ends
and grows the cache by one position a token, so every forward has a shape of its own. On the
GPUs measured the actor's forward was host-bound (the host issuing kernels, not the device
running them), and whatever is paid once per new shape is paid there again and again. Here
every decode forward of a rollout has the same shapes: the cache holds ``length`` positions
from the start (``transformers.StaticCache``, written in place), a (B, 1, 1, length) mask says
which positions each row attends to, and a row that ended stays in the batch, fed its last
token at its last position, its outputs unread. That costs the ended rows' share of each
forward (nothing where the forward is host-bound; on a CPU, which computes every row, it is
slower) and buys a forward that can be captured once and replayed as a CUDA graph: one launch
a token instead of one per kernel.

With a CUDA graph, the buffers (cache, mask, inputs, the graph and its memory) of a model's
last rollout are kept, through training too, and serve its next rollout of the same length
and as many rows or fewer: the trainer gives every rollout of a run one length
(``static_length.run_cache_length``: new prompts and deferred responses alike) and one
width (``SamplingParams.static_rows``: its widest rollout, ``Config.widest_rollout``; a
smaller rollout, or an evaluation's batch, pads), and other callers' lengths are rounded up
to a multiple of ``static_length.LENGTH_ROUND`` so that prompts of different widths share
them. Without a graph they go with the decode. A graph reads the weights where they were
when it was captured; if any parameter has moved since (ZeRO-3 gathers them anew for each
rollout), the graph is captured again.

What is decoded does not change: the same tokens and log-probs as the default decode, up to
the float rounding of attention over a longer, masked cache (tested to 1e-5 in fp32).
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch

from ..kv_cache import cache_kwargs

_ATTENTION = ("sdpa", "eager")  # the implementations whose masks we build (bool / additive)

_CAPTURES = 0  # graphs captured in this process (captures())
# model -> the StaticDecode of its last rollout with a CUDA graph: buffers and graph kept for
# the next one, as the graph reads them where they are (one set per model: at 70B a static
# cache of another shape would be tens of GB more). Without a graph nothing is kept: the
# buffers go with the decode, as the default decode's cache does.
_KEPT: "weakref.WeakKeyDictionary[torch.nn.Module, StaticDecode]" = weakref.WeakKeyDictionary()
_KEEP_WITHOUT_GRAPH = False  # tests set it, to check on a CPU the keeping a graph relies on


def check_graph_device(device: torch.device, key: str, off: str) -> None:
    """A CUDA graph needs the actor on a CUDA device: ``ValueError`` naming ``key`` (the
    setting as its caller knows it) and ``off`` (how to go on without it) otherwise."""
    if device.type != "cuda":
        raise ValueError(f"{key} needs the actor on a CUDA device; it is on {device}: {off}")


def _attention(model) -> str:
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(
            f"generation.static_cache needs a Hugging Face causal LM (a model with a config, "
            f"whose attention is one of {', '.join(_ATTENTION)}); the actor is a "
            f"{type(model).__name__} without one: set generation.static_cache: false")
    impl = getattr(config, "_attn_implementation", None) or "sdpa"
    if impl not in _ATTENTION:
        raise ValueError(
            f"generation.static_cache needs a Hugging Face causal LM whose attention is one of "
            f"{', '.join(_ATTENTION)} (the masks it is given are built here); the actor is a "
            f"{type(model).__name__} with attention {impl!r}: set generation.static_cache: false")
    return impl


class StaticDecode:
    """The fixed-shape buffers of one static decode of ``batch`` rows in a cache of
    ``length`` positions. Row i of the batch is row i of the decode state (rows never leave);
    rows past the state's (``live``) pad a smaller decode into kept buffers.
    """

    def __init__(self, model, batch: int, length: int, device: torch.device, cuda_graph: bool):
        from transformers import StaticCache

        self.additive = _attention(model) == "eager"
        if cuda_graph:
            check_graph_device(device, "generation.cuda_graph", "set generation.cuda_graph: false")
        self.batch, self.length, self.cuda_graph = batch, length, cuda_graph
        self.live = batch  # rows of the decode using the buffers; the others pad (``get``)
        self.cache = StaticCache(config=model.config, max_cache_len=length)
        if any(getattr(layer, "is_sliding", False) for layer in self.cache.layers):
            raise ValueError(
                f"generation.static_cache: the actor ({type(model).__name__}) has sliding-window "
                f"attention layers, whose static cache is shorter than the mask built here: "
                f"set generation.static_cache: false")
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.attend = torch.zeros(batch, 1, 1, length, dtype=torch.bool, device=device)
        # what the forward is given: ``attend`` itself, or its additive form (eager attention),
        # refreshed in place by ``prefill`` (a captured graph reads this buffer)
        self.mask = self._form(self.attend, model)
        self.column = 0                           # the cache position the next token goes to
        self.graph: Optional["torch.cuda.CUDAGraph"] = None
        self.logits: Optional[torch.Tensor] = None  # the graph's output
        self.weights: tuple = ()                  # where the parameters were at capture
        self.owner = None                         # weakref to the DecodeState decoding here

    # ------------------------------------------------------------------ one rollout

    @classmethod
    def get(cls, model, batch: int, length: int, device: torch.device, cuda_graph: bool,
            rows: int = 0) -> "StaticDecode":
        """The kept buffers of this length: a new set if none serves ``batch`` rows, or if a
        decode that has not ended holds them (``hold``). Kept (for the next call) with a CUDA
        graph only.

        Kept buffers of more rows serve a smaller decode, the rows past ``batch`` padding: a
        pool's rollout leaves out the rows that finished ahead of the step, an overcommit
        under ``auto`` moves B + Delta, an evaluation decodes B rows or fewer, and each new
        batch size would otherwise be a capture. ``rows``: the most rows a decode of the run
        is expected to have (``SamplingParams.static_rows``; 0 if the caller does not know):
        a new set is built at least that wide, and the kept set, the run's widest so far,
        serves every decode of the run (a later round of ``ppo.filter_groups`` with
        ``filter_groups_oversample`` can be wider than expected: its set is kept in place of
        the narrower one, once). Without ``rows``, kept buffers serve a decode of at least
        half their rows (so that a small caller's decode does not pay for a large one's), and
        a set that cannot serve a decode because it is wider stays kept, the smaller decode's
        own set going with it."""
        if not (cuda_graph or _KEEP_WITHOUT_GRAPH):
            return cls(model, batch, length, device, cuda_graph)
        kept = _KEPT.get(model)
        same = kept is not None and (kept.length, kept.cuda_graph) == (length, cuda_graph)
        if same and batch <= kept.batch and (rows or kept.batch <= 2 * batch) \
                and not kept._held():
            kept.live = batch
            return kept
        fresh = cls(model, max(batch, rows), length, device, cuda_graph)
        fresh.live = batch
        if kept is None or not (kept._held() or same and kept.batch > fresh.batch):
            _KEPT[model] = fresh
        return fresh

    def hold(self, state) -> None:
        """``state`` (a ``DecodeState``) decodes here until it is over."""
        self.owner = weakref.ref(state)

    def _held(self) -> bool:
        state = self.owner() if self.owner is not None else None
        return state is not None and not state.over

    def prefill(self, model, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                **kept):
        """The prompts' forward (B, W) into positions 0..W-1 of the cache; its output (the
        live rows' logits; ``kept``: ``logits_to_keep`` for the model, the last positions'
        only). Padding rows (past ``live``) attend only to themselves."""
        live, width = ids.shape
        if live < self.batch:
            pad = (self.batch - live, width)
            ids, mask, positions = (torch.cat([t, t.new_zeros(pad)])
                                    for t in (ids, mask, positions))
        for layer in self.cache.layers:  # the cache starts again at position 0, in place
            if getattr(layer, "is_initialized", False):
                layer.cumulative_length.zero_()
        self.attend.zero_()
        self.attend[:, 0, 0, :width] = mask.bool()
        causal = torch.ones(width, self.length, dtype=torch.bool, device=ids.device).tril()
        prefill = causal[None, None] & self.attend
        # a left-padding position attends to itself, so that no query row is all masked (its
        # output, never read by a real token, stays finite)
        prefill |= torch.eye(width, self.length, dtype=torch.bool, device=ids.device)[None, None]
        out = model(input_ids=ids, attention_mask=self._form(prefill, model),
                    position_ids=positions, use_cache=True, **cache_kwargs(model, self.cache),
                    **kept)
        self.column = width
        if self.additive:
            self.mask.copy_(self._form(self.attend, model))
        if self.graph is not None and self.weights != _weights(model):
            self.graph, self.logits = None, None  # the weights moved: capture again
        if live < self.batch:
            out.logits = out.logits[:live]
        return out

    def step(self, model, rows: torch.Tensor, tok: torch.Tensor,
             positions: torch.Tensor) -> torch.Tensor:
        """One token for the running ``rows`` (A,) (ids ``tok`` (A,) at ``positions`` (A,));
        the other rows feed their previous token again, unread. Returns the running rows'
        next-token logits (A, V)."""
        if self.column >= self.length:
            raise RuntimeError(f"static decode cache of {self.length} positions is full "
                               "(cache_length sized it too small)")
        self.tokens[rows, 0] = tok
        self.positions[rows, 0] = positions
        self.attend[:, 0, 0, self.column] = True
        if self.additive:
            self.mask[:, 0, 0, self.column] = 0.0
        logits = self._forward(model)
        self.column += 1
        return logits[rows, -1, :]

    # ------------------------------------------------------------------ the forward

    def _form(self, attend: torch.Tensor, model) -> torch.Tensor:
        """``attend`` as the model's attention takes it: bool for SDPA, additive for eager."""
        if not self.additive:
            return attend
        dtype = next(model.parameters()).dtype
        return torch.zeros(attend.shape, dtype=dtype, device=attend.device).masked_fill(
            ~attend, torch.finfo(dtype).min)

    def _eager(self, model, call=None) -> torch.Tensor:
        out = (call or model)(input_ids=self.tokens, attention_mask=self.mask,
                              position_ids=self.positions, use_cache=True,
                              **cache_kwargs(model, self.cache))
        return out.logits

    def _forward(self, model) -> torch.Tensor:
        if not self.cuda_graph:
            return self._eager(model)
        if self.graph is None:
            self._capture(model)
        self.graph.replay()
        return self.logits

    def _capture(self, model) -> None:
        """Capture the one-token forward. Two warm-up forwards on a side stream first (they
        write this token's cache position, and the next, which the real forwards rewrite
        before reading); the cache's position counters are put back after them. Nothing is
        launched by the capture itself: the first replay computes this token.

        Warm-ups and capture call ``model.forward``, past the hooks on the model itself, as a
        replay does: a DeepSpeed engine's hooks there start its throughput timer, which
        synchronizes the device (unless its config turns the timer off, as ours do), and a
        capture cannot synchronize. The submodules' hooks run (under ZeRO-3 the rollout has
        taken them off: ``gathered_without_hooks``)."""
        device = self.tokens.device
        counters = [layer.cumulative_length.clone() for layer in self.cache.layers]
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._eager(model, model.forward)
        torch.cuda.current_stream(device).wait_stream(side)
        for layer, count in zip(self.cache.layers, counters):
            layer.cumulative_length.copy_(count)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: the colocated scorers' thread may launch on its own stream
            # meanwhile, which the default (global) mode would refuse, breaking the capture
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self.logits = self._eager(model, model.forward)
        except RuntimeError as err:
            raise RuntimeError(
                f"generation.cuda_graph: capturing the actor's one-token forward "
                f"({type(model).__name__}, batch {self.batch}, cache {self.length}) failed: "
                f"{err}; set generation.cuda_graph: false to decode without a graph") from err
        self.graph, self.weights = graph, _weights(model)
        global _CAPTURES
        _CAPTURES += 1


def captures() -> int:
    """Graphs captured in this process so far (the trainer logs each step's:
    ``rollout/graph_captures``); each costs two warm-up forwards and the capture."""
    return _CAPTURES


def _weights(model) -> tuple:
    return tuple(p.data_ptr() for p in model.parameters())
