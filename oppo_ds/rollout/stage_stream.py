"""The actor rank's side of a rollout under the ``stage`` placement: decode in chunks and
stream them to the scorer stage (``stage.py``: the scorer rank, the wire protocol and
``RemoteScorers``), and, for a model split tensor/pipeline parallel over several ranks, share
the one streaming rank's scores with the rest of its replica.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .generate import SamplingParams, finish, start_decode
from .stage import RemoteScorerError, RemoteScorers
from .streaming import (ScorerTiming, StreamTiming, TimelineEvent, _assemble, _clock,
                        _current_stream_wait, _decode_in_chunks, _summarize, _Timeline)


@dataclass
class Replica:
    """The ranks of one model replica (tensor x pipeline parallel) decode the same tokens;
    only ``sender`` (a GLOBAL rank) streams them to the scorer rank, and it shares the scores
    and the timing with the others over ``group`` (the replica's model-parallel group)."""
    group: object
    sender: int

    @property
    def sends(self) -> bool:
        return dist.get_rank() == self.sender


class _Quiet:
    """The chunk sink of a replica rank that does not send (its replica's sender does)."""

    def chunk(self, name, rows, tokens, counts, ended) -> None:
        pass


def stage_stream_generate(actor, remote: Optional[RemoteScorers], prompt_ids: torch.Tensor,
                          prompt_mask: torch.Tensor, params: SamplingParams,
                          generator: Optional[torch.Generator], chunk_size: int,
                          targets: Optional[torch.Tensor] = None,
                          replica: Optional[Replica] = None,
                          row_ids: Optional[Sequence[int]] = None):
    """``stream_generate`` with the scorers on the scorer stage behind ``remote``.

    Returns (Generation, results, StreamTiming) as ``stream_generate`` does: the same
    Generation (sampling is untouched) and the same scores (the same computation, in another
    process). Timing: ``scoring_end_s`` is when this rank had received the results,
    ``scoring_tail_s`` what it waited for after its last token (the stage's remaining work
    and the transfer), ``scorers`` / ``scoring_busy_s`` / ``scoring_hidden_frac`` /
    ``events`` come from the stage's own timestamps, placed on this rank's timeline as the
    module docstring says.

    With ``replica`` (a model-parallel actor), every rank of it calls this with the same
    prompts: the sender (``remote`` given) streams, the others (``remote`` None) decode the
    same tokens without sending, and all return the sender's results and timing.
    ``row_ids`` name the rows to the stage (default 0..B-1): with a carrying stage they must
    be none of the rows it holds (``remote.held``), which it then drops.
    """
    inputs = dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, targets=targets)

    def package(state, finished):
        gen = finish(state)
        return gen, {kind: _assemble(kind, per_row, gen) for kind, per_row in finished.items()}

    return _on_replica(actor, remote, inputs, params, generator, chunk_size, replica,
                       package=package, row_ids=row_ids)


def stage_stream_continue(actor, remote: Optional[RemoteScorers], start_inputs: dict,
                          row_ids: torch.Tensor, params: SamplingParams,
                          generator: Optional[torch.Generator], chunk_size: int, stop=None,
                          replica: Optional[Replica] = None):
    """``stream_continue`` (the rollout pool's streaming rollout) with the scorers on the
    scorer stage. A row new to the stage goes to it with its prompt and the response it has so
    far, which it prefills (on its own device, while this rank rebuilds its KV cache the same
    way) before the chunks come. Rows still running when ``stop`` ends the rollout: with a
    carrying stage (``remote.carry``, frozen scorers) they stay in its caches and are not sent
    again, as the frozen scorers carry them under ``inline`` / ``colocated``; otherwise they
    are dropped there and sent again next time (their prefix recomputed; the same scores
    within float rounding). ``row_ids`` name the rows to the stage.

    Returns (DecodeState, {kind: {row id: result}} of the rows that finished, StreamTiming),
    as ``stream_continue``; ``replica`` as in ``stage_stream_generate``."""
    ids = row_ids.tolist()  # once: per finished row on a GPU tensor, a sync each

    def package(state, finished):
        return state, {kind: {ids[i]: v for i, v in per_row.items()}
                       for kind, per_row in finished.items()}

    return _on_replica(actor, remote, start_inputs, params, generator, chunk_size, replica,
                       package=package, stop=stop, partial=True, row_ids=ids)


def stage_score_ended(remote: Optional[RemoteScorers], inputs: Optional[dict],
                      row_ids: Sequence[int], replica: Optional[Replica] = None) -> dict:
    """The stage's scores of rows whose responses have ended already, none of them streamed:
    a resumed rollout pool's finished rows from a checkpoint written with streaming off (or a
    scorer not streamed), which the actor rank cannot score, the stage holding that model.
    One rollout of them: new rows with their whole response as the prefix the stage
    prefills (``inputs``: ``prompt_ids``, ``prompt_mask``, ``prefix_ids``, ``prefix_lengths``),
    ended at once by a chunk of no tokens. The scores of the whole sequences, as a streamed
    row's are (the same weights see the same tokens at the same positions). No rows: an
    empty rollout (the stage serves one rollout of every actor rank a round). Returns {kind:
    {row id: result}}; ``replica`` as in ``stage_stream_generate``."""
    ids = [int(r) for r in row_ids]
    if replica is None or replica.sends:
        finished = _on_sender(remote, replica, lambda: _score_ended(remote, inputs, ids))
        if replica is not None:
            _share(replica, _moved(finished, "cpu"))
        return finished
    return _moved(_from_sender(replica), inputs["prompt_ids"].device
                  if inputs is not None else "cpu")


