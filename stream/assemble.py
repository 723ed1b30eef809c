"""Stage 1: gather per-rank messages of one (run, step) and reduce them across ranks.

A step is complete when every rank of the world is accounted for (it reported, or its
message was refused: a dead letter, ``refused``) or when its deadline passes, whichever is
first. Nothing else closes a step: the order in which steps arrive says nothing about a
rank still to come (a rank's messages can reach a partition out of order, and Tansu can
make a later offset readable first), so a later step completing never reduces an earlier
one without a rank that is still within its deadline. At a rebalance the worker drops
every pending step (``drop_pending``): their messages are unacknowledged, and the consumer
reads each assigned partition again from the group's committed offset (Faust seeks there
after every assignment), here or at the partition's new owner. Kept and reduced at the
deadline instead, a step of a partition that moved reached stage 2 twice, the copy here
without the ranks its new owner read after the rebalance.
A complete step is reduced by ``reduce.reduce_step`` (the catalog's rules).

A message marked replay (``RankStep.replay``: a rank's ring buffer sent on a dump, the
scan-tier detail of a step whose other points were sent at the time) gathers apart from
the step's own messages, by the same rules (every rank, or the deadline), and is reduced
into a step with ``complete_reason = CompleteReason.REPLAY``: detail of a step that may be long
complete. Each rank's replay of a step is counted once.

A step of more ranks than ``block_ranks`` gathers by rank block (rank // block_ranks) with
the same rules per block (its ranks, or the deadline): a complete block leaves as a
``partial.Partial`` (mergeable, exactly), and ``fanin.MergeAssembler`` merges a step's
blocks, reduced by any number of workers, into the step ``reduce_step`` would have made.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from probewire.instrument.wire import RankStep

from .partial import Partial, partial_of
from .records import CompleteReason, ReducedStep
from .reduce import reduce_step

__all__ = ["AddResult", "BlockDone", "StepAssembler"]


@dataclass(slots=True)
class _Pending:
    world_size: int
    first_seen: float
    partition: int
    expected: int  # ranks to account for: the world's, or its rank block's
    records: dict[int, RankStep] = field(default_factory=dict)
    refused: set[int] = field(default_factory=set)  # ranks whose message was dead-lettered

    def complete(self) -> bool:
        if not self.refused:  # the usual step: no set built per message
            return len(self.records) >= self.expected
        return len(self.records) + len(self.refused - self.records.keys()) >= self.expected


@dataclass(frozen=True, slots=True)
class BlockDone:
    """A rank block of a step, reduced: its partial state, whether every rank of the block
    was accounted for (else its deadline passed), and its ranks' values as a detail part
    (``CompleteReason.DETAIL``: the look-back tables' per-rank rows)."""

    partial: Partial
    complete: bool
    detail: ReducedStep

    @property
    def run_id(self) -> str:
        return self.partial.run_id

    @property
    def step(self) -> int:
        return self.partial.step


@dataclass(slots=True, kw_only=True)
class AddResult:
    completed: list[ReducedStep | BlockDone]
    late: RankStep | None = None  # arrived after its step was emitted
    duplicate: bool = False  # re-delivery of a message already counted


class StepAssembler:
    """Pending steps keyed by (run, step); remembers recently emitted steps to spot late data."""

    def __init__(
        self,
        deadline_s: float,
        remember_steps: int = 100_000,
        detail: bool = False,
        block_ranks: int = 0,
        per_rank_names: frozenset[str] = frozenset(),
    ) -> None:
        """``detail``: the assembler of the detail topic, whose steps leave as
        ``CompleteReason.SCAN`` (replays as ``REPLAY``). ``block_ranks`` > 0: a step of
        more ranks gathers by rank block (the module docstring); ``per_rank_names`` are the
        metrics whose per-rank values a block's partial carries."""
        if deadline_s <= 0:
            raise ValueError("deadline_s must be > 0")
        self.deadline_s = deadline_s
        self.detail = detail
        self.block_ranks = block_ranks
        self.per_rank_names = per_rank_names
        # keys (run, step) of the steps' own messages, (run, step, "replay") of replays
        self._pending: dict[tuple, _Pending] = {}
        self._done: OrderedDict[tuple, frozenset[int]] = OrderedDict()
        self._refused: OrderedDict[tuple, set[int]] = OrderedDict()  # before their step
        self._remember = remember_steps

    @property
    def pending(self) -> int:
        return len(self._pending)

    def key(self, record: RankStep) -> tuple:
        """(run, step), or (run, step, "block", b) for a step gathered by rank block."""
        if self.block_ranks and record.world_size > self.block_ranks and not self.detail:
            return (record.run_id, record.step, "block", record.rank // self.block_ranks)
        return (record.run_id, record.step)

    def _expected(self, key: tuple, world_size: int) -> int:
        if len(key) == 4:
            return min(self.block_ranks, world_size - key[3] * self.block_ranks)
        return world_size

    def add(self, record: RankStep, now: float, partition: int = 0) -> AddResult:
        if record.replay:
            return self._add_replay(record, now, partition)
        key = self.key(record)
        done = self._done.get(key)
        if done is not None:
            if record.rank in done:
                return AddResult(completed=[], duplicate=True)
            return AddResult(completed=[], late=record)
        pending = self._pending.get(key)
        if pending is None:
            expected = self._expected(key, record.world_size)
            pending = self._pending[key] = _Pending(record.world_size, now, partition, expected)
            pending.refused = self._refused.pop(key, pending.refused)
        if record.rank in pending.records:
            return AddResult(completed=[], duplicate=True)
        pending.records[record.rank] = record
        if not pending.complete():
            return AddResult(completed=[])
        return AddResult(completed=[self._emit(key, CompleteReason.ALL_RANKS)])

    def refused(self, record: RankStep) -> list[ReducedStep | BlockDone]:
        """``record``'s message was refused (a dead letter): its step does not wait for that
        rank (it is reduced without it, ``ranks_missing`` names it). A refusal never starts
        a step: before the step's first accepted message it is remembered (the newest
        ``remember_steps`` refused steps). A rank outside the step's world, a replay, or a
        step already reduced changes nothing."""
        key = self.key(record)
        if record.replay or key in self._done or not 0 <= record.rank < record.world_size:
            return []
        pending = self._pending.get(key)
        if pending is None:
            self._refused.setdefault(key, set()).add(record.rank)
            while len(self._refused) > self._remember:
                self._refused.popitem(last=False)
            return []
        if record.rank >= pending.world_size:
            return []
        pending.refused.add(record.rank)
        return [self._emit(key, CompleteReason.ALL_RANKS)] if pending.complete() else []

    def drop_pending(self) -> list[tuple]:
        """Forget every pending step (a rebalance: their messages are read again, by this
        worker or a partition's new owner); their keys."""
        dropped = list(self._pending)
        self._pending.clear()
        return dropped

    def _add_replay(self, record: RankStep, now: float, partition: int) -> AddResult:
        key = (record.run_id, record.step, CompleteReason.REPLAY)
        done = self._done.get(key)
        pending = (
            None
            if done is not None
            else self._pending.setdefault(
                key, _Pending(record.world_size, now, partition, record.world_size)
            )
        )
        if pending is None or record.rank in pending.records:
            return AddResult(completed=[], duplicate=True)  # this rank's replay is counted
        pending.records[record.rank] = record
        if len(pending.records) < pending.world_size:
            return AddResult(completed=[])
        return AddResult(completed=[self._emit(key, CompleteReason.REPLAY)])

    def expire(self, now: float) -> list[ReducedStep | BlockDone]:
        """Emit every pending step whose deadline has passed, in (run, step) order."""
        due = sorted(
            (k for k, p in self._pending.items() if now - p.first_seen >= self.deadline_s),
            key=lambda k: k[:2],
        )
        return [self._emit(k, CompleteReason.DEADLINE) for k in due]

    def flush(self) -> list[ReducedStep | BlockDone]:
        """Emit everything pending (shutdown)."""
        return [
            self._emit(k, CompleteReason.DEADLINE)
            for k in sorted(self._pending, key=lambda k: k[:2])
        ]

    def _emit(self, key: tuple, reason: CompleteReason) -> ReducedStep | BlockDone:
        pending = self._pending.pop(key)
        if len(key) == 3:
            reason = CompleteReason.REPLAY
        elif self.detail:
            reason = CompleteReason.SCAN
        self._done[key] = frozenset(pending.records)
        while len(self._done) > self._remember:
            self._done.popitem(last=False)
        if len(key) == 4:
            records = sorted(pending.records.values(), key=lambda r: r.rank)
            partial = partial_of(
                key[0], key[1], pending.world_size, key[3], records, self.per_rank_names
            )
            detail = ReducedStep(
                run_id=key[0],
                step=key[1],
                world_size=pending.world_size,
                ranks_reporting=[r.rank for r in records],
                ranks_missing=[],
                reduced={},
                per_rank={r.rank: r.values for r in records},
                hosts={r.rank: r.host for r in records},
                complete_reason=CompleteReason.DETAIL,
            )
            return BlockDone(partial, reason == CompleteReason.ALL_RANKS, detail)
        return reduce_step(
            key[0], key[1], pending.world_size, list(pending.records.values()), reason
        )
