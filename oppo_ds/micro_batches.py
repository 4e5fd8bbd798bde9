"""Micro-batches sized by tokens (``ppo.micro_batch_tokens``; OpenRLHF's ``--use_dynamic_batch``
with ``--train_max_tokens_per_gpu``, verl's ``ppo_max_token_len_per_gpu``), and the no-grad
forwards that score the experience by the same rule (``ppo.score_batch_tokens``, OpenRLHF's
``--rollout_max_tokens_per_gpu``; ``scoring.Scoring._score_split``).

A fixed number of sequences per forward/backward (``ppo.micro_batch_size``) has to be sized
for the longest responses a run can give, so most micro-batches of a long-tailed length
distribution run far below the memory they could use, and the rare long ones decide the
setting. Here a mini-batch is split instead into micro-batches whose forward computes at most
a budget of token positions, padding included: many short sequences go together, a long one
goes with few.

What a micro-batch costs is what its forward computes (``forward_tokens``): its rows as wide as
their longest prompt plus their longest response (the update trims each micro-batch to its own
widths, ``Experience.trimmed``), or, with ``system.packing_samples``, the packed rows
``experience.packed_inputs`` builds, each as wide as the longest sequence. The split
(``MicroBatches.by_tokens``) sorts a rank's rows longest first and fills each micro-batch while its
cost stays within the budget; every data-parallel rank then makes as many micro-batches as the
rank that needs most (ZeRO's gradient collectives run once per backward: the ranks' counts must
match), a rank with fewer splitting its largest ones in two. Under PPO-ptx each sequence brings
a pretraining block into its micro-batch's backward, so each row counts a block's length more.
The number of micro-batches does not change the update: the losses are normalised over the
whole mini-batch (``algo.loss_normalizer``) and the engines divide each by their configured
accumulation steps whatever their number.
"""
from __future__ import annotations

from typing import Callable, Optional


def collective_scorers(zero_stage: int, world: int, partition_reference: bool) -> tuple[str, ...]:
    """The models whose scoring forwards are collectives, so that every data-parallel rank
    must make as many (``MicroBatches.at_least``, the calls past its rows on filler): under
    ZeRO-3 on more than one rank the actor, the critic and a partitioned reference (each
    forward gathers the partitioned weights)."""
    if zero_stage != 3 or world < 2:
        return ()
    return ("actor", "critic") + (("reference",) if partition_reference else ())


def fixed_rows(n: int, size: int) -> list[list[int]]:
    """Rows ``0..n-1`` in micro-batches of ``size`` in order (``ppo.micro_batch_size``'s rule),
    the last one shorter where ``size`` does not divide ``n``."""
    return [list(range(i, min(i + size, n))) for i in range(0, n, size)]


