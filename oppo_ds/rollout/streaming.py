"""The intra-step overlap of OPPO: rollouts whose decoded chunks stream into the scorers.

The sequential step scores a response only once the whole batch has finished decoding. Here
each chunk of newly decoded tokens goes to the ``StreamingScorer``s (``scorer.py``: reward,
reference, critic, each with its own KV cache) as soon as the actor has produced it, so when a
sequence ends only its last chunk is left to score, with the same result as whole-sequence
scoring.

``stream_generate`` runs a rollout with the scorers placed ``inline`` (their prefill between
decode chunks in the calling thread: the correctness reference) or ``colocated`` (on the same
devices, concurrently with decoding: a scorer thread, on CUDA a side stream). Its timing holds
a timeline that ``chrome_trace`` writes for chrome://tracing / Perfetto. ``stream_continue``
is the rollout pool's variant: rows that continue deferred responses, scorers that may already
hold some of them, and a stop rule.
"""
from __future__ import annotations

import json
import queue
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple, Optional, Sequence

import torch

from .generate import DecodeState, Generation, SamplingParams, decode_steps, finish, start_decode
from .scorer import StreamingScorer


# "stage" (scorers on their own ranks, a pipeline stage after the actor) has its own entry point
PLACEMENTS = ("inline", "colocated")


@dataclass
class ScorerTiming:
    busy_s: float = 0.0  # all the scorer's work: prompt prefill, chunk prefills, finishing
    tail_s: float = 0.0  # the part after the actor's last token: what the step waits for


class TimelineEvent(NamedTuple):
    """One timed call, in seconds from the start of the rollout."""
    lane: str     # "actor", or the scorer's kind
    name: str     # actor: "prefill", "chunk i"; scorers: "begin", "consume i", "finish i"
    start_s: float
    end_s: float


@dataclass
class StreamTiming:
    """Where a rollout's time went. ``*_end_s`` are seconds from the start of the rollout.

    decode_end_s: when the actor produced its last token (the end of its last chunk).
    scoring_end_s: when the last piece of scorer work finished.
    scoring_busy_s: the scorers' work, summed over scorers (their ``busy_s``).
    scoring_hidden_frac: the part of scoring done while the actor was still decoding: scorer
        busy time before ``decode_end_s`` over ``scoring_busy_s`` (0 without scorer work).
        ``colocated``: work that ran concurrently with decoding. ``inline``: work interleaved
        between chunks, which the actor waited for (nothing runs concurrently there).
    scoring_overlap_frac: the part of scoring that ran while the actor was busy in its
        prefill or a decode chunk: scorer busy time inside the actor's events over
        ``scoring_busy_s``, what the decode actually hid (0 under ``inline``, by
        construction; ``stage``: the scorer rank's events on this rank's clock, from when the
        rollout began there).
    scoring_tail_s: ``scoring_end_s - decode_end_s`` (>= 0), what the step waits for after
        the last token, work still queued for the scorer thread included.
    chunk_decode_s: the actor's time in its decode chunks (``decode_s`` less the prefill).
    handover_s: the actor's time between its chunks, handing them over (under ``inline``
        the scoring itself).
    row_tokens: the tokens each row decoded in this rollout (the chunk-size controller's
        picture of how many rows are still running at each step).
    events: the timeline, ordered by start: lane "actor" holds the prompt prefill and one
        event per decode chunk; each scorer's lane (its kind) one event per call.
    start: ``time.perf_counter()`` when the rollout's clock started (``*_s`` count from it).
    """
    decode_s: float = 0.0  # the actor's prefill and chunked decode
    wall_s: float = 0.0
    chunks: int = 0
    scorers: dict[str, ScorerTiming] = field(default_factory=dict)
    decode_end_s: float = 0.0
    scoring_end_s: float = 0.0
    scoring_busy_s: float = 0.0
    scoring_hidden_frac: float = 0.0
    scoring_overlap_frac: float = 0.0
    scoring_tail_s: float = 0.0
    chunk_decode_s: float = 0.0
    handover_s: float = 0.0
    row_tokens: list[int] = field(default_factory=list)
    events: list[TimelineEvent] = field(default_factory=list)
    start: float = 0.0


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


