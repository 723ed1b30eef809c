"""Exposed collective wait: timing of the torch.distributed collectives the loop issues.

While a monitor is attached, the functions below are replaced in ``torch.distributed`` by
thin wrappers (restored by ``restore``). A wrapper costs one flag check on a step where
the comm metrics are not due. On a step where they are, it counts the call and its input
bytes and times the *exposed* wait (001 §5):

* CPU tensors (gloo): wall time of a synchronous call, or of ``Work.wait()`` for
  ``async_op=True`` (the returned work object is proxied; everything else passes through).
* CUDA tensors (NCCL): a pair of timing events on the current stream around the call (or
  around ``wait()``), so the measured time is how long the compute stream was held; the
  events are read later by the emitter thread, never on the training thread.

Only calls made through ``torch.distributed.<name>`` after attach are seen: code that
imported the function object earlier, and collectives issued inside C++ (DDP's bucketed
gradient all-reduce, FSDP's internal gathers), are not wrapped: the loop times those
itself (a DDP comm hook) and reports them with ``StepContext.comm_wait(op, seconds)``,
which adds to the wrappers' wait of the same op name.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch

from ..catalog import Comm, Label, tier_of
from ..collect import Late
from ..state import StepState
from ..wire import Point

__all__ = ["COLLECTIVES", "CommTimer"]

TIER = tier_of(Comm.WAIT, Comm.CALLS, Comm.BYTES)

COLLECTIVES: tuple[str, ...] = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "gather",
    "scatter",
)


def _nbytes(args: tuple, kwargs: dict) -> int:
    first = args[0] if args else next(iter(kwargs.values()), None)
    if isinstance(first, torch.Tensor):
        return first.numel() * first.element_size()
    if isinstance(first, (list, tuple)):
        return sum(t.numel() * t.element_size() for t in first if isinstance(t, torch.Tensor))
    return 0


def _on_cuda(args: tuple) -> bool:
    first = args[0] if args else None
    if isinstance(first, (list, tuple)):
        first = first[0] if first else None
    return isinstance(first, torch.Tensor) and first.is_cuda


class _TimedWork:
    """Proxy of an async ``Work``: ``wait`` is timed, every other attribute passes through."""

    def __init__(self, work: Any, timer: CommTimer, op: str, cuda: bool) -> None:
        self._work, self._timer, self._op, self._cuda = work, timer, op, cuda

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        start = self._timer._begin(self._cuda)
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._timer._finish(self._op, start, self._cuda)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class CommTimer:
    """Wraps ``torch.distributed`` collectives and keeps one step's per-op totals."""

    def __init__(self) -> None:
        self.active = False  # set on steps where the comm metrics are due
        self._originals: dict[str, Callable] = {}
        self._wrappers: dict[str, Callable] = {}
        self._totals: dict[str, list[float]] = {}  # op -> [wait_s, calls, bytes]
        self._events: list[tuple[str, Any, Any]] = []

    def install(self) -> None:
        import torch.distributed as dist

        if self._originals or not dist.is_available():
            return
        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if original is not None:
                self._originals[name] = original
                self._wrappers[name] = self._wrap(name, original)
                setattr(dist, name, self._wrappers[name])

    def restore(self) -> None:
        import torch.distributed as dist

        self.active = False
        for name, original in self._originals.items():
            if getattr(dist, name, None) is self._wrappers[name]:
                setattr(dist, name, original)
            # else a later wrapper sits on top of ours: ours stays as an inert pass-through
        self._originals.clear()
        self._wrappers.clear()

    def _wrap(self, op: str, original: Callable) -> Callable:
        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return original(*args, **kwargs)
            cuda = _on_cuda(args)
            totals = self._totals.setdefault(op, [0.0, 0.0, 0.0])
            totals[1] += 1
            totals[2] += _nbytes(args, kwargs)
            if kwargs.get("async_op"):
                work = original(*args, **kwargs)
                return None if work is None else _TimedWork(work, self, op, cuda)
            start = self._begin(cuda)
            try:
                return original(*args, **kwargs)
            finally:
                self._finish(op, start, cuda)

        wrapper.__probewire_original__ = original  # type: ignore[attr-defined]
        return wrapper

    def _begin(self, cuda: bool) -> Any:
        if cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _finish(self, op: str, start: Any, cuda: bool) -> None:
        if cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((op, start, end))
        else:
            self._totals.setdefault(op, [0.0, 0.0, 0.0])[0] += time.perf_counter() - start

    def open(self, state: StepState) -> None:
        self.active = state.due[TIER]

    def close(self, state: StepState, late: list[Late]) -> None:
        """Hand this step's totals and the loop's own waits (``state.comm_waits``) to a
        late sampler that runs on the emitter thread (it reads CUDA events there); reset."""
        self.active = False
        if not state.due[TIER]:
            return
        totals, events = self._totals, self._events
        self._totals, self._events = {}, []
        reported = state.comm_waits

        def points() -> list[Point]:
            for op, start, end in events:  # CUDA: read the events off the training thread
                end.synchronize()
                totals.setdefault(op, [0.0, 0.0, 0.0])[0] += start.elapsed_time(end) / 1000.0
            out: list[Point] = []
            for op, (wait, calls, nbytes) in sorted(totals.items()):
                labels = ((Label.OP, op),)
                out += [
                    Point(Comm.WAIT, wait + reported.get(op, 0.0), labels),
                    Point(Comm.CALLS, calls, labels),
                    Point(Comm.BYTES, nbytes, labels),
                ]
            out += [
                Point(Comm.WAIT, wait, ((Label.OP, op),))
                for op, wait in sorted(reported.items())
                if op not in totals
            ]
            return out

        late.append(points)