def first_fit_rows(lengths: list[int], width: int) -> list[list[int]]:
    """The indices of ``lengths`` in packed rows of ``width``: longest first, each into the first
    row with room for it (``experience.packed_inputs``'s rule). Every length must be at most
    ``width``."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fit = next((r for r, left in enumerate(room) if left >= lengths[i]), None)
        if fit is None:
            rows.append([])
            room.append(width)
            fit = len(rows) - 1
        rows[fit].append(i)
        room[fit] -= lengths[i]
    return rows


def forward_tokens(prompt_lens: list[int], response_lens: list[int], packed: bool) -> int:
    """Token positions one forward of these sequences computes, padding included: rows x (the
    longest prompt + the longest response), or with ``packed`` the packed rows x the longest
    sequence. 0 for no sequence."""
    if not prompt_lens:
        return 0
    if not packed:
        return len(prompt_lens) * (max(prompt_lens) + max(response_lens))
    lengths = [p + r for p, r in zip(prompt_lens, response_lens)]
    return len(first_fit_rows(lengths, max(lengths))) * max(lengths)


class _Filling:
    """The micro-batch being filled, rows added longest first, with the cost of one more row
    in O(packed rows): its widest prompt and response, or, packed, the room left in each packed
    row (``first_fit_rows`` places rows longest first, so a row added last lands where it
    would in a first fit of the whole micro-batch; the width is the first row's length)."""

    def __init__(self, i: int, prompt: int, response: int, packed: bool, extra: int):
        self.rows, self.packed, self.extra = [i], packed, extra
        self.prompt, self.response = prompt, response
        self.width = prompt + response
        self.room = [0]  # the first row fills its packed row

    def placed(self, prompt: int, response: int) -> tuple[int | None, int]:
        """The packed row one more sequence would go into (None: a new one, or not packed) and
        the micro-batch's cost (``MicroBatches.by_tokens``'s) with it."""
        n = len(self.rows) + 1
        if not self.packed:
            width = max(self.prompt, prompt) + max(self.response, response)
            return None, n * width + self.extra * n
        length = prompt + response
        fit = next((r for r, left in enumerate(self.room) if left >= length), None)
        return fit, (len(self.room) + (fit is None)) * self.width + self.extra * n

    def add(self, i: int, prompt: int, response: int, fit: int | None) -> None:
        """Row ``i`` in, into packed row ``fit`` (``placed``'s)."""
        self.rows.append(i)
        self.prompt, self.response = max(self.prompt, prompt), max(self.response, response)
        if self.packed:
            if fit is None:
                self.room.append(self.width)
                fit = len(self.room) - 1
            self.room[fit] -= prompt + response


class MicroBatches:
    """A mini-batch's rows (indices) in micro-batches: ``groups``, the fewest its rule makes,
    and ``at_least(count)``, the same rows in as many micro-batches as a data-parallel rank
    that needs more (ZeRO's collectives run once per forward or backward, so the ranks'
    counts must match). A split by tokens (``by_tokens``) is split further, its micro-batch of
    highest cost in two (its longer and shorter halves) until there are that many, at most
    one a row; fixed rows (``fixed``) are not, and the calls past them are the caller's (the
    scorer's filler)."""

    def __init__(self, groups: list[list[int]], cost: Optional[Callable[[list[int]], int]] = None):
        self.groups, self._cost = groups, cost

    @classmethod
    def fixed(cls, n: int, size: int) -> "MicroBatches":
        """``fixed_rows(n, size)`` (``ppo.micro_batch_size``)."""
        return cls(fixed_rows(n, size))

    @classmethod
    def by_tokens(cls, prompt_lens: list[int], response_lens: list[int], budget: int,
                  packed: bool, extra_per_row: int = 0) -> "MicroBatches":
        """Micro-batches whose ``forward_tokens``, plus ``extra_per_row`` positions for each
        row (a PPO-ptx block that goes with it), stay within ``budget``, longest rows first,
        each filled while its cost stays within the budget (a row over the budget alone makes
        a micro-batch of its own); no micro-batch for no rows."""
        if budget < 1:
            raise ValueError(f"MicroBatches.by_tokens: budget must be >= 1, got {budget}")
        order = sorted(range(len(prompt_lens)),
                       key=lambda i: (-(prompt_lens[i] + response_lens[i]), i))
        filling: list[_Filling] = []
        for i in order:
            p, r = prompt_lens[i], response_lens[i]
            fit, cost_with = filling[-1].placed(p, r) if filling else (None, budget + 1)
            if cost_with <= budget:
                filling[-1].add(i, p, r, fit)
            else:
                filling.append(_Filling(i, p, r, packed, extra_per_row))

        def cost(rows: list[int]) -> int:
            return forward_tokens([prompt_lens[i] for i in rows], [response_lens[i] for i in rows],
                                  packed) + extra_per_row * len(rows)
        return cls([f.rows for f in filling], cost)

    def at_least(self, count: Optional[int]) -> list[list[int]]:
        """The rows in ``count`` micro-batches where that is more than ``groups`` (at most one
        a row), else ``groups``; fixed rows are always ``groups``. The lists are ``groups``'s
        own where not split: read them, do not change them."""
        if self._cost is None or count is None or count <= len(self.groups):
            return self.groups
        rows = sum(len(g) for g in self.groups)
        groups = list(self.groups)
        while len(groups) < min(count, rows):
            g = max((g for g in range(len(groups)) if len(groups[g]) > 1),
                    key=lambda g: self._cost(groups[g]))
            split = groups.pop(g)
            groups[g:g] = [split[:len(split) // 2], split[len(split) // 2:]]
        return groups


def split_by_tokens(prompt_lens: list[int], response_lens: list[int], budget: int,
                    packed: bool, count: int | None = None,
                    extra_per_row: int = 0) -> list[list[int]]:
    """The rows (indices) of a mini-batch in micro-batches within ``budget`` token positions
    (``MicroBatches.by_tokens``): the fewest, or exactly ``count`` (at least the fewest, at
    most the rows; ``MicroBatches.at_least``)."""
    n = len(prompt_lens)
    if n == 0:
        raise ValueError("split_by_tokens: no rows")
    split = MicroBatches.by_tokens(prompt_lens, response_lens, budget, packed, extra_per_row)
    if count is None:
        return split.groups
    if not len(split.groups) <= count <= n:
        raise ValueError(f"split_by_tokens: count must be between the fewest micro-batches "
                         f"({len(split.groups)}) and the rows ({n}), got {count}")
    return split.at_least(count)