def _no_wait() -> None:
    pass


def _current_stream_wait(device: torch.device) -> Callable[[], None]:
    """A timeline's wait for the stage placement: the current CUDA stream of ``device`` only
    (a device-wide sync would also wait for the posted NCCL receives of the links, that is
    for the other side's next message); nothing on the CPU."""
    return torch.cuda.current_stream(device).synchronize if device.type == "cuda" else _no_wait


class _Timeline:
    """Times calls onto lanes. ``wait`` blocks until the calling thread's queued device work
    is done, so a call ends when its kernels have: the whole device for ``inline``, only the
    thread's own stream for ``colocated`` (a device-wide sync would wait for the other)."""

    def __init__(self, start: float, events: list, wait: Callable[[], None] = _no_wait):
        self.start, self.events, self.wait = start, events, wait

    def on_thread(self, wait: Callable[[], None]) -> "_Timeline":
        """The same timeline, for another thread with its own stream."""
        return _Timeline(self.start, self.events, wait)

    def run(self, lane: str, name: str, fn, *args):
        self.wait()
        t0 = time.perf_counter()
        out = fn(*args)
        self.wait()
        # list.append is atomic: the actor's and the scorer thread's events share the list
        self.events.append(TimelineEvent(lane, name, t0 - self.start,
                                         time.perf_counter() - self.start))
        return out


