"""The stream worker's configuration: one config per component, each default written once
in the component's own module, composed here (``probewire.deploy.settings`` puts this
under ``stream`` in the settings tree; ``PROBEWIRE_STREAM__STAGE2__RUN_IDLE_S=300``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from probewire.instrument.plumbing import check, within

from .batching import BatchConfig
from .collector import CollectorConfig
from .health import HealthConfig
from .stage2 import Stage2Config
from .validate import Bounds

__all__ = [
    "BatchConfig",
    "Bounds",
    "CollectorConfig",
    "HealthConfig",
    "ROLES",
    "Stage2Config",
    "StreamConfig",
]

# What a worker process runs. ``all``: stage 1, stage 2, the store, dead letters and
# evaluations (and the detail topic's stage 1 unless ``detail_inline`` is off). ``stage1``:
# stage 1 only (decode, reduce, publish reduced steps) of both rank topics, no store; it
# joins the same consumer group and takes a share of their partitions. ``detail``: stage 1
# of the detail topic only (scan-tier points, ring dumps), so that no scan step ever takes
# CPU from the worker that pages.
ROLES = ("all", "stage1", "detail")


@dataclass(kw_only=True, slots=True)
class StreamConfig:
    """The Faust worker: step completion, per-run processing, store batches, bounds, health."""

    app_id: str = "probewire"
    role: str = "all"  # one of ROLES; see docs/deployment.md
    # role ``all`` reduces the detail topic too; off when ``detail``/``stage1`` workers do
    detail_inline: bool = True
    # the store owner decodes and writes detail (``probewire.detail_steps``) a table at a
    # time while the step tier has no work in hand, waiting at most this long at each turn
    detail_yield_s: float = 2.0
    # the CPU priority (nice) of detail work, so that it takes the CPU the page path leaves
    # (0: unchanged): a worker of role ``detail`` lowers its own by this much (``os.nice``),
    # the owner's detail inserts run at it in the store (``ClickHouseSink.nice``), and so
    # do the embedded store's merge threads (``lower_merge_priority``)
    detail_nice: int = 10
    deadline_s: float = 30.0  # stage 1 reduces what arrived after this long
    # a step of more ranks is reduced by rank block (``fanin``); the ranks' ProbeConfig
    # .block_ranks must be the same (their messages' keys name the block)
    block_ranks: int = 256
    max_message_bytes: int = 1_000_000  # larger reduced steps are split (the broker's limit)
    alert_webhook_url: str = ""
    web_bind: str = "127.0.0.1"
    metrics_port: int = 0  # /metrics (Prometheus text, ``metrics``) on web_bind; 0: off
    fetch_max_wait_ms: int = 50  # Tansu answers a waiting fetch only at its deadline
    stage2: Stage2Config = field(default_factory=Stage2Config)
    batch: BatchConfig = field(default_factory=BatchConfig)
    bounds: Bounds = field(default_factory=Bounds)
    health: HealthConfig = field(default_factory=HealthConfig)
    gc: CollectorConfig = field(default_factory=CollectorConfig)  # see ``collector``

    def __post_init__(self) -> None:
        check(bool(self.app_id.strip()), "app_id", "must not be empty")
        check(self.role in ROLES, "role", f"must be one of {list(ROLES)}, got {self.role!r}")
        check(self.deadline_s > 0, "deadline_s", "must be > 0")
        check(0 <= self.detail_yield_s <= 60, "detail_yield_s", "must lie in [0, 60]")
        check(0 <= self.detail_nice <= 19, "detail_nice", "must lie in [0, 19]")
        check(self.block_ranks >= 1, "block_ranks", "must be >= 1")
        check(0 <= self.metrics_port <= 65535, "metrics_port", "must lie in [0, 65535]")
        check(1 <= self.fetch_max_wait_ms <= 5000, "fetch_max_wait_ms", "must lie in [1, 5000]")
        check(
            10_000 <= self.max_message_bytes <= 100_000_000,
            "max_message_bytes",
            "must lie in [10000, 100000000] (the broker's message.max.bytes)",
        )
        with within("stage2"):
            check(
                self.stage2.max_wait_s > self.deadline_s,
                "max_wait_s",
                f"must be > stream.deadline_s ({self.deadline_s}): a step completed by "
                "its deadline would find its gap skipped",
            )
        with within("health"):
            check(
                self.health.stall_s > self.stage2.max_wait_s,
                "stall_s",
                f"must be > stream.stage2.max_wait_s ({self.stage2.max_wait_s}): steps "
                "wait that long for a gap by design",
            )
