"""The rollout pool: OPPO's inter-step overlap (overcommitment).

A sequential PPO step decodes B prompts and waits for the longest. The pool instead holds
B + Delta sequences; a step decodes them all, keeps the first B that finish as its experience,
and *defers* the rest: they keep every token generated so far and continue in the next step,
after new prompts have topped the pool back up to B + Delta. Nothing is thrown away.

What a deferred sequence carries (``PoolEntry``): its prompt, its response tokens so far, the
behaviour log-prob of each token and the policy version (training step) that sampled it, and
how many times it was deferred. The actor's KV cache is not carried: the update makes it
stale, and the next step rebuilds it with one prefill of prompt + partial response
(``generate.start_decode(prefix_ids=...)``). The frozen scorers' caches stay valid and are
carried by the streaming scorers themselves; the critic's are rebuilt like the actor's.

Rules (see docs/inter-step-overlap.md):
  * first B: the B entries that finished first (earlier steps' finished-but-not-taken entries
    before this step's, then this step's in the order they ended); an entry deferred
    ``max_defer_steps`` times is *forced*: the step does not stop before it ends, and it is
    taken before the others.
  * whole prompts (``group_size`` > 1, for a critic-free estimator's group baseline): a
    prompt's responses are drawn, stopped on and taken together; a prompt has finished when
    all of them have.
  * data parallel: each rank has its own pool and takes its own B; decoding stops for all
    ranks together, once every rank has its B (``BatchStop``), so a rank that is done early
    goes on decoding its deferred sequences instead of idling at the first collective.
  * the ledger counts every prompt drawn, trained on and still in flight, so that a run can
    prove that none was lost or trained twice.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .. import comm
from ..config import FROZEN_KINDS
from .generate import DecodeState, Generation, target_lengths


@dataclass
class PoolEntry:
    """One sequence of the pool, from its prompt to the step that trains on it."""
    uid: int                  # unique per rank over the run (also the streaming scorers' row id)
    key: str                  # the prompt's dataset id
    prompt: list[int]         # prompt token ids
    tokens: list[int] = field(default_factory=list)        # response so far
    logprobs: list[float] = field(default_factory=list)    # behaviour log-prob of each token
    versions: list[int] = field(default_factory=list)      # policy version that sampled each
    finished: bool = False
    deferrals: int = 0        # steps that ended with this entry unfinished or not taken
    finished_at: Optional[tuple[int, int]] = None  # (step, order within the step)
    # what streaming scorers returned when it finished, by kind; only the frozen scorers'
    # survive a deferral (the critic trains, so its values are recomputed)
    results: dict = field(default_factory=dict)
    target: Optional[int] = None  # length oracle: the response ends after this many tokens
    group: Optional[int] = None   # the responses to one draw of a prompt share it (group_size > 1)

    def deadline(self, max_defer_steps: int) -> int:
        """The step, counting the one under way (or, between steps, the next) as 1, in which
        this entry is forced: deferred ``max_defer_steps`` times, it is trained first there
        and the step does not stop before it ends."""
        return max(1, max_defer_steps - self.deferrals + 1)

    def forced(self, max_defer_steps: int) -> bool:
        return self.deadline(max_defer_steps) == 1


class PromptLedger:
    """Counts, per prompt id, how often it was drawn into the pool, trained on, and dropped
    by the configured rule (``ppo.filter_groups``: a group whose responses all scored the
    same). At any moment ``drawn == trained + dropped + in flight`` for every id; a mismatch
    is a lost or duplicated sequence (``check``)."""

    def __init__(self):
        self.drawn: Counter = Counter()
        self.trained: Counter = Counter()
        self.dropped: Counter = Counter()

    def drop(self, keys: Sequence[str]) -> None:
        """Taken rows of ``keys`` that the step did not train on after all: dropped."""
        for k in keys:
            self.trained[k] -= 1
            self.dropped[k] += 1

    def check(self, in_flight: Sequence[str]) -> None:
        pending = Counter(in_flight)
        ids = set(self.drawn) | set(self.trained) | set(self.dropped) | set(pending)
        bad = {k: (self.drawn[k], self.trained[k], self.dropped[k], pending[k]) for k in ids
               if self.drawn[k] != self.trained[k] + self.dropped[k] + pending[k]
               or self.trained[k] < 0}
        if bad:
            detail = ", ".join(f"{k}: drawn {d}, trained {t}, dropped {x}, in flight {p}"
                               for k, (d, t, x, p) in sorted(bad.items())[:5])
            raise AssertionError(f"prompt ledger out of balance for {len(bad)} id(s): {detail}")

    def state_dict(self) -> dict:
        return {"drawn": dict(self.drawn), "trained": dict(self.trained),
                "dropped": dict(self.dropped)}

    def load_state_dict(self, state: dict) -> None:
        self.drawn, self.trained = Counter(state["drawn"]), Counter(state["trained"])
        self.dropped = Counter(state.get("dropped", {}))  # none before ppo.filter_groups


class RolloutPool:
    """``group_size`` > 1: the entries come in groups of that many, the responses to one draw
    of a prompt (added together by ``top_up``), and a step takes whole groups only: a group
    has finished when all its entries have, and the first B / group_size groups to finish
    are the batch (what a group baseline needs: ``ppo.advantage_estimator``)."""

    def __init__(self, batch_size: int, max_defer_steps: int, group_size: int = 1):
        if batch_size % group_size:
            raise ValueError(f"group_size {group_size} must divide batch_size {batch_size}")
        self.batch_size = batch_size
        self.max_defer_steps = max_defer_steps
        self.group_size = group_size
        self.entries: list[PoolEntry] = []  # oldest first
        self.next_uid = 0
        self.ledger = PromptLedger()

    def __len__(self) -> int:
        return len(self.entries)

    def top_up(self, prompts: Sequence, size: int) -> None:
        """Add ``prompts`` (objects with ``id`` and ``input_ids``), which the caller drew as
        ``size - len(self)`` of them."""
        if len(self.entries) + len(prompts) != max(size, len(self.entries)):
            raise ValueError(f"pool of {len(self.entries)} topped up with {len(prompts)} "
                             f"prompts does not reach {size}")
        if len(prompts) % self.group_size:
            raise ValueError(f"{len(prompts)} rows are not whole groups of {self.group_size}")
        first = self.next_uid
        for i, p in enumerate(prompts):
            group = (first + i - (i % self.group_size)) if self.group_size > 1 else None
            self.entries.append(PoolEntry(uid=self.next_uid, key=p.id, prompt=list(p.input_ids),
                                          target=getattr(p, "target_len", None), group=group))
            self.ledger.drawn[p.id] += 1
            self.next_uid += 1

    def needed(self, size: int) -> int:
        """New prompts to draw to reach ``size`` (0 when Delta shrank below what is carried)."""
        return max(0, size - len(self.entries))

    def running(self) -> list[PoolEntry]:
        return [e for e in self.entries if not e.finished]

    def waiting(self) -> list[PoolEntry]:
        """Entries that finished in an earlier step but were not taken yet."""
        return [e for e in self.entries if e.finished]

    def decode_inputs(self, entries: Sequence[PoolEntry], pad_id: int, device) -> dict:
        """``start_decode`` arguments continuing ``entries``: left-padded prompts, and their
        responses so far as right-padded prefixes with behaviour log-probs."""
        prompt_ids, prompt_mask = left_pad([e.prompt for e in entries], pad_id)
        prefix, logprobs, lengths = _responses(entries, pad_id, min_width=0)
        return dict(prompt_ids=prompt_ids.to(device), prompt_mask=prompt_mask.to(device),
                    prefix_ids=prefix.to(device), prefix_lengths=lengths.to(device),
                    prefix_logprobs=logprobs.to(device),
                    targets=target_lengths([e.target for e in entries]))  # start_decode moves it

    def absorb(self, entries: Sequence[PoolEntry], state: DecodeState, version: int,
               step: int) -> None:
        """Write a rollout's results back: row i of ``state`` continued ``entries[i]``; tokens
        beyond what an entry held were sampled by policy ``version`` at ``step``."""
        lengths = state.lengths.tolist()
        tokens, logprobs = state.tokens.cpu(), state.logprobs.cpu()
        for i, (e, n) in enumerate(zip(entries, lengths)):
            old = len(e.tokens)
            e.tokens.extend(tokens[i, old:n].tolist())
            e.logprobs.extend(logprobs[i, old:n].tolist())
            e.versions.extend([version] * (n - old))
        for order, row in enumerate(state.finish_order):
            entries[row].finished = True
            entries[row].finished_at = (step, order)

    def take(self, batch: Optional[int] = None, defer: bool = True) -> list[PoolEntry]:
        """Remove and return the step's batch of ``batch`` rows (default B): forced entries
        first, then in finishing order; with ``defer`` every entry left behind is deferred
        once more (``end_step``; a step of several rounds, ``ppo.filter_groups``, defers once,
        after its last)."""
        batch = self.batch_size if batch is None else batch
        if self.group_size > 1:
            taken = self._take_groups(batch)
        else:
            done = [e for e in self.entries if e.finished]
            if len(done) < batch:
                raise RuntimeError(f"the step ended with {len(done)} finished sequences, "
                                   f"fewer than the batch of {batch}")
            done.sort(key=lambda e: (not e.forced(self.max_defer_steps), e.finished_at))
            taken = done[:batch]
        chosen = {e.uid for e in taken}
        self.entries = [e for e in self.entries if e.uid not in chosen]
        if defer:
            self.end_step()
        for e in taken:
            self.ledger.trained[e.key] += 1
        return taken

    def end_step(self) -> None:
        """Every entry still in the pool was deferred once more; the results of the models
        that train (all but ``FROZEN_KINDS``: the critic, the actor) are stale after the
        step's update."""
        for e in self.entries:
            e.deferrals += 1
            e.results = {kind: r for kind, r in e.results.items() if kind in FROZEN_KINDS}

    def put_back(self, entries: Sequence[PoolEntry]) -> None:
        """Return taken ``entries`` (finished, not trained after all: a rank's surplus under
        ``ppo.filter_groups``) to the front of the pool, where the next take finds them
        first (they finished earliest)."""
        for e in entries:
            self.ledger.trained[e.key] -= 1
        self.entries = list(entries) + self.entries

    def groups(self) -> dict[int, list[PoolEntry]]:
        """The entries by group, in the pool's order (group_size > 1)."""
        out: dict[int, list[PoolEntry]] = {}
        for e in self.entries:
            out.setdefault(e.group, []).append(e)
        return out

    def _take_groups(self, batch: int) -> list[PoolEntry]:
        """The batch as whole groups: forced groups first, then by when their last entry
        finished; each group's entries in the order they were drawn."""
        done = [g for g in self.groups().values() if all(e.finished for e in g)]
        need = batch // self.group_size
        if len(done) < need:
            raise RuntimeError(f"the step ended with {len(done)} prompts whose {self.group_size} "
                               f"responses all finished, fewer than the batch's {need}")
        done.sort(key=lambda g: (not g[0].forced(self.max_defer_steps),
                                 max(e.finished_at for e in g)))
        return [e for g in done[:need] for e in g]

    def batch_stop(self, running: Sequence[PoolEntry], sync: bool, group=None,
                   blocks: bool = False, batch: Optional[int] = None) -> "BatchStop":
        """The stop rule of a rollout over ``running`` (this pool's unfinished entries, in
        the rollout's row order): ``batch`` (default B) finished entries, or batch /
        group_size finished groups, and every forced entry ended. ``blocks``: for a decode
        that checks once a block (``generation.sync_every`` > 1)."""
        batch = self.batch_size if batch is None else batch
        forced = [i for i, e in enumerate(running) if e.forced(self.max_defer_steps)]
        waiting = self.waiting()
        if self.group_size == 1:
            return BatchStop(batch, len(waiting), forced, sync=sync, group=group,
                             blocks=blocks)
        labels = sorted({e.group for e in running})
        index = {g: i for i, g in enumerate(labels)}
        before = Counter(e.group for e in waiting)
        complete = sum(1 for g, n in before.items() if g not in index)
        return BatchStop(batch // self.group_size, complete, forced, sync=sync,
                         group=group, row_groups=[index[e.group] for e in running],
                         finished_before=[before[g] for g in labels], group_size=self.group_size,
                         blocks=blocks)

    def check(self) -> None:
        self.ledger.check([e.key for e in self.entries])

    def state_dict(self) -> dict:
        return {"entries": [asdict(e) for e in self.entries], "next_uid": self.next_uid,
                "ledger": self.ledger.state_dict(), "batch_size": self.batch_size,
                "group_size": self.group_size}

    def overdue(self) -> Optional[tuple[int, int]]:
        """None when every entry the pool holds can be trained within ``max_defer_steps``;
        else ``(k, n)``: ``n`` entries must be trained within the next ``k`` steps (1: the
        next), more than ``k`` batches hold. An entry is trained first in the step it is
        forced (``PoolEntry.deadline``, ``take``). A run keeps this by construction (Delta <=
        B, ``FilterRounds._carry_surplus``); a resume with a smaller batch or bound may not."""
        deadlines = [e.deadline(self.max_defer_steps) for e in self.entries]
        for k in sorted(set(deadlines)):
            n = sum(d <= k for d in deadlines)
            if n > k * self.batch_size:
                return k, n
        return None

    def load_state_dict(self, state: dict) -> None:
        entries = []
        for e in state["entries"]:
            e = dict(e)
            if e["finished_at"] is not None:
                e["finished_at"] = tuple(e["finished_at"])
            entries.append(PoolEntry(**e))
        self.entries, self.next_uid = entries, state["next_uid"]
        self.ledger.load_state_dict(state["ledger"])


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    from ..data import left_pad as _left_pad  # data imports tokenizers; keep this module light

    return _left_pad(list(seqs), pad_id)


