"""A step's fan-in spread over workers: the rank blocks' partial states merged into the step.

A step of more ranks than ``stream.block_ranks`` (B) reaches stage 1 keyed by rank block
(``wire.message_key``: ``<run>:<step>:<rank // B>``), so its blocks land in different
partitions and any number of stage-1 workers gather them. A worker reduces a complete
block (its ranks, or its deadline) into a ``partial.Partial`` and publishes it on the
partials topic, keyed ``<run>:<step>``, with the block's per-rank detail as a detail part
on the steps topic. ``MergeAssembler`` gathers a step's partials (every block, or its
deadline, ``merge_after_s`` past the blocks' own) and merges them: the step that one
worker reducing every rank message would have made, bit for bit (``partial.merge``).

Wire form of a partial message: one byte (1: every rank of the block was accounted for,
0: its deadline passed) and the partial's bytes.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

from .partial import Partial, merge
from .records import CompleteReason, RecordError, ReducedStep

__all__ = ["MergeAssembler", "decode_block", "encode_block"]


def encode_block(partial: Partial, complete: bool) -> bytes:
    return (b"\x01" if complete else b"\x00") + partial.to_bytes()


def decode_block(payload: bytes | None) -> tuple[Partial, bool]:
    """(the partial, whether its block was complete); a RecordError for other bytes."""
    if not payload or payload[:1] not in (b"\x00", b"\x01"):
        raise RecordError("not a partial step: no completeness byte")
    return Partial.from_bytes(payload[1:]), payload[:1] == b"\x01"


@dataclass(slots=True)
class _Merging:
    blocks: int
    first_seen: float
    parts: dict[int, Partial] = field(default_factory=dict)
    complete: bool = True  # every block so far had all its ranks


class MergeAssembler:
    """Pending steps' partials keyed by (run, step); remembers merged steps (late blocks)."""

    def __init__(
        self,
        deadline_s: float,
        block_ranks: int,
        per_rank_names: frozenset[str],
        remember_steps: int = 100_000,
    ) -> None:
        self.deadline_s = deadline_s
        self.block_ranks = block_ranks
        self.per_rank_names = per_rank_names
        self._pending: dict[tuple[str, int], _Merging] = {}
        self._done: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._remember = remember_steps

    @property
    def pending(self) -> int:
        return len(self._pending)

    def add(self, partial: Partial, complete: bool, now: float) -> tuple[list[ReducedStep], bool]:
        """(the step this block completes, if any; whether the block came too late or
        twice: its step was merged or the block is already here)."""
        key = (partial.run_id, partial.step)
        if key in self._done:
            return [], True
        merging = self._pending.get(key)
        if merging is None:
            blocks = math.ceil(partial.world_size / self.block_ranks)
            merging = self._pending[key] = _Merging(blocks, now)
        if partial.block in merging.parts:
            return [], True
        merging.parts[partial.block] = partial
        merging.complete &= complete
        if len(merging.parts) < merging.blocks:
            return [], False
        return [self._emit(key)], False

    def expire(self, now: float) -> list[ReducedStep]:
        """Merge every pending step whose deadline passed (blocks missing: their ranks are
        ``ranks_missing``), in (run, step) order."""
        due = sorted(k for k, m in self._pending.items() if now - m.first_seen >= self.deadline_s)
        return [self._emit(k) for k in due]

    def drop_pending(self) -> list[tuple[str, int]]:
        """Forget every pending step (a rebalance: its partials are read again)."""
        dropped = list(self._pending)
        self._pending.clear()
        return dropped

    def _emit(self, key: tuple[str, int]) -> ReducedStep:
        merging = self._pending.pop(key)
        self._done[key] = None
        while len(self._done) > self._remember:
            self._done.popitem(last=False)
        whole = merging.complete and len(merging.parts) == merging.blocks
        reason = CompleteReason.ALL_RANKS if whole else CompleteReason.DEADLINE
        return merge(list(merging.parts.values()), reason, self.per_rank_names)
