"""System probes (seeds 001 §5): step time, FLOPs and positions, memory peaks, the spike
guard's counters, and host/device/network telemetry.

The CUDA allocator's peaks are read on the training thread at step exit (host-side reads,
no device synchronisation) before the next step resets them; the process's RSS peak and the
telemetry (psutil, PSI, NVML, network counters) are sampled on the emitter thread, so their
system calls never sit on the training path.

Reset boundary (001 §5, "reset peak counters only at documented boundaries"): the CUDA
peak counters of the current device are reset when the monitor's step context opens, so
``memory.peak_*`` covers exactly one step (data loading, forward, backward, optimizer).
``memory.peak_rss_bytes`` is the kernel's process high-water mark and is never reset.
``memory.capacity`` (``memory_capacity``: the device's total, on CPU the cgroup or system
limit) is read once at attach and sent with every step: the stream forms the headroom
1 - peak / capacity from it.
"""

from __future__ import annotations

import functools
import logging
import os
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..catalog import Device, Grad, Guard, Host, Memory, Net, System, tier_of
from ..collect import Late
from ..state import StepState
from ..wire import Point
from .grads import amp_skipped, clip_threshold

__all__ = [
    "DeviceTelemetry",
    "HostTelemetry",
    "ProcFile",
    "SystemProbe",
    "decode_skipped",
    "default_flops_per_token",
    "memory_capacity",
    "peak_memory_points",
    "peak_rss_points",
    "reset_peaks",
    "statm_rss",
    "transformer_flops_per_token",
]

TIER = tier_of(
    System.STEP_TIME,
    System.FLOPS,
    System.POSITIONS,
    Memory.PEAK_RSS,
    Memory.PEAK_ALLOCATED,
    Memory.PEAK_RESERVED,
    Memory.ALLOCATED,
    Memory.RESERVED,
    Memory.CAPACITY,
    Guard.SKIPPED,
    Guard.REPLAYED,
    Guard.REPLAY_MISMATCH,
    Grad.CLIP_THRESHOLD,
)
TELEMETRY_TIER = tier_of(
    Host.RSS,
    Host.CPU_PERCENT,
    Host.FAULTS_MINOR,
    Host.FAULTS_MAJOR,
    Host.INTERVAL,
    Host.CPU_PRESSURE,
    Net.RX,
    Net.TX,
    Device.UTILIZATION,
    Device.POWER,
    Device.TEMPERATURE,
    Device.CLOCK,
    Device.MEMORY_USED,
)

log = logging.getLogger(__name__)

_RSS_UNIT = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux


def transformer_flops_per_token(n_params: int, n_layer: int, d_model: int, seq_len: int) -> float:
    """Training FLOPs per token of a dense decoder: 6·N + 12·L·d·S (PaLM, Appendix B).

    6·N counts the forward (2N) and backward (4N) multiply-adds of the weight matmuls; the
    second term is attention's QK^T and AV products (L layers, width d = heads × head dim,
    sequence length S). Keep this estimator fixed across compared runs (001 §5).
    """
    return 6.0 * n_params + 12.0 * n_layer * d_model * seq_len


def default_flops_per_token(model: nn.Module, n_params: int) -> float:
    """``model.flops_per_token()`` when the model defines it, else 6·N (no attention term)."""
    inner = getattr(model, "module", model)  # DDP / FSDP1 wrappers
    method = getattr(inner, "flops_per_token", None)
    if callable(method):
        return float(method())
    return 6.0 * n_params


def reset_peaks(device: torch.device | None) -> None:
    """Start a new peak window on ``device`` (a CUDA device; nothing on CPU)."""
    if device is not None:
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_points(device: torch.device | None) -> list[Point]:
    """The CUDA allocator's peaks of the step and its current allocated/reserved bytes
    (host-side reads of the allocator's counters, no device synchronisation)."""
    if device is None:
        return []
    return [
        Point(Memory.PEAK_ALLOCATED, float(torch.cuda.max_memory_allocated(device))),
        Point(Memory.PEAK_RESERVED, float(torch.cuda.max_memory_reserved(device))),
        Point(Memory.ALLOCATED, float(torch.cuda.memory_allocated(device))),
        Point(Memory.RESERVED, float(torch.cuda.memory_reserved(device))),
    ]


