"""Which process is which under the ``stage`` placement and how the two ends of each link
find each other: ``StageLayout`` (the launcher's ranks split into actor ranks and the scorer
rank), ``replica_senders`` (one streaming rank per model replica) and ``Link`` /
``connect_link`` (a standalone two-rank process group per streaming actor rank), opened once
both ends say in the store that they are ready, or given up at once when one says it ended
(``StageLayout.abort``, ``StageAborted``). Once the links are open a process that fails says
why in the store too (``StageLayout.report_failure``), and the processes that then see only
a closed connection name that reason (``StageLayout.failure``). The messages that travel over
a link are ``stage.py``'s.
"""
from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from ..config_types import ConfigError


@dataclass
class Link:
    """The channel between one actor rank and the scorer rank: a process group holding the
    two (``group``, either a standalone two-rank group, :func:`connect_link`, or a group of
    torch.distributed's world, :meth:`in_world`) and the other end's rank in it (``peer``).
    ``actor_rank`` / ``scorer_rank`` are the two processes' ranks in the job (the launcher's
    RANK), for messages; ``on_scorer`` says which end this process is."""
    group: object
    peer: int
    backend: str
    actor_rank: int
    scorer_rank: int
    on_scorer: bool
    standalone: bool = False

    @property
    def rank(self) -> int:
        return self.scorer_rank if self.on_scorer else self.actor_rank

    def isend(self, t: torch.Tensor):
        return self.group.send([t], self.peer, 0)

    def irecv(self, t: torch.Tensor):
        return self.group.recv([t], self.peer, 0)

    def close(self) -> None:
        """Let go of the group. A standalone one is then destroyed here, its transport threads
        joined while the interpreter is whole (left to interpreter exit, a gloo thread can
        outlive Python; see ``oppo_ds.cli.train``), provided nothing else holds it; a world
        group is left to its owner. (Not ``ProcessGroupGloo.shutdown``: on torch 2.13 the
        scorer rank then aborted at exit, "terminate called without an active exception",
        in every run.)"""
        self.group = None

    @classmethod
    def in_world(cls, peer: int, group=None) -> "Link":
        """A link over a group of torch.distributed's world (default: the world itself)
        holding this rank and ``peer`` (GLOBAL rank); this rank is the actor end when it is
        the lower of the two."""
        me = dist.get_rank()
        ranks = dist.get_process_group_ranks(group) if group is not None else \
            list(range(dist.get_world_size()))
        if peer == me or peer not in ranks or me not in ranks:
            raise ValueError(f"rank {peer} and this rank {me} must be two ranks of the group "
                             f"(global ranks {list(ranks)})")
        pg = group if group is not None else dist.group.WORLD
        low, high = sorted((me, peer))
        return cls(pg, dist.get_group_rank(pg, peer) if group is not None else peer,
                   dist.get_backend(group), actor_rank=low, scorer_rank=high,
                   on_scorer=me == high)


# the processes of a stage wait this long for each other: to open a link (the actor ranks
# open theirs after preparing the workload and loading models' sources) and per message
# (the scorer rank waits a whole training phase between rollouts)
LINK_TIMEOUT = timedelta(minutes=30)
# the scorer rank reaches the actor ranks' store (actor rank 0's, made as it joins its world at
# start-up) within this long, or stops: rank 0 did not start, or ended without a word
STORE_CONNECT_TIMEOUT = timedelta(minutes=5)
# how long actor rank 0, ending before its link opened, keeps its store up for the scorer rank
# to read why (it stops waiting as soon as the scorer rank has)
ABORT_GRACE_S = 60.0
_KEYS = "oppo_ds/stage/"
_ABORT, _ABORT_SEEN = _KEYS + "abort", _KEYS + "abort_seen"
_FAILED = _KEYS + "failed"
# the store's timeout once a process fails (the links' 30 minutes before): a store whose host
# is gone fails at once, one that does not answer should not hold a failing process long
FAILURE_STORE_TIMEOUT = timedelta(seconds=10)