def _on_sender(remote, replica, work):
    """``work()`` on the rank that streams to the stage; when it fails, the other ranks of its
    replica, which wait for its results, learn why before it raises."""
    if remote is None:
        raise ValueError("the rank that streams needs the scorer stage (remote)")
    try:
        return work()
    except Exception as err:
        if replica is not None:
            _share(replica, f"rank {dist.get_rank()}, which streams for its replica, "
                            f"failed: {type(err).__name__}: {err}")
        raise


def _score_ended(remote: RemoteScorers, inputs: Optional[dict], ids: list[int]) -> dict:
    if not ids:
        remote.empty_rollout()
        return {}
    try:
        remote.begin(inputs["prompt_ids"], inputs["prompt_mask"], inputs["prefix_ids"],
                     inputs["prefix_lengths"], row_ids=ids)
        none = torch.zeros(0, dtype=torch.long)
        remote.chunk(0, none, none.view(0, 0), none, torch.arange(len(ids)))
        finished, _ = remote.results()
    except BaseException:
        remote.abort()
        raise
    return {kind: {ids[i]: v for i, v in per_row.items()} for kind, per_row in finished.items()}


def _on_replica(actor, remote, inputs: dict, params, generator, chunk_size: int, replica,
                package, stop=None, partial: bool = False, row_ids=None):
    """One streamed rollout: on the rank that streams (no ``replica``, or its sender) to the
    stage, on the other ranks of a replica decoded quietly and given the sender's results."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    device = inputs["prompt_ids"].device
    if replica is None or replica.sends:
        state, finished, timing = _on_sender(remote, replica, lambda: _stream_to_stage(
            actor, remote, inputs, params, generator, chunk_size, stop, partial,
            hold_errors=replica is not None, row_ids=row_ids))
        if replica is not None:
            _share(replica, (_moved(finished, "cpu"), timing))
        return (*package(state, finished), timing)
    if remote is not None:
        raise ValueError(f"rank {dist.get_rank()} does not stream for its replica "
                         f"(rank {replica.sender} does) but was given the scorer stage")
    state = start_decode(actor, params=params, **inputs)
    _decode_in_chunks(actor, state, _Quiet(), _Timeline(0.0, []), params, generator,
                      chunk_size, stop=stop)
    finished, timing = _from_sender(replica)
    return (*package(state, _moved(finished, device)), timing)


def _moved(finished: dict, device) -> dict:
    """{kind: {row: result}} with every result on ``device``."""
    return {k: {i: v.to(device) for i, v in rows.items()} for k, rows in finished.items()}


def _from_sender(replica: Replica):
    """What the replica's sender shares (``_share``): its results, or ``RemoteScorerError``
    with the message it shared when it failed (``_on_sender``)."""
    shared = _share(replica, None)
    if isinstance(shared, str):
        raise RemoteScorerError(shared)
    return shared


def _share(replica: Replica, obj):
    """Broadcast ``obj`` from the replica's sender to its other ranks; returns it."""
    box = [obj]
    dist.broadcast_object_list(box, src=replica.sender, group=replica.group)
    return box[0]


class _HoldError:
    """A replica sender's sink: a scorer failure the stage reports mid-rollout is held until
    this rank has decoded to the end, because the other ranks of its replica decode on and
    their tensor/pipeline-parallel calls need this rank's."""

    def __init__(self, remote: RemoteScorers):
        self.remote, self.error = remote, None

    def chunk(self, name, rows, tokens, counts, ended) -> None:
        if self.error is None:
            try:
                self.remote.chunk(name, rows, tokens, counts, ended)
            except RemoteScorerError as err:
                self.error = err


def _stream_to_stage(actor, remote: RemoteScorers, inputs: dict, params, generator,
                     chunk_size: int, stop, partial: bool, hold_errors: bool, row_ids=None):
    """The rollout on the rank that streams: (DecodeState, {kind: {row: result}}, timing)."""
    device = inputs["prompt_ids"].device
    events: list[TimelineEvent] = []
    start = _clock(device)
    timeline = _Timeline(start, events, _current_stream_wait(device))
    try:
        # the stage prefills the prompts (and responses so far) while this rank does too
        begin_s = remote.begin(inputs["prompt_ids"], inputs["prompt_mask"],
                               inputs.get("prefix_ids"), inputs.get("prefix_lengths"),
                               partial=partial, row_ids=row_ids) - start
        state = timeline.run("actor", "prefill", lambda: start_decode(actor, params=params,
                                                                      **inputs))
        sink = _HoldError(remote) if hold_errors else remote
        chunks, row_tokens = _decode_in_chunks(actor, state, sink, timeline, params,
                                               generator, chunk_size, stop=stop)
        if hold_errors and sink.error is not None:
            raise sink.error
        finished, stage_events = remote.results()
    except BaseException:
        remote.abort()
        raise
    received_s = _clock(device) - start

    timing = StreamTiming(chunks=chunks, row_tokens=row_tokens, start=start,
                          scorers={k: ScorerTiming() for k in finished},
                          events=events + [e._replace(start_s=e.start_s + begin_s,
                                                      end_s=e.end_s + begin_s)
                                           for e in stage_events])
    timing.wall_s = _clock(device) - start
    _summarize(timing)
    timing.scoring_end_s = max(received_s, timing.decode_end_s)
    timing.scoring_tail_s = timing.scoring_end_s - timing.decode_end_s
    return state, finished, timing