class _InlineScoring:
    """``inline``: each scorer's work runs when it is handed over, in the calling thread.
    ``finished[kind]`` collects {row: result}."""

    def __init__(self, scorers: Sequence[StreamingScorer], timeline: _Timeline):
        self.scorers = list(scorers)
        self.timeline = timeline
        self.finished: dict[str, dict[int, torch.Tensor]] = {s.kind: {} for s in scorers}

    def begin(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> None:
        self.setup([(s.kind, "begin", s.begin, (prompt_ids, prompt_mask)) for s in self.scorers])

    def setup(self, calls: Sequence[tuple]) -> None:
        """Scorer calls (lane, name, fn, args) to run before the first chunk, in order."""
        for lane, name, fn, args in calls:
            self.timeline.run(lane, name, fn, *args)

    def chunk(self, name: str, rows: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor,
              ended: torch.Tensor) -> None:
        for scorer in self.scorers:
            run = self.timeline.run
            run(scorer.kind, f"consume {name}", scorer.consume, rows, tokens, counts)
            self.finished[scorer.kind].update(
                run(scorer.kind, f"finish {name}", scorer.finish, ended))

    def results(self) -> dict[str, dict[int, torch.Tensor]]:
        return self.finished

    def close(self) -> None:
        pass


class _ColocatedScoring(_InlineScoring):
    """``colocated``: the same calls in the same order, on one scorer thread; the caller hands
    over each chunk and goes on decoding. On CUDA the thread issues its kernels on a side
    stream that first waits for an event recorded on the caller's stream after the chunk's
    tokens, so no scorer reads tokens the actor has not produced yet.

    A failure in the thread stops its work; the caller re-raises the same exception (its
    traceback holds the thread's frames) at the next hand-over or at ``results``. ``close``
    always joins the thread, dropping work still queued.
    """

    def __init__(self, scorers: Sequence[StreamingScorer], timeline: _Timeline,
                 device: torch.device):
        if device.type == "cuda" and device.index is None:
            # the current device is per thread: name it for the scorer thread
            device = torch.device("cuda", torch.cuda.current_device())
        self._device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        super().__init__(scorers, timeline.on_thread(
            self._stream.synchronize if self._stream is not None else _no_wait))
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: Optional[BaseException] = None
        self._abort = False
        self._thread = threading.Thread(target=self._serve, name="oppo-colocated-scorers",
                                        daemon=True)
        self._thread.start()

    def setup(self, calls: Sequence[tuple]) -> None:
        self._submit(super().setup, calls)

    def chunk(self, name, rows, tokens, counts, ended) -> None:
        self._submit(super().chunk, name, rows, tokens, counts, ended)

    def _submit(self, work, *args) -> None:
        self._raise_if_failed()  # no point decoding on for scorers that failed
        ready = None
        if self._stream is not None:
            ready = torch.cuda.current_stream(self._device).record_event()
        self._queue.put((work, args, ready))

    def _serve(self) -> None:
        try:
            # the current device and stream are per thread: set them for this one (grad mode
            # is per thread too; the scorers' methods are no_grad themselves)
            on_cuda = self._stream is not None
            with (torch.cuda.device(self._device) if on_cuda else nullcontext()), \
                    (torch.cuda.stream(self._stream) if on_cuda else nullcontext()):
                while (item := self._queue.get()) is not None:
                    if self._error is None and not self._abort:
                        self._work(*item)
        except BaseException as err:  # outside any work item; re-raised by the caller
            self._fail(err)

    def _work(self, work, args, ready) -> None:
        try:
            if ready is not None:
                self._stream.wait_event(ready)
                for t in args:
                    # the caller drops its references when it likes: keep the caching
                    # allocator from handing their memory out while our kernels use it
                    if isinstance(t, torch.Tensor) and t.is_cuda:
                        t.record_stream(self._stream)
            work(*args)
        except BaseException as err:  # re-raised in the caller's thread
            self._fail(err)

    def _fail(self, err: BaseException) -> None:
        if hasattr(err, "add_note"):  # Python >= 3.11
            err.add_note("(raised in the colocated scorer thread)")
        self._error = err

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _join(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def results(self) -> dict[str, dict[int, torch.Tensor]]:
        self._join()
        self._raise_if_failed()
        if self._stream is not None:
            # the caller's stream reads what the side stream wrote, and frees it later
            main = torch.cuda.current_stream(self._device)
            main.wait_stream(self._stream)
            for per_row in self.finished.values():
                for t in per_row.values():
                    t.record_stream(main)
        return self.finished

    def close(self) -> None:
        self._abort = True
        self._join()


def stream_generate(actor, scorers: Sequence[StreamingScorer], prompt_ids: torch.Tensor,
                    prompt_mask: torch.Tensor, params: SamplingParams,
                    generator: Optional[torch.Generator], chunk_size: int,
                    placement: str = "inline", targets: Optional[torch.Tensor] = None):
    """Decode a batch in chunks of ``chunk_size`` tokens and stream every chunk to the scorers.
    ``targets``: per-row length limits (a length oracle, see ``start_decode``).

    placement: ``"inline"`` runs the scorers' work between chunks in this thread;
    ``"colocated"`` runs it on one scorer thread (on CUDA, on a side stream) concurrently with
    decoding, the calls in the same order, so the results are the same. ``"stage"`` (scorers
    on their own ranks) has its own entry point.

    Returns (Generation, results, StreamTiming); results[kind] for each scorer's kind:
    reward (B,) float32, reference / critic (B, T) float32 right-padded with 0, where T is the
    Generation's response width. Sampling is exactly that of ``generate`` with the same
    generator: chunking only decides when the scorers see the tokens.

    Colocated on CPU overlaps little: both threads need the GIL between ops, and the intra-op
    thread count (``torch.set_num_threads``) is process-wide, so it is left to the caller.
    Measured on 2 cores (tiny-llama actor + 3 scorers, batch 16, 64 new tokens, chunk 8,
    median of 7): 1 thread: inline 195 ms, colocated 191 ms; 2 threads: 209-219 vs 241-245 ms
    (and inline has rare 2-20 s stalls); the same with hidden 512, 4 layers: 1 thread 1907 vs
    1964 ms, 2 threads 1360-1387 vs 1262-1280 ms. The placement is for the GPU's side stream.
    Thread-local torch state of the caller (autocast) does not reach the scorer thread.
    """
    _check_stream_args(scorers, placement, chunk_size)
    kinds = [s.kind for s in scorers]
    timing, timeline, scoring = _open_scoring(scorers, placement, prompt_ids.device)
    try:
        state = timeline.run("actor", "prefill", lambda: start_decode(
            actor, prompt_ids, prompt_mask, params, targets=targets))
        scoring.begin(prompt_ids, prompt_mask)
        timing.chunks, timing.row_tokens = _decode_in_chunks(
            actor, state, scoring, timeline, params, generator, chunk_size)
        finished = scoring.results()
    finally:
        scoring.close()

    gen = finish(state)
    results = {kind: _assemble(kind, finished[kind], gen) for kind in kinds}
    timing.wall_s = _clock(prompt_ids.device) - timeline.start
    _summarize(timing)
    return gen, results, timing


def stream_continue(actor, scorers: Sequence[StreamingScorer], setup: Sequence[tuple],
                    start_inputs: dict, row_ids: torch.Tensor, params: SamplingParams,
                    generator: Optional[torch.Generator], chunk_size: int,
                    placement: str = "inline", stop=None):
    """The rollout pool's streaming rollout: rows that may continue deferred responses,
    scorers that may already hold some of them (a frozen scorer's cache carried from the
    previous step), and a stop rule.

    setup: scorer calls (lane, name, fn, args) that run first, on the scorers' side (adding
    the new rows, rebuilding the critic's rows from their prefixes). start_inputs: the
    arguments of ``start_decode`` (prompts and prefixes). row_ids (N,): the scorers' row id of
    each decode row. stop: ``decode_steps``'s stop rule. Rows still running when it stops stay
    in the scorers' caches. Returns (DecodeState, {kind: {row id: result}} of the rows that
    finished, StreamTiming).
    """
    _check_stream_args(scorers, placement, chunk_size)
    device = start_inputs["prompt_ids"].device
    timing, timeline, scoring = _open_scoring(scorers, placement, device)
    try:
        scoring.setup(setup)
        state = timeline.run("actor", "prefill", lambda: start_decode(actor, params=params,
                                                                      **start_inputs))
        timing.chunks, timing.row_tokens = _decode_in_chunks(
            actor, state, scoring, timeline, params, generator, chunk_size,
            row_ids=row_ids.to(device), stop=stop)
        finished = scoring.results()
    finally:
        scoring.close()
    timing.wall_s = _clock(device) - timeline.start
    _summarize(timing)
    return state, finished, timing


def _check_stream_args(scorers, placement: str, chunk_size: int) -> None:
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r} "
                         f"('stage' is handled by a different entry point)")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    kinds = [s.kind for s in scorers]
    if len(set(kinds)) != len(kinds):
        raise ValueError(f"one scorer per kind, got {kinds}")