def _responses(entries: Sequence[PoolEntry], pad_id: int, min_width: int):
    """Responses so far, right-padded: (N, W) tokens, (N, W) behaviour log-probs, (N,) lengths."""
    width = max([min_width] + [len(e.tokens) for e in entries])
    ids = torch.full((len(entries), width), pad_id, dtype=torch.long)
    logprobs = torch.zeros(len(entries), width)
    for i, e in enumerate(entries):
        ids[i, :len(e.tokens)] = torch.tensor(e.tokens, dtype=torch.long)
        logprobs[i, :len(e.tokens)] = torch.tensor(e.logprobs, dtype=torch.float32)
    return ids, logprobs, torch.tensor([len(e.tokens) for e in entries], dtype=torch.long)


def entries_to_generation(entries: Sequence[PoolEntry], pad_id: int, device) -> Generation:
    """The batch of finished entries as the ``Generation`` a sequential step would have made."""
    prompt_ids, prompt_mask = left_pad([e.prompt for e in entries], pad_id)
    ids, logprobs, lengths = _responses(entries, pad_id, min_width=1)
    mask = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).float()
    return Generation(prompt_ids=prompt_ids.to(device), prompt_mask=prompt_mask.to(device),
                      response_ids=ids.to(device), response_mask=mask.to(device),
                      logprobs=logprobs.to(device), lengths=lengths.to(device))


