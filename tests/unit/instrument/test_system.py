"""System probes: the fixed FLOP estimator, memory points, host telemetry deltas."""

from __future__ import annotations

import logging
import mmap
import os
import time

import pytest
import torch

from probewire.deploy.demo.model import TinyConfig, TinyLM
from probewire.instrument.probes.system import (
    DeviceTelemetry,
    HostTelemetry,
    ProcFile,
    default_flops_per_token,
    memory_capacity,
    net_dev_totals,
    peak_memory_points,
    peak_rss_points,
    psi_some_avg10,
    statm_rss,
    transformer_flops_per_token,
)


def test_flop_estimator_is_6n_plus_the_attention_term():
    assert transformer_flops_per_token(1000, 2, 64, 128) == 6000 + 12 * 2 * 64 * 128


def test_default_estimator_uses_the_models_own_and_unwraps_wrappers():
    model = TinyLM(TinyConfig())
    n = sum(p.numel() for p in model.parameters())
    assert default_flops_per_token(model, n) == model.flops_per_token()

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = model

    assert default_flops_per_token(Wrapper(), n) == model.flops_per_token()
    assert default_flops_per_token(torch.nn.Linear(3, 4), 16) == 96.0


def test_cpu_memory_points_report_the_process_peak_only():
    points = {p.name: p.value for p in peak_memory_points(None) + peak_rss_points()}
    assert set(points) == {"memory.peak_rss"} and points["memory.peak_rss"] > 1e6


def test_host_telemetry_counts_since_the_previous_sample_and_net_only_when_asked():
    host = HostTelemetry(read_network=True)
    # fresh anonymous pages, each written once: one minor page fault per page (a calloc'd
    # bytearray may be mapped and never touched, or reuse pages already faulted in)
    blob = mmap.mmap(-1, 8 << 20)
    for offset in range(0, len(blob), mmap.PAGESIZE):
        blob[offset] = 1
    first = {p.name: p.value for p in host.sample()}
    second = {p.name: p.value for p in host.sample()}
    blob.close()
    assert first["host.page_faults_minor"] > 0 and first["host.rss"] > 1e6
    assert {"net.rx", "net.tx", "host.interval"} <= set(second)
    assert second["host.interval"] >= 0 and second["net.rx"] >= 0
    quiet = {p.name for p in HostTelemetry(read_network=False).sample()}
    assert not quiet & {"net.rx", "net.tx"}


def test_the_cpu_share_is_the_process_cpu_time_over_the_interval_as_psutil_reads_it():
    """Against psutil's ``Process.cpu_percent`` over the same busy 0.3 s (it counts 10 ms
    ticks: within 4 % of one core of each other, allowing a tick each way and a sample's skew)."""
    import psutil

    host, reference = HostTelemetry(read_network=False), psutil.Process()
    host.sample()
    reference.cpu_percent(None)
    end = time.monotonic() + 0.3
    while time.monotonic() < end:
        pass
    ours = {p.name: p.value for p in host.sample()}["host.cpu_percent"]
    theirs = reference.cpu_percent(None)
    assert 50.0 < ours < 200.0 and abs(ours - theirs) < 8.0, (ours, theirs)


def test_a_proc_file_reads_its_current_bytes_each_time_whole_past_one_pread(tmp_path):
    """One descriptor, read from offset 0 every time: a rewritten file reads as it is now,
    a file longer than one 64 KiB pread reads whole, a missing one is None."""
    path = tmp_path / "counters"
    long = bytes(range(256)) * 600  # 153,600 bytes: three preads
    path.write_bytes(long)
    reader = ProcFile(str(path))
    assert reader.read() == long
    with open(path, "r+b") as handle:  # the same file, new contents (as /proc regenerates)
        handle.write(b"fresh")
        handle.truncate(5)
    assert reader.read() == b"fresh"
    reader.close()
    assert ProcFile(str(tmp_path / "missing")).read() is None