def _open_scoring(scorers, placement: str, device: torch.device):
    """A rollout's timing, its clock (started now) and the scorers' placement."""
    start = _clock(device)
    timing = StreamTiming(scorers={s.kind: ScorerTiming() for s in scorers}, start=start)
    if device.type != "cuda":
        timeline = _Timeline(start, timing.events)
    elif placement == "inline":
        timeline = _Timeline(start, timing.events, lambda: torch.cuda.synchronize(device))
    else:
        timeline = _Timeline(start, timing.events, torch.cuda.current_stream(device).synchronize)
    scoring = (_InlineScoring(scorers, timeline) if placement == "inline"
               else _ColocatedScoring(scorers, timeline, device))
    return timing, timeline, scoring


def _decode_in_chunks(actor, state: DecodeState, sink, timeline: "_Timeline",
                      params: SamplingParams, generator: Optional[torch.Generator],
                      chunk_size: int, row_ids: Optional[torch.Tensor] = None,
                      stop=None) -> int:
    """Decode ``state`` to the end (or until ``stop`` says enough), ``chunk_size`` tokens at a
    time, handing every chunk to ``sink.chunk(name, rows, tokens, counts, ended_rows)`` (the
    scorers, local or remote), rows named by ``row_ids`` (default: their index in the
    state). Returns the number of chunks and the tokens each row decoded (a list)."""
    chunks, start = 0, state.lengths.clone()
    while not state.over:
        rows = state.active.clone()
        before = state.lengths[rows].clone()
        name = str(chunks)
        timeline.run("actor", f"chunk {name}", decode_steps, actor, state, params, generator,
                     chunk_size, stop)
        chunks += 1
        # new tensors, not views of the state the actor goes on writing
        tokens, counts = _chunk_tokens(state, rows, before)
        ended = rows[state.finished[rows]]
        if row_ids is not None:
            rows, ended = row_ids[rows], row_ids[ended]
        sink.chunk(name, rows, tokens, counts, ended)
    return chunks, (state.lengths - start).tolist()