_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def _cgroup_limit(paths: tuple[str, ...]) -> float | None:
    """The first memory limit among the cgroup files ``paths`` (v2, then v1); None when
    there is none ("max", absent or unreadable)."""
    for path in paths:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            return float(text)
    return None


def memory_capacity(
    device: torch.device | None, cgroup_files: tuple[str, ...] = _CGROUP_LIMITS
) -> float:
    """memory.capacity: what the rank's peak may reach. A CUDA device: its total bytes
    (``mem_get_info``). CPU: the cgroup limit where one is set, never above the system's
    physical memory (a v1 cgroup without a limit reads as ~2^63)."""
    if device is not None:
        return float(torch.cuda.mem_get_info(device)[1])
    physical = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    limit = _cgroup_limit(cgroup_files)
    return physical if limit is None else min(limit, physical)


def decode_skipped(parts: list[tuple[Any, Any]]) -> list[Point]:
    """guard.skipped: the loop's own skips since the last emitted step (meta) plus 1 when the
    GradScaler skipped this step (the part, ``grads.amp_skipped``)."""
    values, counted = parts[0]
    return [Point(Guard.SKIPPED, counted + float(values[0]))]


def peak_rss_points(usage: resource.struct_rusage | None = None) -> list[Point]:
    """The process's resident high-water mark (``getrusage``, or ``usage`` already read).
    Read on the emitter thread: on a DDP rank the call stalled the training thread 2-4 ms
    right after a step (it walks the process's threads, gloo's included)."""
    if usage is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
    return [Point(Memory.PEAK_RSS, float(usage.ru_maxrss * _RSS_UNIT))]


class ProcFile:
    """A /proc file read again and again through one descriptor kept open: one ``pread`` at
    offset 0 per read (the kernel writes the text afresh), where opening, reading to the end
    and closing took four system calls, each a release of the GIL the training thread may
    then hold. ``read`` gives the file's bytes, None without it; the descriptor closes with
    the object."""

    _CHUNK = 65536

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None

    def read(self) -> bytes | None:
        if self._fd is None:
            try:
                self._fd = os.open(self.path, os.O_RDONLY)
            except OSError:
                return None
        try:
            data = os.pread(self._fd, self._CHUNK, 0)
            while len(data) % self._CHUNK == 0 and data:  # a long file: read on to its end
                more = os.pread(self._fd, self._CHUNK, len(data))
                if not more:
                    break
                data += more
            return data
        except OSError:
            self.close()
            return None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        self.close()


def statm_rss(text: bytes, page_size: int) -> int:
    """Resident bytes from /proc/<pid>/statm (``size resident shared ...``, in pages), what
    psutil's ``memory_info().rss`` reads."""
    return int(text.split(None, 2)[1]) * page_size


def psi_some_avg10(text: bytes) -> float | None:
    """'some avg10' of a /proc/pressure file: the share of the last 10 s in which some task
    waited, percent; None when the first line holds no avg10."""
    first = text.split(b"\n", 1)[0].split()
    for item in first[1:]:
        if item.startswith(b"avg10="):
            return float(item[len(b"avg10=") :])
    return None


def net_dev_totals(text: bytes) -> tuple[int, int]:
    """Bytes received and sent over every interface but ``lo``, from /proc/net/dev (two
    header lines, then ``name: rx_bytes ... (8 receive fields) tx_bytes ...``), the fields
    psutil's ``net_io_counters`` reads."""
    rx = tx = 0
    for line in text.splitlines()[2:]:
        name, _, counters = line.partition(b":")
        if name.strip() == b"lo" or not counters:
            continue
        fields = counters.split()
        rx += int(fields[0])
        tx += int(fields[8])
    return rx, tx


