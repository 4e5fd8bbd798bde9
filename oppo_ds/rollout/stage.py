"""The ``stage`` placement: the streaming scorers on their own rank, a pipeline stage after the
actor.

The actor rank decodes in chunks (``stage_stream.py``: ``stage_stream_generate`` /
``stage_stream_continue``) and hands every chunk to ``RemoteScorers``, which sends it
to the scorer rank with ``isend`` and returns at once: the actor goes on decoding while the
scorer rank prefills the chunk into its scorers' KV caches (two processes, real concurrency).
The scorer rank runs ``ScorerStage.serve``: it receives the messages and applies them to its
``StreamingScorer``s exactly as the ``inline`` placement does in one process, so the scores are
the same computation on the same inputs.

Links. One ``ScorerStage`` talks to one actor rank over a ``Link``: a process group of those
two processes alone, so messages need no routing and arrive in the order they were sent. The
trainer's links are built outside torch.distributed's world (``StageLayout``): the actor ranks
form the world by themselves (DeepSpeed's and megatron-core's world collectives, ZeRO-3's
included, then never involve the scorer rank), and the scorer rank is in no world at all; each
link is a two-rank group of its own, rendezvoused through the launcher's store. Several
actor ranks per scorer rank (the paper's 7:1): one ``ScorerStage`` per actor rank, each with
scorers of its own over the same models, served together by ``serve_round``: every message is
applied as it arrives, so each rank's chunks are scored while it decodes. A
model split tensor/pipeline parallel over several ranks (Megatron) decodes the same tokens on
each of them: only its first rank streams (``replica_senders``) and broadcasts the scores to the
others (``stage_stream.Replica``), so the scorer rank scores each replica's rollout once.

Wire protocol. Every message is a header, an int64 tensor of ``HEADER_LEN`` entries
``[op, a, b, c, d, 0, 0, 0]``, followed by the payload tensors the header's op and sizes
determine (none when a size is 0), all on the wire device (CPU for gloo, the current CUDA
device for NCCL). Actor -> scorer:

    WEIGHTS      [WEIGHTS, version, dtype, numel,       the critic's parameters (a stage with a
                  bucket, names]                        critic), in ``named_parameters`` order,
                                                        flattened and cut into buckets of
                                                        ``bucket`` elements, one message each;
                                                        names: crc32 of the names and shapes
                                                        (checked). Sent between rollouts, before
                                                        a BEGIN, whenever the critic trained
    AWAIT_WEIGHTS [AWAIT_WEIGHTS, version]              no payload: the critic's weights of
                                                        ``version`` come over another actor
                                                        rank's link; this link's next message
                                                        is served once the stage holds them
    BEGIN        [BEGIN, B, P, ids dtype, mask dtype,   one int64 message, flat: (2, B, P)
                  L, partial, N]                        prompt ids, mask of the B rows new to
                                                        the stage (all N rows when B = N);
                                                        then, when L > 0, (B, 1 + L): each new
                                                        row's response so far (its length,
                                                        then L tokens, right-padded): rows a
                                                        rollout pool continues; then (2, N):
                                                        the rollout's N rows in decode order,
                                                        their ids and 1 where the row is new
                                                        (0: the stage holds it from the last
                                                        rollout). partial = 1: rows may end
                                                        the rollout unfinished
    CONSUME      [CONSUME, chunk, A, c, n]              int64 (A * (2 + c) + n,): per row its
                                                        place, its count of new tokens and the
                                                        c tokens (right-padded), then the n rows
                                                        that ended in this chunk (A = 0: it only
                                                        ends rows whose whole response came
                                                        with the BEGIN, a resumed pool's)
    END_ROLLOUT  [END_ROLLOUT]                          -> RESULTS (or nothing after an ERROR)
    ABORT        [ABORT]                                -> ABORTED (or nothing after an ERROR)
    SHUTDOWN     [SHUTDOWN, sig]                        ``serve`` returns; sig: the stop signal
                                                        that ended training early, or 0

Scorer -> actor, exactly one reply per rollout (BEGIN to END_ROLLOUT / ABORT):

    RESULTS  [RESULTS, K, B, N, E, sig]
                                    float64 (K * (1 + B) + N + 5 E,), one message: per
                                    scorer its kind code, then per-row result lengths (-1:
                                    the row did not finish, partial rollouts only); the rows'
                                    N results (float32 values), kind by kind, row by row; E
                                    events (lane code, name code, chunk, start_s, end_s),
                                    seconds from the scorer's BEGIN receipt. sig: a stop
                                    signal the scorer process received, or 0 (the actor
                                    ranks stop after the step, as if they had received it)
    ERROR    [ERROR, nbytes]        uint8 (nbytes,): the scorer rank's traceback, UTF-8
    ABORTED  [ABORTED]

Carrying rows between rollouts (``carry=True`` on both ends). After a partial rollout the
stage keeps the rows that did not finish in its frozen scorers' caches (the reward and
reference models, whose prefix state an update does not change), and the next BEGIN sends
only the rows the stage does not hold; rows it holds that the next rollout does not list are
dropped. Both ends follow the same rule (the actor's ``RemoteScorers.held`` is what the stage
holds), and both forget everything after an ABORT or an ERROR. A BEGIN of no rows (N = 0, no
payload) begins an empty rollout: an actor rank whose pool has nothing left to decode while
the other ranks decode sends one (``RemoteScorers.empty_rollout``), since ``serve_round``
serves one rollout of every actor rank per round; the stage drops what it held for that
rank and replies with no results. Without ``carry`` the stage
resets after every rollout and every row is new. CONSUME names rows by their place
in the rollout (0..N-1); the stage maps them to its row ids.

The critic trains, so its copy on the stage (``StageWeights``) takes the actor rank's
weights by WEIGHTS whenever they changed, and its cache is rebuilt at every BEGIN from every
row's prompt and response so far: the actor end sends all N rows (``refresh=True``), the
frozen scorers add the new ones among them, the critic all. Several actor ranks (data
parallel, or Megatron replicas: the same critic weights) share one copy, so one of them
sends WEIGHTS and the others send AWAIT_WEIGHTS naming the version before their BEGIN:
``serve_round`` stops receiving on a link that awaits a version the copy does not hold yet
(its BEGIN and chunks wait in the transport) and resumes it once the WEIGHTS have been
loaded, so no rollout is scored with an older critic and the weights cross the scorer
rank's links once per update, not once per actor rank. A version already loaded is received
and dropped. When no link that could still send the awaited version is open, the waiting
links resume and their next BEGIN reports the error.

A scorer that raises makes the stage send ERROR at once and drop the rest of the rollout's
messages up to its END_ROLLOUT / ABORT (then it resets its scorers and serves the next
rollout). On gloo the actor posts the receive for the reply at BEGIN and a daemon thread
waits on it (gloo's Work reports completion only to a waiter), so the actor stops decoding at
the next chunk after the failure; on NCCL an early posted receive would hold the peer's stream
and block the actor's sends behind it, so the reply is received at the end only.
(A gloo control group for headers beside an NCCL group for payloads would remove that and the
scorer's host sync on each header; not done, and NCCL is untested here.)

Timing without a shared clock. Each process measures intervals on its own
``time.perf_counter`` only. The scorer stamps its events from the moment it received the BEGIN
header; it is idle in ``recv`` when BEGIN is sent (it has replied to the previous rollout and
has nothing else to do), so that moment is the actor's BEGIN send plus one message's latency,
and the actor places the scorer's events on its own timeline from its BEGIN send. The error
is that one-way latency (tens of microseconds on gloo over loopback) plus the clocks' rate
difference (ppm); no offset between machines' clocks enters. ``scoring_hidden_frac`` is then
the share of the scorers' busy time that lay before the actor's last token on that timeline.
"""
from __future__ import annotations