class BatchStop:
    """``decode_steps``'s stop rule for one step of the pool.

    Locally satisfied when at least ``need`` rows finished (``already`` counts entries that
    finished in earlier steps) and every forced row ended. With ``row_groups`` (a group index
    per row, 0..G-1), ``need`` and ``already`` count whole groups of ``group_size`` instead:
    a group is complete once ``finished_before[g]`` (its entries that ended in earlier steps)
    plus its rows ended here reach ``group_size``; ``already`` counts the complete groups
    with no row in this rollout. With ``sync`` (data parallel) the
    answer is the minimum over ranks, one all-reduce per call, so all ranks stop at the same
    token; a rank whose rows all ended keeps calling (``wait``) until the others are done.
    Once True it stays True without further collectives, so every rank makes the same
    number of calls. ``group``: the ranks that decode (default: the world; under the stage
    placement the actor ranks, the scorer rank does not take part).

    ``blocks`` (a decode that checks once every ``sync_every`` tokens, ``_decode_blocks``):
    the rule is evaluated on the device after every token (``local_device``) and settled once
    a block (``resolve``): one all-reduce a block, of the first token at which each rank's
    rule held, and every rank stops at the latest of them, the token at which the per-token
    protocol's minimum would have turned True. Calls with a state (the start, ``wait``) are
    one such collective each, so ranks still pair up."""

    def __init__(self, need: int, already: int, forced_rows: Sequence[int], sync: bool,
                 group=None, row_groups: Optional[Sequence[int]] = None,
                 finished_before: Sequence[int] = (), group_size: int = 1,
                 blocks: bool = False):
        self.need, self.already = need, already
        self.forced = torch.as_tensor(list(forced_rows), dtype=torch.long)
        self.row_groups = None if row_groups is None else torch.as_tensor(list(row_groups),
                                                                          dtype=torch.long)
        self.finished_before = torch.as_tensor(list(finished_before), dtype=torch.long)
        self.group_size = group_size
        self.sync, self.group = sync, group
        self.blocks = blocks
        self.satisfied = False
        self.calls = 0
        self._on_device: dict = {}

    def local(self, state: Optional[DecodeState]) -> bool:
        if state is None:
            return self.already >= self.need and self.forced.numel() == 0
        if state.done:
            return True
        ended = self.already + self._ended(state) >= self.need
        return ended and bool(state.finished[self.forced.to(state.finished.device)].all())

    def _ended(self, state: DecodeState) -> int:
        """Rows (or whole groups, with ``row_groups``) of this rollout that ended."""
        if self.row_groups is None:
            return len(state.finish_order)
        done = self.finished_before.index_add(0, self.row_groups, state.finished.cpu().long())
        return int((done >= self.group_size).sum())

    def local_device(self, finished: torch.Tensor) -> torch.Tensor:
        """``local`` as a 0-d bool tensor on the device, without a host wait, for a state
        whose rows have ``finished`` (B,) so far (a block's rows that ended are still in its
        batch)."""
        device = finished.device
        if device not in self._on_device:
            self._on_device[device] = (
                self.forced.to(device),
                None if self.row_groups is None else self.row_groups.to(device),
                self.finished_before.to(device))
        forced, row_groups, before = self._on_device[device]
        if row_groups is None:
            ended = finished.sum()
        else:
            done = before.index_add(0, row_groups, finished.long())
            ended = (done >= self.group_size).sum()
        ok = (ended + self.already) >= self.need
        if forced.numel():
            ok = ok & finished[forced].all()
        return ok | finished.all()

    def resolve(self, first: Optional[int]) -> Optional[int]:
        """Block protocol: ``first``, the first token of this block at which the rule held
        here (None: not yet); returns the token every rank stops at, or None to go on."""
        if self.satisfied:
            return 0
        if self.sync:
            never = 2 ** 62
            latest = comm.all_reduce_ints([never if first is None else first],
                                          op=dist.ReduceOp.MAX, group=self.group)[0]
            self.calls += 1
            first = None if latest == never else int(latest)
        self.satisfied = first is not None
        return first

    def __call__(self, state: Optional[DecodeState]) -> bool:
        if self.satisfied:
            return True
        if self.blocks:
            return self.resolve(0 if self.local(state) else None) is not None
        ok = self.local(state)
        if self.sync:
            ok = bool(comm.all_reduce_ints([int(ok)], op=dist.ReduceOp.MIN, group=self.group)[0])
            self.calls += 1
        self.satisfied = ok
        return ok

    def wait(self, state: Optional[DecodeState]) -> None:
        """Called by a rank with nothing left to decode: join the other ranks' calls until
        they are all satisfied."""
        while not self(state):
            pass