class HostTelemetry:
    """getrusage / psutil / PSI / network counters; call ``sample`` from one thread only.

    One sample costs ~15 us here alone (psutil's ``cpu_percent`` and ``net_io_counters`` took it
    to ~150 us a step): the CPU share comes from the same ``getrusage`` as the page faults (its
    times are in microseconds, where /proc/self/stat counts 10 ms ticks), and on Linux the
    RSS, PSI and the network counters are read from /proc through descriptors kept open
    (``ProcFile``; psutil elsewhere)."""

    def __init__(self, *, read_network: bool) -> None:
        import psutil

        self._psutil = psutil
        self._process = psutil.Process(os.getpid())
        self._statm = ProcFile("/proc/self/statm")
        self._pressure = ProcFile("/proc/pressure/cpu")
        self._net_dev = ProcFile("/proc/net/dev") if os.path.exists("/proc/net/dev") else None
        self._page_size = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self._last_time = time.monotonic()
        self._last_usage = resource.getrusage(resource.RUSAGE_SELF)
        self._last_net = self._net() if read_network else None

    def _net(self) -> tuple[int, int]:
        if self._net_dev is not None:
            text = self._net_dev.read()
            if text is not None:
                return net_dev_totals(text)
        counters = self._psutil.net_io_counters(pernic=True)
        rx = sum(c.bytes_recv for nic, c in counters.items() if nic != "lo")
        tx = sum(c.bytes_sent for nic, c in counters.items() if nic != "lo")
        return rx, tx

    def _rss(self) -> int:
        text = self._statm.read()
        return (
            statm_rss(text, self._page_size)
            if text is not None
            else self._process.memory_info().rss
        )

    def sample(self, usage: resource.struct_rusage | None = None) -> list[Point]:
        """The counters since the previous sample; ``usage``: this moment's ``getrusage``,
        when the caller already read it."""
        now = time.monotonic()
        if usage is None:
            usage = resource.getrusage(resource.RUSAGE_SELF)
        last = self._last_usage
        interval = now - self._last_time
        cpu_s = (usage.ru_utime - last.ru_utime) + (usage.ru_stime - last.ru_stime)
        points = [
            Point(Host.RSS, float(self._rss())),
            Point(Host.CPU_PERCENT, 100.0 * cpu_s / interval if interval > 0 else 0.0),
            Point(Host.FAULTS_MINOR, float(usage.ru_minflt - last.ru_minflt)),
            Point(Host.FAULTS_MAJOR, float(usage.ru_majflt - last.ru_majflt)),
            Point(Host.INTERVAL, interval),
        ]
        text = self._pressure.read()
        pressure = None if text is None else psi_some_avg10(text)
        if pressure is not None:
            points.append(Point(Host.CPU_PRESSURE, pressure))
        if self._last_net is not None:
            rx, tx = self._net()
            points += [
                Point(Net.RX, float(rx - self._last_net[0])),
                Point(Net.TX, float(tx - self._last_net[1])),
            ]
            self._last_net = (rx, tx)
        self._last_time, self._last_usage = now, usage
        return points


class DeviceTelemetry:
    """NVML (the ``pynvml`` module of the declared ``nvidia-ml-py``) through torch.cuda's
    wrappers, which map CUDA_VISIBLE_DEVICES; ``pynvml`` is imported here, lazily.

    ``available`` is False without a CUDA device or without ``pynvml`` (one info line says
    which), and after the first failing query (one warning); then ``sample`` returns nothing.
    """

    def __init__(self, device: torch.device | None) -> None:
        self._device = device
        self.available = False
        if device is None or device.type != "cuda":
            log.info("probewire: no CUDA device; device.* telemetry off")
            return
        try:
            import pynvml  # noqa: F401  (nvidia-ml-py; torch.cuda's NVML wrappers use it)
        except ImportError:
            log.info("probewire: pynvml (nvidia-ml-py) not installed; device.* telemetry off")
            return
        self.available = True
        self._queries: list[tuple[str, Callable[[], float]]] = [
            (Device.UTILIZATION, lambda: torch.cuda.utilization(device)),
            (Device.POWER, lambda: torch.cuda.power_draw(device) / 1000.0),  # mW
            (Device.TEMPERATURE, lambda: torch.cuda.temperature(device)),
            (Device.CLOCK, lambda: torch.cuda.clock_rate(device)),
            (Device.MEMORY_USED, lambda: torch.cuda.device_memory_used(device)),
        ]

    def sample(self) -> list[Point]:
        if not self.available:
            return []
        try:
            return [Point(name, float(query())) for name, query in self._queries]
        except Exception as exc:  # NVML errors have many types; turn the probe off, once
            log.warning("probewire: NVML query failed (%s); device.* telemetry off", exc)
            self.available = False
            return []


