"""The encoding of the ``stage`` placement's messages (the protocol is described in
``stage.py``): the ops, the header, the dtype codes, the scorer's timeline events, and the
critic's weights cut into WEIGHTS buckets and loaded into the stage's copy (``StageWeights``).
"""
from __future__ import annotations

import enum
import time
import zlib
from datetime import timedelta
from typing import Optional, Sequence

import torch

from ..config import SCORER_KINDS
from .streaming import TimelineEvent

HEADER_LEN = 8


class Op(enum.IntEnum):
    BEGIN = 1
    CONSUME = 2
    END_ROLLOUT = 4
    ABORT = 5
    SHUTDOWN = 6
    RESULTS = 7
    ERROR = 8
    ABORTED = 9
    WEIGHTS = 10
    AWAIT_WEIGHTS = 11


# dtypes the header can name (prompt ids and masks travel as int64 and are cast back)
_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
           torch.float32, torch.float16, torch.bfloat16, torch.float64)
_EVENT_NAMES = ("begin", "consume", "finish")
WEIGHTS_BUCKET = 1 << 26  # elements per WEIGHTS message (256 MiB in fp32)


def _wire_device(backend: str) -> torch.device:
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _header(op: Op, *sizes: int, device) -> torch.Tensor:
    values = [int(op), *sizes]
    return torch.tensor(values + [0] * (HEADER_LEN - len(values)), dtype=torch.long,
                        device=device)


def _wait(work, timeout: Optional[timedelta]) -> None:
    # no timeout: the group's own (init_process_group's ``timeout``)
    work.wait() if timeout is None else work.wait(timeout)
    # NCCL's wait() only makes the current CUDA stream wait for the transfer; the wire reads
    # what arrived on the host (a header's fields, which link spoke first): wait for it here
    # (gloo's transfers are complete once wait() returns)
    while not work.is_completed():
        time.sleep(1e-5)


def _encode_events(events: Sequence[TimelineEvent]) -> torch.Tensor:
    rows = []
    for e in events:
        name, _, chunk = e.name.partition(" ")
        rows.append([SCORER_KINDS.index(e.lane), _EVENT_NAMES.index(name),
                     int(chunk) if chunk else -1, e.start_s, e.end_s])
    return torch.tensor(rows, dtype=torch.float64).reshape(-1, 5)


def _decode_events(table: torch.Tensor, offset: float) -> list[TimelineEvent]:
    events = []
    for lane, name, chunk, start, end in table.tolist():
        label = _EVENT_NAMES[int(name)] + ("" if chunk < 0 else f" {int(chunk)}")
        events.append(TimelineEvent(SCORER_KINDS[int(lane)], label, offset + start,
                                    offset + end))
    return events


def _layout_hash(module: torch.nn.Module) -> int:
    """crc32 of the parameters' names and shapes: both ends must hold the same model."""
    text = ";".join(f"{n}:{tuple(p.shape)}" for n, p in module.named_parameters())
    return zlib.crc32(text.encode())


def _bucket_sizes(numel: int, bucket: int) -> list[int]:
    """The sizes of the WEIGHTS payloads of ``numel`` elements cut into ``bucket``s."""
    return [min(bucket, numel - start) for start in range(0, numel, bucket)]


def _buckets(params: Sequence[torch.Tensor], bucket: int) -> list[list[tuple]]:
    """The parameters' concatenation cut into pieces of ``bucket`` elements: per bucket the
    (flat view of a parameter, start, end) spans it is made of, in order."""
    out, current, filled = [], [], 0
    for p in params:
        if not p.is_contiguous():
            raise ValueError("WEIGHTS: parameters must be contiguous")
        flat, start = p.data.view(-1), 0
        while start < flat.numel():
            take = min(bucket - filled, flat.numel() - start)
            current.append((flat, start, start + take))
            filled, start = filled + take, start + take
            if filled == bucket:
                out.append(current)
                current, filled = [], 0
    if current:
        out.append(current)
    return out


class StageWeights:
    """The stage's copy of a model that trains on the actor ranks (the critic): WEIGHTS
    messages load the actor rank's parameters into it. One object serves the ScorerStages of
    every actor rank (they share the model); a version already loaded is received and
    dropped. ``error``: why a WEIGHTS message could not be loaded (reported to the actor at
    the next BEGIN)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.params = [p for _, p in model.named_parameters()]
        self.numel = sum(p.numel() for p in self.params)
        self.layout = _layout_hash(model)
        self.version: Optional[int] = None
        self.error: Optional[str] = None

    @torch.no_grad()
    def receive(self, head: Sequence[int], recv) -> None:
        """Take the message whose header is ``head``; ``recv(shape, dtype)`` receives the
        next payload tensor (on the model's device)."""
        version, dtype, numel, bucket, layout = head[1:6]
        fits = (numel, layout) == (self.numel, self.layout)
        load = fits and version != self.version
        spans = iter(_buckets(self.params, bucket)) if load else None
        for size in _bucket_sizes(numel, bucket):
            flat = recv((size,), _DTYPES[dtype])
            if load:
                offset = 0
                for view, a, b in next(spans):
                    view[a:b].copy_(flat[offset:offset + b - a])
                    offset += b - a
        if not fits:
            self.error = (f"the actor rank's critic ({numel} parameters, layout crc32 {layout}) "
                          f"is not the stage's copy ({self.numel}, {self.layout}): both ends "
                          f"must build the same architecture")
        elif load:
            self.version = version