def staleness_rows(taken: Sequence[PoolEntry], version: int) -> list[list[int]]:
    """Per taken entry: [times deferred, tokens, tokens sampled by an older policy than
    ``version``, versions behind of its oldest token] (gathered over ranks, then
    ``staleness_metrics``)."""
    return [[e.deferrals, len(e.tokens), sum(1 for v in e.versions if v < version),
             version - min(e.versions, default=version)] for e in taken]


def staleness_metrics(rows: Sequence[Sequence[int]]) -> dict:
    """What overcommitment did to a batch: how often its sequences were deferred
    (``pool/deferrals`` is the histogram's data), and the share of its tokens sampled by an
    older policy than the one being trained."""
    deferred = [int(r[0]) for r in rows]
    return {"pool/deferred_frac": sum(1 for d in deferred if d > 0) / len(rows),
            "pool/deferrals_max": max(deferred),
            "pool/deferrals": deferred,
            "pool/stale_token_frac": sum(r[2] for r in rows) / max(sum(r[1] for r in rows), 1),
            "pool/policy_lag_max": max(int(r[3]) for r in rows)}


def pool_stream_setup(running: list, inputs: dict, carried, frozen_kinds: list[str],
                      critic=None, device=None) -> tuple[torch.Tensor, list, list]:
    """The scorers and their setup for a streamed continuation of the pool's running rows
    (``stream_continue``). The frozen scorers (``carried(kind)``, one per kind in
    ``frozen_kinds``) keep their caches from step to step, so only rows they do not hold yet
    are added, with whatever response those rows already have; ``critic`` (a scorer made
    this step: the critic trains) prefills every row's prompt + partial response.

    Returns the rows' uids, the scorers, and the setup list of ``stream_continue``.
    """
    uids = torch.tensor([e.uid for e in running], dtype=torch.long)

    def rows_of(idx: list[int]) -> tuple:
        sub = torch.tensor(idx, dtype=torch.long, device=device)
        prefix = inputs["prefix_ids"][sub]
        has = prefix.shape[1] > 0
        return (uids[idx].tolist(), inputs["prompt_ids"][sub], inputs["prompt_mask"][sub],
                prefix if has else None, inputs["prefix_lengths"][sub] if has else None)

    scorers, setup = [], []
    for kind in frozen_kinds:
        scorer = carried(kind)
        held = set(scorer.rows.tolist())
        new = [i for i, e in enumerate(running) if e.uid not in held]
        scorers.append(scorer)
        if new:
            setup.append((kind, "add", scorer.add, rows_of(new)))
    if critic is not None:
        scorers.append(critic)
        setup.append(("critic", "add", critic.add, rows_of(list(range(len(running))))))
    return uids, scorers, setup