def test_rss_from_statm_is_psutils_rss_and_follows_touched_pages():
    import psutil

    statm, process = ProcFile("/proc/self/statm"), psutil.Process()
    page = mmap.PAGESIZE
    before = statm_rss(statm.read(), page)
    assert abs(before - process.memory_info().rss) < (1 << 20)
    blob = mmap.mmap(-1, 32 << 20)
    for offset in range(0, len(blob), page):
        blob[offset] = 1
    after = statm_rss(statm.read(), page)
    blob.close()
    assert after - before >= 32 << 20
    assert statm_rss(b"1000 250 30 5 0 120 0\n", 4096) == 250 * 4096


NET_DEV = b"""Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo: 9000000    1000    0    0    0     0          0         0  9000000    1000    0    0    0     0       0          0
  eth0: 123456789  20000    0    0    0     0          0         0 987654  15000    0    0    0     0       0          0
veth1a2b:    42       1    0    0    0     0          0         0      7       1    0    0    0     0       0          0
"""


def test_network_totals_leave_out_loopback_and_match_psutil_on_this_host():
    assert net_dev_totals(NET_DEV) == (123456789 + 42, 987654 + 7)
    import psutil

    def psutil_totals() -> tuple[int, int]:
        nics = psutil.net_io_counters(pernic=True)
        return (
            sum(c.bytes_recv for n, c in nics.items() if n != "lo"),
            sum(c.bytes_sent for n, c in nics.items() if n != "lo"),
        )

    before = psutil_totals()
    with open("/proc/net/dev", "rb") as handle:
        ours = net_dev_totals(handle.read())
    after = psutil_totals()
    assert before[0] <= ours[0] <= after[0] and before[1] <= ours[1] <= after[1]


def test_cpu_pressure_is_the_first_lines_avg10():
    text = b"some avg10=1.25 avg60=0.50 avg300=0.10 total=123\nfull avg10=9.00 avg60=0 avg300=0 total=0\n"
    assert psi_some_avg10(text) == 1.25
    assert psi_some_avg10(b"some total=1\n") is None


@pytest.mark.parametrize("device", [None, torch.device("cpu")])
def test_device_telemetry_is_off_without_cuda_with_one_info_line(device, caplog):
    import pynvml  # the declared binding (nvidia-ml-py) is installed; no GPU here

    assert hasattr(pynvml, "nvmlInit")
    with caplog.at_level(logging.DEBUG, logger="probewire.instrument.probes.system"):
        telemetry = DeviceTelemetry(device)
        assert telemetry.available is False and telemetry.sample() == []
    records = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert records == [(logging.INFO, "probewire: no CUDA device; device.* telemetry off")]


def test_peak_rss_and_host_telemetry_share_one_getrusage_and_a_failing_host_keeps_the_peak(
    monkeypatch, caplog
):
    from probewire.instrument.probes import system

    calls = []
    real = system.resource.getrusage
    monkeypatch.setattr(system.resource, "getrusage", lambda who: calls.append(who) or real(who))
    host = HostTelemetry(read_network=False)
    calls.clear()
    names = [p.name for p in system._usage_points(True, host)]
    assert len(calls) == 1 and names[0] == "memory.peak_rss" and "host.cpu_percent" in names

    class Broken:
        def sample(self, usage):
            raise RuntimeError("psutil went away")

    with caplog.at_level(logging.ERROR):
        assert [p.name for p in system._usage_points(True, Broken())] == ["memory.peak_rss"]
    assert "host telemetry failed" in caplog.text


@pytest.mark.parametrize(
    "v2,v1,expect",
    [
        ("max\n", None, "physical"),  # v2 without a limit
        ("1073741824\n", None, 1073741824.0),  # v2 limit: 1 GiB
        (None, "536870912\n", 536870912.0),  # v1 limit
        (None, "9223372036854771712\n", "physical"),  # v1 "unlimited": above physical
        (None, None, "physical"),  # no cgroup files
    ],
)
def test_cpu_memory_capacity_is_the_cgroup_limit_never_above_physical_memory(
    tmp_path, v2, v1, expect
):
    """memory.capacity on CPU: the cgroup v2 memory.max, else v1 memory.limit_in_bytes,
    capped by the system's physical memory (sysconf), which it is without a limit."""
    files = (tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes")
    for path, text in zip(files, (v2, v1)):
        if text is not None:
            path.write_text(text)
    physical = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    want = physical if expect == "physical" else expect
    assert memory_capacity(None, tuple(map(str, files))) == want