class StageAborted(RuntimeError):
    """A process of the stage ended before its links opened (``StageLayout.abort``), or
    failed after (``StageLayout.report_failure``): the others stop too, naming it, instead of
    waiting for it or failing on a closed connection. Its own log has the whole traceback."""


def _ready_key(actor_rank: int, end: str) -> str:
    return f"{_KEYS}ready/{actor_rank}/{end}"


def connect_link(store, actor_rank: int, scorer_rank: int, on_scorer: bool,
                 backend: str = "gloo", timeout: timedelta = LINK_TIMEOUT) -> Link:
    """A standalone two-rank process group of ``actor_rank`` (rank 0 in it) and
    ``scorer_rank`` (rank 1), rendezvoused through ``store`` under a key of its own; both
    ends call it. Collective over those two processes only: not in torch.distributed's world
    (it needs no default group, and no other process takes part)."""
    prefix = dist.PrefixStore(f"oppo_ds/stage/link/{actor_rank}-{scorer_rank}/", store)
    me = 1 if on_scorer else 0
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(prefix, me, 2, options)
    elif backend == "gloo":
        group = dist.ProcessGroupGloo(prefix, me, 2, timeout)
    else:
        raise ValueError(f"a stage link runs over gloo or nccl, got {backend!r}")
    return Link(group, 1 - me, backend, actor_rank, scorer_rank, on_scorer, standalone=True)