class SystemProbe:
    """Step bookkeeping on every step: step time, positions and FLOPs, memory peaks and
    capacity, the guard's counters since the last emitted step and the clip threshold; telemetry
    samplers run on the emitter thread. The CUDA peak counters are reset when the step
    opens, so memory.peak_* covers exactly one step."""

    def __init__(
        self,
        *,
        device: torch.device | None,
        flops_per_token: float,
        clip_threshold: float | None,
        telemetry: bool,
        read_network: bool,
    ) -> None:
        self._device = device
        self._flops_per_token = flops_per_token
        self._clip_threshold = clip_threshold
        self._capacity = memory_capacity(device)  # fixed for the process: read once
        self._host = HostTelemetry(read_network=read_network) if telemetry else None
        self._gpu = DeviceTelemetry(device) if telemetry else None

    def open(self, state: StepState) -> None:
        if state.due[TIER]:
            reset_peaks(self._device)

    def _late_points(
        self,
        step: tuple[float, int, list[int], float | None, bool] | None,
        host: HostTelemetry | None,
    ) -> list[Point]:
        """On the emitter thread: the step's bookkeeping from its numbers (elapsed, positions,
        guard counters; None when the tier is not due), memory.peak_rss and host telemetry."""
        out = [] if step is None else self._step_points(*step)
        return out + _usage_points(step is not None, host)

    def _step_points(
        self, elapsed_s: float, positions: int, guard: list[int], clip_c: float | None, amp: bool
    ) -> list[Point]:
        """The step's bookkeeping as points, made on the emitter thread from its numbers
        (``amp``: guard.skipped comes with the GradScaler's verdict instead)."""
        out = [Point(System.STEP_TIME, elapsed_s), Point(Memory.CAPACITY, self._capacity)]
        if positions:
            out += [
                Point(System.POSITIONS, float(positions)),
                Point(System.FLOPS, self._flops_per_token * positions),
            ]
        skipped, replayed, mismatch = guard
        if not amp:  # else sent with the scaler's verdict (``decode_skipped``)
            out.append(Point(Guard.SKIPPED, skipped))
        out += [Point(Guard.REPLAYED, replayed), Point(Guard.REPLAY_MISMATCH, mismatch)]
        if clip_c is not None:
            out.append(Point(Grad.CLIP_THRESHOLD, clip_c))
        return out

    def close(
        self, state: StepState, elapsed_s: float, points: list[Point], late: list[Late]
    ) -> None:
        host = self._host if state.due[TELEMETRY_TIER] else None
        step = None
        if state.due[TIER]:
            points += peak_memory_points(self._device)  # the device's counters at the step's end
            c = clip_threshold(self._clip_threshold, state.max_norm)
            amp = state.scaler is not None
            if state.scaler is not None:  # an AMP skip is a skipped step too
                skip = amp_skipped(*state.scaler)
                state.collector.add("system.amp_skip", skip, decode_skipped, state.guard[0])
            step = (elapsed_s, state.positions, state.guard, c, amp)
            state.guard = [0, 0, 0]
        if step is not None or host is not None:
            late.append(functools.partial(self._late_points, step, host))
        if state.due[TELEMETRY_TIER] and self._gpu is not None and self._gpu.available:
            late.append(self._gpu.sample)


def _usage_points(peak_rss: bool, host: HostTelemetry | None) -> list[Point]:
    """memory.peak_rss and the host telemetry from one ``getrusage`` (a call that walks the
    process's threads: once a step, not twice); a failing host sample keeps the peak."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    points = peak_rss_points(usage) if peak_rss else []
    if host is not None:
        try:
            points += host.sample(usage)
        except Exception:  # as the collector treats a failing sampler
            log.exception("probewire: host telemetry failed")
    return points