def _overlap(event: TimelineEvent, lane: list[TimelineEvent]) -> float:
    """Seconds of ``event`` inside the events of ``lane`` (one thread's: they do not overlap
    each other)."""
    return sum(max(0.0, min(event.end_s, e.end_s) - max(event.start_s, e.start_s)) for e in lane)


def _summarize(timing: StreamTiming) -> None:
    """Fill the timing's totals from its events (see ``StreamTiming``)."""
    timing.events.sort(key=lambda e: e.start_s)
    actor = [e for e in timing.events if e.lane == "actor"]
    scoring = [e for e in timing.events if e.lane != "actor"]
    decode_end = max(e.end_s for e in actor)
    timing.decode_s = sum(e.end_s - e.start_s for e in actor)
    timing.decode_end_s = decode_end
    chunks = [e for e in actor if e.name.startswith("chunk")]
    timing.chunk_decode_s = sum(e.end_s - e.start_s for e in chunks)
    # the gaps between chunks; the last hand-over comes after the last token, in the tail
    timing.handover_s = sum(max(0.0, b.start_s - a.end_s) for a, b in zip(chunks, chunks[1:]))
    for e in scoring:
        t = timing.scorers[e.lane]
        t.busy_s += e.end_s - e.start_s
        t.tail_s += max(0.0, e.end_s - max(e.start_s, decode_end))
    busy = sum(t.busy_s for t in timing.scorers.values())
    tail = sum(t.tail_s for t in timing.scorers.values())
    timing.scoring_busy_s = busy
    timing.scoring_hidden_frac = min(1.0, max(0.0, (busy - tail) / busy)) if busy > 0 else 0.0
    overlap = sum(_overlap(e, actor) for e in scoring)
    timing.scoring_overlap_frac = min(1.0, overlap / busy) if busy > 0 else 0.0
    timing.scoring_end_s = max((e.end_s for e in scoring), default=decode_end)
    timing.scoring_tail_s = max(0.0, timing.scoring_end_s - decode_end)


def chrome_trace(events: Sequence[TimelineEvent], path, step: Optional[int] = None) -> Path:
    """Write a timeline (``StreamTiming.events``) as a Chrome / Perfetto trace (JSON, for
    chrome://tracing or ui.perfetto.dev): one complete event (ph "X") per entry, ts and dur in
    microseconds from the rollout's start, one thread per lane ("actor" first), named by
    thread_name metadata. ``step`` (the PPO step), if given, names the process and goes into
    each event's args. Returns the path written."""
    lanes = sorted({e.lane for e in events}, key=lambda lane: (lane != "actor", lane))
    tid = {lane: i + 1 for i, lane in enumerate(lanes)}
    pid = 1
    process = "rollout" if step is None else f"rollout (step {step})"
    trace = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
              "args": {"name": process}}]
    for lane in lanes:
        trace.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid[lane],
                      "args": {"name": lane}})
        trace.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid[lane],
                      "args": {"sort_index": tid[lane]}})
    for e in events:
        event = {"ph": "X", "name": e.name, "cat": e.lane, "pid": pid, "tid": tid[e.lane],
                 "ts": e.start_s * 1e6, "dur": (e.end_s - e.start_s) * 1e6}
        if step is not None:
            event["args"] = {"step": step}
        trace.append(event)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}))
    return path


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