def replica_senders(actor_ranks: int, tp: int = 1, pp: int = 1) -> list[int]:
    """The first rank of every model replica of ``actor_ranks`` ranks split tensor x pipeline
    parallel by megatron-core's default order (``tp-cp-ep-dp-pp``: tensor-parallel ranks
    consecutive, then data-parallel replicas, then pipeline stages): replica ``d`` is ranks
    ``{s * tp * dp + d * tp + t}``, its first rank ``d * tp``. Unsplit models: every rank."""
    if actor_ranks % (tp * pp):
        raise ValueError(f"{actor_ranks} actor ranks do not hold replicas of tensor_parallel="
                         f"{tp} x pipeline_parallel={pp}")
    return [d * tp for d in range(actor_ranks // (tp * pp))]


@dataclass
class StageLayout:
    """The trainer's processes under the ``stage`` placement: of the ``launched`` processes
    the launcher started (its RANK / WORLD_SIZE), the last one is the scorer rank and the
    others, 0..N-1, the actor ranks. The actor ranks form torch.distributed's world by
    themselves (WORLD_SIZE N: ``actor_env``), so every collective of DeepSpeed (ZeRO-3's and
    the hybrid engine's included) and of megatron-core runs among them; the scorer rank joins
    no world. ``senders`` are the actor ranks that stream (one per model replica: the ranks of
    a tensor/pipeline-parallel replica decode the same tokens, ``replica_senders``); each
    opens a ``Link`` of its own with the scorer rank (``open_links``)."""
    rank: int  # this process's rank among the launched ones
    launched: int
    senders: list[int]
    # whether this process's links are open (``open_links`` returned), and whether it learnt
    # that another process ended before they did (then it has nobody to tell)
    linked: bool = field(default=False, init=False, repr=False)
    told: bool = field(default=False, init=False, repr=False)
    # the store client the links were opened through (None on an actor rank that opens none)
    store: object = field(default=None, init=False, repr=False)

    @property
    def scorer_rank(self) -> int:
        return self.launched - 1

    @property
    def actor_ranks(self) -> list[int]:
        return list(range(self.launched - 1))

    @property
    def is_scorer(self) -> bool:
        return self.rank == self.scorer_rank

    @classmethod
    def from_env(cls, env: dict, tp: int = 1, pp: int = 1) -> "StageLayout":
        """From the launcher's variables (RANK and WORLD_SIZE; a bare ``srun`` task's are
        derived from Slurm's first, ``oppo_ds.rendezvous``). ``tp`` x ``pp``: the model split
        of the actor ranks (Megatron). Raises ValueError for a launch it cannot split."""
        from ..rendezvous import slurm_rendezvous

        env = {**env, **(slurm_rendezvous(env) or {})}
        launched = int(env.get("WORLD_SIZE", "1"))
        if launched < 2:
            raise ValueError(f"the stage placement needs a rank of its own for the scorers "
                             f"besides the actor ranks: launch N + 1 ranks (deepspeed "
                             f"--num_gpus N+1 --module oppo_ds.train ...), got WORLD_SIZE={launched}")
        if (launched - 1) % (tp * pp):
            raise ValueError(f"with tensor_parallel x pipeline_parallel = {tp * pp} the stage "
                             f"placement needs k x {tp * pp} actor ranks plus the scorer rank, "
                             f"got WORLD_SIZE={launched}")
        return cls(int(env.get("RANK", "0")), launched, replica_senders(launched - 1, tp, pp))

    def env_updates(self, env: dict) -> dict:
        """The rendezvous variables this process must set before anything else: a bare
        ``srun`` task's, derived from Slurm's; on an actor rank WORLD_SIZE the actor ranks
        only, so that it joins torch.distributed's world of those (and the per-node count
        too, when every process is on one node: DeepSpeed's CPU shared-memory all-reduce
        compares it with the world size)."""
        from ..rendezvous import slurm_rendezvous

        out = dict(slurm_rendezvous(env) or {})
        if not self.is_scorer:
            actors = str(self.launched - 1)
            out["WORLD_SIZE"] = actors
            for key in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE"):
                if env.get(key) == str(self.launched):
                    out[key] = actors
        return out

    @property
    def name(self) -> str:
        return "the scorer rank" if self.is_scorer else f"actor rank {self.rank}"

    def open_links(self, backend: str, timeout: timedelta = LINK_TIMEOUT,
                   connect_timeout: timedelta = STORE_CONNECT_TIMEOUT) -> dict[int, Link]:
        """This process's links, by actor rank: on the scorer rank one per sender, on a
        sender its own, on the other actor ranks none. Rendezvous through the launcher's
        store (MASTER_ADDR / MASTER_PORT, hosted by actor rank 0's process group, which must
        exist by then; the scorer rank waits ``connect_timeout`` at most to reach it). Each
        end says in the store that it is ready and waits for the other (the scorer rank for
        every sender before it says so); a process that ends before its links open says so
        instead (``abort``, at its exit), and the others raise ``StageAborted`` at once rather
        than wait ``timeout`` (30 min) for it: an actor rank's bad path, say, stops every
        process in seconds."""
        mine = self.senders if self.is_scorer else [a for a in self.senders if a == self.rank]
        if not mine:
            self.linked = True
            return {}
        store = self._store(min(timeout, connect_timeout) if self.is_scorer else timeout)
        store.set_timeout(timeout)
        if self.is_scorer:
            for a in mine:
                self._await(store, _ready_key(a, "actor"), timeout)
            for a in mine:
                store.set(_ready_key(a, "scorer"), "1")
        else:
            store.set(_ready_key(self.rank, "actor"), "1")
            self._await(store, _ready_key(self.rank, "scorer"), timeout)
        links = {a: connect_link(store, a, self.scorer_rank, self.is_scorer, backend, timeout)
                 for a in mine}
        self.linked, self.store = True, store
        return links

    def report_failure(self, err: BaseException) -> None:
        """After this process's links opened: say in the store that it fails, and on what
        (``err``'s type and message; a ``ConfigError`` as ``key: detail``), unless another
        process said so first (then this failure follows from that one). The other end of a
        link sees only a closed connection when this process ends; ``failure`` gives it the
        reason. A no-op before the links opened (``abort`` covers that) and without a store;
        never raises."""
        if self.store is None:
            return
        text = str(err) if isinstance(err, ConfigError) else f"{type(err).__name__}: {err}"
        try:
            self.store.set_timeout(FAILURE_STORE_TIMEOUT)
            where = f"rank {self.rank}, " if self.is_scorer else ""
            self.store.compare_set(_FAILED, "", f"{self.name} ({where}{socket.gethostname()}) "
                                                f"failed on {text}")
        except Exception:  # the store's host (actor rank 0) is gone: nobody left to tell
            pass

    def failure(self) -> "str | None":
        """What another process of the stage reported as it failed (``report_failure``); that
        actor rank 0 ended, when its store can no longer be reached (it hosts the store, so
        its own report goes with it); or None: nobody reported, or this process has no
        store."""
        if self.store is None:
            return None
        try:
            self.store.set_timeout(FAILURE_STORE_TIMEOUT)
            return self.store.get(_FAILED).decode() if self.store.check([_FAILED]) else None
        except Exception:
            return "actor rank 0, the host of the stage's store, ended (its log says why)"

    def _store(self, timeout: timedelta):
        address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        try:
            return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                 is_master=False, timeout=timeout)
        except (RuntimeError, TimeoutError) as err:
            if not self.is_scorer:
                raise
            self.told = True  # no store to tell anybody through
            raise StageAborted(f"the scorer rank could not reach the actor ranks' store at "
                               f"{address} within {timeout}: actor rank 0 did not start, or "
                               f"ended (its log says why)") from err

    def _await(self, store, key: str, timeout: timedelta) -> None:
        """Wait until ``key`` is in ``store``; ``StageAborted`` as soon as a process says it
        ended (``abort``) or the store is gone (actor rank 0, its host, ended)."""
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            try:
                why = store.get(_ABORT).decode() if store.check([_ABORT]) else None
                if why is None and store.check([key]):
                    return
                if why is not None and self.is_scorer:
                    store.set(_ABORT_SEEN, "1")  # actor rank 0 may end now
            except RuntimeError as err:  # DistNetworkError: the connection closed
                self.told = True
                raise StageAborted(f"the actor ranks' store closed before {self.name}'s links "
                                   f"opened: actor rank 0 ended (its log says why)") from err
            if why is not None:
                self.told = True
                raise StageAborted(f"{why}; {self.name} stops too")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: the other end of its link was not ready "
                                   f"within {timeout}")
            time.sleep(0.1)

    def abort(self, connect_s: float = 10.0) -> None:
        """Say in the store that this process ends before its links opened, so that the
        processes waiting for it in ``open_links`` stop at once; for the end of a process
        (``atexit``), a no-op once its links opened or when it learnt of another's abort.
        Actor rank 0 hosts the store: it keeps it up until the scorer rank has read why, at
        most ``ABORT_GRACE_S``. Never raises."""
        host = self.rank == 0 and not self.is_scorer
        if self.linked or (self.told and not host):
            return
        if host and not (dist.is_available() and dist.is_initialized()):
            return  # it ended before its store existed: the scorer rank's connect times out
        try:
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                  is_master=False, timeout=timedelta(seconds=connect_s))
            other = "its links to the actor ranks" if self.is_scorer else \
                f"its link to the scorer rank (rank {self.scorer_rank})"
            # the first to end names itself
            store.compare_set(_ABORT, "", f"{self.name} ended before {other} opened (its log "
                                          f"says why)")
            if self.is_scorer:
                store.set(_ABORT_SEEN, "1")
            deadline = time.monotonic() + ABORT_GRACE_S
            while host and not store.check([_ABORT_SEEN]) and time.monotonic() < deadline:
                time.sleep(0.1)
        except Exception:  # at exit, with nothing left to do about it
            pass


# what gloo's RuntimeError says when the process at the other end of a connection is gone, or
# did not answer within the group's timeout
_CONNECTION_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                    "Timed out waiting")


def link_failure(err: BaseException) -> bool:
    """Whether ``err`` is what torch.distributed raises when the other end of a link, or of
    a collective, is gone or silent: gloo's plain ``RuntimeError`` saying the connection
    closed or a wait timed out, a ``DistError`` (NCCL's), a ``TimeoutError``. Any other
    ``RuntimeError`` (a tensor op's, say) is this process's own failure, as are errors of
    oppo-ds's own types (a non-finite loss every actor rank stops on alike, a reward
    function's)."""
    if isinstance(err, (dist.DistError, TimeoutError)):
        return True
    return type(err) is RuntimeError and any(text in str(err) for text in _CONNECTION_LOST)