import queue
import threading
import time
import traceback
from datetime import timedelta
from typing import Callable, Optional, Sequence

import torch

from ..config import FROZEN_KINDS, SCORER_KINDS
from .scorer import StreamingScorer
from .stage_layout import Link
from .stage_wire import (_DTYPES, HEADER_LEN, WEIGHTS_BUCKET, Op, StageWeights, _bucket_sizes,
                         _buckets, _decode_events, _encode_events, _header, _layout_hash, _wait,
                         _wire_device)
from .streaming import TimelineEvent, _current_stream_wait, _Timeline

class RemoteScorerError(RuntimeError):
    """A scorer on the scorer rank raised; the message holds the rank and its traceback."""


class ScorerStage:
    """Runs on the scorer rank: applies the actor rank's messages to ``scorers``.

    scorers: one ``StreamingScorer`` per kind (any object with ``kind``, ``begin``,
    ``consume``, ``finish``, ``reset`` will do). link: the ``Link`` to the one actor rank
    served (this process its scorer end). device: where the scorers take their inputs
    (default: the first scorer's model's device). timeout: per receive (default: the link's
    group's timeout; the stage waits a whole training phase between rollouts, so keep it
    long).
    """

    def __init__(self, scorers: Sequence[StreamingScorer], link: Link,
                 device: Optional[torch.device] = None, timeout: Optional[timedelta] = None,
                 carry: bool = False, weights: Optional[StageWeights] = None):
        kinds = [s.kind for s in scorers]
        if not kinds or len(set(kinds)) != len(kinds):
            raise ValueError(f"one scorer per kind, at least one, got {kinds}")
        trained = [s for s in scorers if s.kind not in FROZEN_KINDS]
        if weights is not None and [s.model for s in trained] != [weights.model]:
            raise ValueError(f"weights: the model of the one trained scorer (critic), got "
                             f"scorers {kinds}")
        # with carry, the frozen scorers keep rows across rollouts; a trained one (the
        # critic) is rebuilt at every BEGIN from every row (the actor end's refresh=True)
        self.carry, self.weights = carry, weights
        self._pending: Optional[str] = None  # an error for the next BEGIN (weights)
        self.awaiting: Optional[int] = None  # the critic version AWAIT_WEIGHTS named
        if not link.on_scorer:
            raise ValueError(f"rank {link.rank} is the actor end of its link, not the scorer's")
        self.scorers = list(scorers)
        self.link, self.actor_rank, self.timeout = link, link.actor_rank, timeout
        self.wire = _wire_device(link.backend)
        self.device = device if device is not None else \
            next(self.scorers[0].model.parameters()).device
        self.stopped_by: Optional[Op] = None
        # stop signals: the one this process received (its owner's ``stop_signal()``, asked
        # at every reply, goes out with it) and the one that stopped the actor ranks (their
        # SHUTDOWN's)
        self.stop_signal: Callable[[], int] = lambda: 0
        self.shutdown_signal = 0
        self._start_rollout(0.0)

    def _start_rollout(self, start: float) -> None:
        self._events: list[TimelineEvent] = []
        self._timeline = _Timeline(start, self._events, _current_stream_wait(self.device))
        self._finished: dict[str, dict[int, torch.Tensor]] = {s.kind: {} for s in self.scorers}
        self._replied = self._failed = self._in_rollout = self._partial = False
        self._batch = 0
        self._row_ids = torch.zeros(0, dtype=torch.long)  # the scorers' id of each row

    def serve(self, rollouts: Optional[int] = None) -> int:
        """Serve rollouts until SHUTDOWN, or until ``rollouts`` of them have ended (default: no
        limit); returns how many ended (END_ROLLOUT or ABORT). ``stopped_by`` is then
        ``Op.SHUTDOWN`` or None (the count was reached). A scorer's exception goes back to the actor; one of the transport (the
        actor rank gone: the receive times out) propagates from here."""
        ended = 0
        self.stopped_by = None
        while rollouts is None or ended < rollouts:
            head = self.post_header()
            _wait(head[0], self.timeout)
            ended += self.handle(head[1], time.perf_counter())
            if self.waiting:  # this stage's one link cannot bring the weights
                self.give_up_waiting("this stage serves one actor rank's link alone")
            if self.stopped_by is not None:
                return ended
        return ended

    def post_header(self):
        """Post the receive of the next message's header: (work, header tensor)."""
        head = torch.empty(HEADER_LEN, dtype=torch.long, device=self.wire)
        return self.link.irecv(head), head

    def handle(self, head: torch.Tensor, received: float) -> int:
        """Apply one message whose header has arrived (at ``received``, perf_counter): receive
        its payload and act on it. Returns 1 when it ended a rollout (END_ROLLOUT or ABORT),
        else 0; after SHUTDOWN ``stopped_by`` is ``Op.SHUTDOWN``."""
        self.stopped_by = None
        self._received = received
        op, head, payload = self._recv_payload(head)
        if op == Op.SHUTDOWN:
            self._reset()
            self.stopped_by = Op.SHUTDOWN
            self.shutdown_signal = head[1]
            return 0
        if op == Op.WEIGHTS:
            self._take_weights(head)
            return 0
        if op == Op.AWAIT_WEIGHTS:
            if self.weights is None:
                self._pending = "AWAIT_WEIGHTS sent to a stage without a trained scorer (critic)"
            else:
                self.awaiting = head[1]
            return 0
        if op in (Op.END_ROLLOUT, Op.ABORT):
            if not self._replied:
                if op == Op.END_ROLLOUT:
                    self._guard(self._send_results)
                else:
                    self._send(_header(Op.ABORTED, device=self.wire))
            if self.carry and op == Op.END_ROLLOUT and self._partial and not self._failed:
                self._start_rollout(0.0)  # the unfinished rows stay for the next rollout
            else:
                self._reset()
            return 1
        if op == Op.BEGIN and not self._failed:
            self._start_rollout(self._received)
            self._in_rollout = True
            self._guard(self._begin, head, payload)
        elif not self._failed:  # the rest of a failed rollout is dropped
            self._guard(self._apply, op, head, payload)
        return 0

    @property
    def waiting(self) -> bool:
        """Whether this link awaits critic weights (AWAIT_WEIGHTS) that the shared copy does
        not hold yet: its next message is not to be received until they are loaded."""
        if self.awaiting is not None and (self.weights.version == self.awaiting or
                                          self.weights.error is not None):
            self.awaiting = None  # loaded (or refused: the error goes back at the BEGIN)
        return self.awaiting is not None

    def give_up_waiting(self, why: str) -> None:
        """Stop waiting for the awaited weights: the next BEGIN reports that they never came."""
        held = self.weights.version if self.weights is not None else None
        self._pending = (f"actor rank {self.actor_rank} awaited the critic's weights version "
                         f"{self.awaiting} from another actor rank, which never sent them "
                         f"(the stage holds version {held}; {why})")
        self.awaiting = None

    def _recv_payload(self, head: torch.Tensor):
        head = head.tolist()  # on NCCL a host sync: the sizes decide the next receive
        op = head[0]
        payload = None
        if op == Op.CONSUME:
            size = head[2] * (2 + head[3]) + head[4]
            payload = self._recv_tensor((size,)) if size else None
        elif op == Op.BEGIN:  # the new rows' prompts, the responses they already have, the rows
            new, width, prefix = head[1], head[2], head[5]
            sizes = [2 * new * width, new * (1 + prefix) if prefix > 0 else 0, 2 * head[7]]
            flat = self._recv_tensor((sum(sizes),)).split(sizes)
            payload = (flat[0].view(2, new, width),
                       flat[1].view(new, 1 + prefix) if prefix > 0 else None, flat[2].view(2, -1))
        return op, head, payload

    def _recv_tensor(self, shape, dtype=torch.long) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=self.wire)
        if t.numel():  # an empty payload is never sent (an empty rollout's BEGIN)
            _wait(self.link.irecv(t), self.timeout)
        return t.to(self.device)

    def _take_weights(self, head) -> None:
        """A WEIGHTS message (between rollouts): into ``weights``, or received and dropped
        when this stage has none (the error then goes back at the next BEGIN)."""
        if self.weights is not None:
            self.weights.receive(head, self._recv_tensor)
            return
        for size in _bucket_sizes(head[3], head[4]):
            self._recv_tensor((size,), _DTYPES[head[2]])
        self._pending = "WEIGHTS sent to a stage without a trained scorer (critic)"

    def _guard(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception:
            text = (f"scorer rank {self.link.rank} failed:\n{traceback.format_exc()}")
            data = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)
            self._send(_header(Op.ERROR, data.numel(), device=self.wire), data.to(self.wire))
            self._failed = self._replied = True

    def _begin(self, head, payload) -> None:
        prompts, prefix, rows = payload
        self._row_ids, new = rows[0].cpu(), rows[1].cpu().bool()
        self._batch, self._partial = self._row_ids.numel(), bool(head[6])
        frozen = [s for s in self.scorers if s.kind in FROZEN_KINDS]
        trained = [s for s in self.scorers if s.kind not in FROZEN_KINDS]
        pending, self._pending = self._pending, None
        for error in (pending, self.weights.error if self.weights else None):
            if error:
                raise RuntimeError(error)
        if self.weights is not None and self.weights.version is None:
            raise RuntimeError("the critic's weights never arrived: the actor end sends them "
                               "(RemoteScorers.send_weights) before its first rollout")
        every_row = head[1] == self._batch  # the payload holds all rows, not just new ones
        if trained and not every_row:
            raise RuntimeError(f"{trained[0].kind} is rebuilt at every rollout from every row, "
                               f"but the BEGIN holds {head[1]} of {self._batch} (the actor "
                               f"end needs refresh=True)")
        for scorer in trained:
            scorer.reset()
        listed = set(self._row_ids.tolist())
        for scorer in frozen:
            held = set(scorer.rows.tolist())
            missing = listed - held - set(self._row_ids[new].tolist())
            if missing:
                raise RuntimeError(f"{scorer.kind}: rows {sorted(missing)} are not held here: the "
                                   f"actor and the stage disagree on the carried rows")
            gone = sorted(held - listed)  # rows the actor no longer decodes
            if gone:
                scorer.drop(gone)
        if prompts is None or not self._batch:  # every row is carried, or none is listed
            return
        ids = prompts[0].to(_DTYPES[head[3]])
        mask = prompts[1].to(_DTYPES[head[4]])
        extra = (prefix[:, 1:], prefix[:, 0]) if prefix is not None else ()
        for scorer in trained:
            self._timeline.run(scorer.kind, "begin", scorer.add, self._row_ids.tolist(), ids,
                               mask, *extra)
        if every_row and not bool(new.all()):  # the frozen scorers hold some of them
            sub = new.nonzero().squeeze(-1).to(ids.device)
            ids, mask, extra = ids[sub], mask[sub], tuple(t[sub] for t in extra)
        new_ids = self._row_ids[new].tolist()
        for scorer in frozen if new_ids else ():
            self._timeline.run(scorer.kind, "begin", scorer.add, new_ids, ids, mask, *extra)

    def _apply(self, op, head, payload) -> None:
        run, chunk = self._timeline.run, head[1]
        ids = self._row_ids.to(self.device)
        if op != Op.CONSUME:
            raise ValueError(f"unknown op {op} in a rollout (header {head})")
        active, width = head[2], 2 + head[3]
        table, ended = payload[:active * width].view(active, width), payload[active * width:]
        rows, lengths, tokens = ids[table[:, 0]], table[:, 1], table[:, 2:]
        # no rows: a chunk that only ends rows whose whole response came with the BEGIN
        for scorer in self.scorers if active else ():
            run(scorer.kind, f"consume {chunk}", scorer.consume, rows, tokens, lengths)
        if ended.numel():
            for scorer in self.scorers:
                self._finished[scorer.kind].update(
                    run(scorer.kind, f"finish {chunk}", scorer.finish, ids[ended]))

    def _send_results(self) -> None:
        codes, values = [], []
        for scorer in self.scorers:
            per_row = self._finished[scorer.kind]
            ids = self._row_ids.tolist()  # the reply names rows by their place in the rollout
            missing = sorted(i for i, r in enumerate(ids) if r not in per_row)
            if missing and not self._partial:
                raise KeyError(f"{scorer.kind}: rows {missing} never finished")
            rows = [per_row[r].float().reshape(-1).to(self.wire) if r in per_row else None
                    for r in ids]
            codes.append([SCORER_KINDS.index(scorer.kind)] +
                         [-1 if r is None else r.numel() for r in rows])
            values.extend(r for r in rows if r is not None)
        codes = torch.tensor(codes, dtype=torch.float64, device=self.wire).reshape(-1)
        values = torch.cat(values) if values else torch.zeros(0, device=self.wire)
        events = _encode_events(self._events).to(self.wire)
        head = _header(Op.RESULTS, len(self.scorers), self._batch, values.numel(),
                       events.shape[0], self.stop_signal(), device=self.wire)
        # one payload: each message costs a wake-up of the waiting side
        self._send(head, torch.cat([codes, values.double(), events.reshape(-1)]))

    def _send(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            if t.numel():
                _wait(self.link.isend(t), self.timeout)

    def _reset(self) -> None:
        for scorer in self.scorers:
            scorer.reset()
        self._start_rollout(0.0)


def serve_round(stages: Sequence[ScorerStage]) -> int:
    """Serve the next rollout of every stage (one per actor rank) at once: each message is
    applied as it arrives, whichever actor rank sent it, so no rank's chunks wait for another
    rank's rollout to end. Returns when every stage has ended a rollout or was shut down (its
    ``stopped_by``); returns how many rollouts ended. The
    stages must not share scorer objects (their caches are in use at the same time). A
    header's arrival is waited for in a thread per message (gloo reports a receive's
    completion only to a waiter); the payloads are received here. A stage whose link awaits
    critic weights (AWAIT_WEIGHTS) gets no receive posted until another link's WEIGHTS have
    loaded them; once every stage still open waits, none can, and they give up (their next
    BEGIN reports it)."""
    arrived: queue.Queue = queue.Queue()

    def post(i: int) -> None:
        work, head = stages[i].post_header()
        threading.Thread(target=_wait_then_put, args=(work, stages[i].timeout, arrived, i, head),
                         daemon=True, name="oppo-stage-header").start()

    for i, stage in enumerate(stages):
        stage.stopped_by = None
        post(i)
    ended, open_ = 0, len(stages)
    parked: list[int] = []  # stages waiting for critic weights, no receive posted
    while open_:
        i, head, received, err = arrived.get()
        if err is not None:
            raise err
        n = stages[i].handle(head, received)
        ended += n
        if n or stages[i].stopped_by is not None:
            open_ -= 1  # this stage is done for the round: no receive posted for it
        else:
            parked.append(i)
        if parked and len(parked) == open_ and all(stages[j].waiting for j in parked):
            for j in parked:  # no open link is left to send the weights they wait for
                stages[j].give_up_waiting("no other actor rank's link was still open")
        for j in [j for j in parked if not stages[j].waiting]:
            parked.remove(j)
            post(j)
    return ended


def _wait_then_put(work, timeout, out: queue.Queue, i: int, head: torch.Tensor) -> None:
    try:
        _wait(work, timeout)
        out.put((i, head, time.perf_counter(), None))
    except BaseException as err:  # the transport failed: raised in the serving thread
        out.put((i, head, time.perf_counter(), err))


class RemoteScorers:
    """Runs on the actor rank: the scorers of the stage at the other end of ``link``.

    ``begin`` / ``chunk`` send asynchronously (the sent tensors are kept until their sends
    complete) and return at once; ``results`` ends the rollout and waits for the stage's
    reply; ``abort`` ends it without results; ``close`` shuts the stage down. A scorer's
    failure raises ``RemoteScorerError`` naming the rank, with its traceback. ``carry`` must
    match the stage's: ``held`` is then the set of row ids the stage keeps from the last
    partial rollout (module docstring). ``refresh``: the stage rebuilds a trained scorer (the
    critic) at every rollout, so every row goes with the BEGIN; ``send_weights`` gives it the
    critic's weights between rollouts.
    """

    def __init__(self, link: Link, timeout: Optional[timedelta] = None, carry: bool = False,
                 refresh: bool = False):
        self.carry, self.refresh = carry, refresh
        self.held: set[int] = set()
        self._rollout_rows: list[int] = []
        if link.on_scorer:
            raise ValueError(f"rank {link.rank} is the scorer end of its link, not the actor's")
        self.link, self.scorer_rank, self.timeout = link, link.scorer_rank, timeout
        self.wire = _wire_device(link.backend)
        self._early_reply = link.backend == "gloo"  # see the module docstring
        self._inflight: list[tuple[object, tuple[torch.Tensor, ...]]] = []
        self._reply = None  # (work, header, waiter) of the posted receive of the reply
        self._open = self._ended = self._closed = False
        self.scorer_signal = 0  # a stop signal the scorer process received (its last reply's)

    @property
    def in_rollout(self) -> bool:
        return self._open

    def begin(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
              prefix_ids: Optional[torch.Tensor] = None,
              prefix_lengths: Optional[torch.Tensor] = None, partial: bool = False,
              row_ids: Optional[Sequence[int]] = None) -> float:
        """Send the prompts (and, for rows that continue a response, the response so far:
        ``prefix_ids`` (B, L) right-padded, ``prefix_lengths`` (B,)); ``partial``: rows may
        end the rollout unfinished (a rollout pool's stop rule), their results are left out.
        ``row_ids`` (B,): the rows' ids (default 0..B-1); with ``carry``, rows the stage holds
        (``held``) are not sent again. Returns ``time.perf_counter()`` at the send (the moment
        the stage's event times count from)."""
        if self._open or self._closed:
            raise RuntimeError("begin: a rollout is already open" if self._open
                               else "begin: the scorer stage was shut down")
        batch = prompt_ids.shape[0]
        row_ids = list(range(batch)) if row_ids is None else [int(r) for r in row_ids]
        if len(row_ids) != batch or len(set(row_ids)) != batch:
            raise ValueError(f"row_ids: {batch} distinct ids expected, got {row_ids}")
        new = torch.tensor([r not in self.held for r in row_ids], dtype=torch.bool)
        sub = (torch.ones_like(new) if self.refresh else new).nonzero().squeeze(-1)
        sub = sub.to(prompt_ids.device)
        prompt_ids, prompt_mask = prompt_ids[sub], prompt_mask[sub]
        codes = _DTYPES.index(prompt_ids.dtype), _DTYPES.index(prompt_mask.dtype)
        payload = torch.stack([prompt_ids.to(self.wire, torch.long),
                               prompt_mask.to(self.wire, torch.long)])
        prefix = None
        if prefix_ids is not None and prefix_ids.shape[1] > 0 and sub.numel():
            prefix = torch.cat([prefix_lengths[sub].reshape(-1, 1).to(self.wire, torch.long),
                                prefix_ids[sub].to(self.wire, torch.long)], dim=1)
        rows = torch.stack([torch.tensor(row_ids, dtype=torch.long), new.long()]).to(self.wire)
        self._open, self._ended = True, False
        self._rollout_rows, self._partial = row_ids, partial
        if self._early_reply:
            self._post_reply()
        sent = time.perf_counter()
        flat = torch.cat([t.reshape(-1) for t in (payload, prefix, rows) if t is not None])
        self._isend(_header(Op.BEGIN, *payload.shape[1:], *codes,
                            0 if prefix is None else prefix.shape[1] - 1, int(partial), batch,
                            device=self.wire), flat)
        return sent

    def empty_rollout(self) -> None:
        """A rollout of no rows, begun and ended: what an actor rank with nothing to decode
        sends while the other actor ranks decode, since the scorer rank serves one rollout of
        each of them per round (``serve_round``). The stage drops the rows it held for this
        rank (none of them is decoded any more) and replies with no results."""
        none = torch.zeros(0, 0, dtype=torch.long)
        self.begin(none, none, partial=True, row_ids=[])
        self.results()

    def send_weights(self, module: torch.nn.Module, version: int,
                     bucket: int = WEIGHTS_BUCKET) -> None:
        """Send ``module``'s parameters (the critic, whole on this rank) to the stage's copy,
        between rollouts; returns when they are sent. ``version`` names them (the stage
        skips a version it has). On the wire in the parameters' dtype (float32 when they
        mix dtypes), ``bucket`` elements per message: one bucket's buffer on the wire device,
        filled straight from the parameters (a host-resident critic, a Megatron one gathered
        by ``to_hf``, crosses to the GPU once, with no host-side copy first) and reused."""
        if self._open or self._closed:
            raise RuntimeError("send_weights: between rollouts only" if self._open
                               else "send_weights: the scorer stage was shut down")
        params = [p for _, p in module.named_parameters()]
        dtypes = {p.dtype for p in params}
        dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        numel = sum(p.numel() for p in params)
        _wait(self.link.isend(_header(Op.WEIGHTS, version, _DTYPES.index(dtype), numel, bucket,
                                      _layout_hash(module), device=self.wire)), self.timeout)
        buffer = torch.empty(min(bucket, numel), dtype=dtype, device=self.wire)
        with torch.no_grad():
            for spans in _buckets(params, bucket):
                filled = 0
                for view, a, b in spans:  # the copy casts and moves at once
                    buffer[filled:filled + b - a].copy_(view[a:b])
                    filled += b - a
                # waited on before the next bucket overwrites the buffer
                _wait(self.link.isend(buffer[:filled]), self.timeout)

    def await_weights(self, version: int) -> None:
        """Between rollouts: the stage's critic copy is to hold ``version`` before it serves
        this link's next rollout; another actor rank's link sends those weights
        (``send_weights``), so they cross to the scorer rank once, not once per actor rank."""
        if self._open or self._closed:
            raise RuntimeError("await_weights: between rollouts only" if self._open
                               else "await_weights: the scorer stage was shut down")
        self._isend(_header(Op.AWAIT_WEIGHTS, version, device=self.wire))

    def chunk(self, name: str, rows: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor,
              ended: torch.Tensor) -> None:
        """Send chunk ``name`` (an integer) of rows (A,): tokens (A, c), counts (A,), and the
        rows that ended in it. Raises at once if the stage has already reported a failure."""
        self._check_open()
        if self._reply_arrived():
            self._take_reply()  # only an ERROR can come before END_ROLLOUT: raises
        chunk = int(name)
        table = torch.cat([rows[:, None], counts[:, None], tokens], dim=1)
        payload = torch.cat([table.reshape(-1), ended.to(table.device)]).to(self.wire,
                                                                             torch.long)
        self._isend(_header(Op.CONSUME, chunk, *tokens.shape, ended.numel(), device=self.wire),
                    payload)
        # drop the sends that are done, so long rollouts hold only what is still in flight
        self._inflight = [(w, ts) for w, ts in self._inflight if not w.is_completed()]

    def results(self) -> tuple[dict[str, dict[int, torch.Tensor]], list[TimelineEvent]]:
        """End the rollout; returns ({kind: {row: result}}, the stage's events in seconds from
        its BEGIN receipt)."""
        self._check_open()
        self._end(Op.END_ROLLOUT)
        if self._reply is None:
            self._post_reply()
        finished, events = self._take_reply()
        if self.carry and self._partial:  # what the stage keeps (see ScorerStage.handle)
            done = {i for rows in finished.values() for i in rows}
            self.held = {r for i, r in enumerate(self._rollout_rows) if i not in done}
        return finished, events

    def abort(self) -> None:
        """End an open rollout without results (the stage resets its scorers)."""
        if not self._open:
            return
        if not self._ended:
            self._end(Op.ABORT)
        if self._reply is None:
            self._post_reply()
        try:
            self._take_reply()
        except RemoteScorerError:
            pass  # the rollout is being dropped anyway

    def close(self, signal: int = 0) -> None:
        """Abort an open rollout and shut the stage down (``serve`` returns); ``signal``: the
        number of the stop signal that ended training early (0: it ran to its end)."""
        if self._closed:
            return
        self.abort()
        self._isend(_header(Op.SHUTDOWN, signal, device=self.wire))
        self._drain()
        self._closed = True

    def _end(self, op: Op) -> None:
        self._isend(_header(op, device=self.wire))
        self._ended = True

    def _check_open(self) -> None:
        if not self._open:
            raise RuntimeError("no rollout is open: call begin first")

    def _isend(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            if t.numel():
                work = self.link.isend(t)
                self._inflight.append((work, (t,)))  # t must live until the send is done

    def _drain(self) -> None:
        for work, _ in self._inflight:
            _wait(work, self.timeout)
        self._inflight.clear()

    def _post_reply(self) -> None:
        head = torch.empty(HEADER_LEN, dtype=torch.long, device=self.wire)
        work = self.link.irecv(head)
        waiter = None
        if self._early_reply:
            # gloo's receive work never reports completion before someone waits on it, so a
            # thread waits (without the GIL) and ``chunk`` looks at the thread
            waiter = _Waiter(work)
        self._reply = (work, head, waiter)

    def _reply_arrived(self) -> bool:
        return self._reply is not None and self._reply[2] is not None and \
            self._reply[2].done.is_set()

    def _recv(self, shape, dtype) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=self.wire)
        if t.numel():
            _wait(self.link.irecv(t), self.timeout)
        return t

    def _take_reply(self):
        """Receive the rollout's one reply; the rollout is closed afterwards either way."""
        work, head, waiter = self._reply
        self._reply = None
        self.held = set()  # unless the rollout ends well (results), the stage keeps nothing
        try:
            waiter.result(self.timeout) if waiter is not None else _wait(work, self.timeout)
            op, *sizes = head.tolist()
            if op == Op.ERROR:
                text = bytes(self._recv((sizes[0],), torch.uint8).cpu().tolist()).decode()
                if not self._ended:
                    # the stage drops the rest of the rollout until it sees this
                    self._end(Op.ABORT)
                raise RemoteScorerError(f"the scorer stage on rank {self.scorer_rank} "
                                        f"raised; its traceback:\n{text}")
            if op == Op.ABORTED:
                return None
            if op != Op.RESULTS:
                raise RuntimeError(f"protocol error: reply op {op} from scorer rank "
                                   f"{self.scorer_rank} (header {head.tolist()})")
            kinds, batch, total, n_events, self.scorer_signal = sizes[:5]
            payload = self._recv((kinds * (1 + batch) + total + 5 * n_events,), torch.float64)
            codes, values, table = payload.split([kinds * (1 + batch), total, 5 * n_events])
            codes = codes.cpu().long().view(kinds, 1 + batch)
            return (_split_results(codes, values.float()),
                    _decode_events(table.cpu().view(n_events, 5), 0.0))
        finally:
            self._open = False
            self._drain()


class _Waiter:
    """Waits on a Work in a daemon thread; ``result`` re-raises what the wait raised."""

    def __init__(self, work):
        self.done = threading.Event()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, args=(work,), daemon=True,
                                        name="oppo-stage-reply")
        self._thread.start()

    def _run(self, work) -> None:
        try:
            work.wait()  # the group's timeout
        except BaseException as err:
            self._error = err
        finally:
            self.done.set()

    def result(self, timeout: Optional[timedelta]) -> None:
        if not self.done.wait(None if timeout is None else timeout.total_seconds()):
            raise TimeoutError(f"no reply from the scorer stage within {timeout}")
        if self._error is not None:
            raise self._error


def _split_results(codes: torch.Tensor, values: torch.Tensor) -> dict[str, dict[int, torch.Tensor]]:
    finished, offset = {}, 0
    for kind_code, *counts in codes.tolist():
        kind = SCORER_KINDS[kind_code]
        rows = [i for i, c in enumerate(counts) if c >= 0]  # -1: did not finish
        sizes = [counts[i] for i in rows]
        parts = values[offset:offset + sum(sizes)].split(sizes)
        offset += sum(sizes)
        # a reward is a scalar per row, the others (T_row,) vectors
        finished[kind] = {i: (p.reshape(()) if kind == "reward" else p)
                          for i, p in zip(rows, parts)}
    return finished
