"""probewire.instrument: the rank-side probes (attach once, mark steps, export off-thread).

The public surface is listed in ``__all__`` and resolved lazily (PEP 562): the stream and
the sink import ``probewire.instrument.catalog`` — the torch-free wire contract — without
pulling torch in through this package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "CATALOG",
    "ControlListener",
    "Group",
    "KafkaTransport",
    "MemoryTransport",
    "MetricSpec",
    "Monitor",
    "NullMonitor",
    "NullStepContext",
    "NullTransport",
    "Point",
    "Priority",
    "ProbeConfig",
    "RankIdentity",
    "Reduction",
    "StepContext",
    "StepEmitter",
    "StructureConfig",
    "Tier",
    "Transport",
    "attach",
    "checkpoint_event",
    "describe",
    "discover",
    "spec",
    "transformer_flops_per_token",
]

_HOME = {
    "CATALOG": "catalog",
    "Group": "catalog",
    "MetricSpec": "catalog",
    "Priority": "catalog",
    "Reduction": "catalog",
    "Tier": "catalog",
    "describe": "catalog",
    "spec": "catalog",
    "ProbeConfig": "config",
    "StructureConfig": "structure_config",
    "discover": "discover",
    "ControlListener": "control",
    "checkpoint_event": "control",
    "KafkaTransport": "export",
    "StepEmitter": "export",
    "Transport": "export",
    "Monitor": "monitor",
    "NullMonitor": "monitor",
    "attach": "monitor",
    "Point": "wire",
    "RankIdentity": "wire",
    "NullStepContext": "step",
    "StepContext": "step",
    "transformer_flops_per_token": "probes.system",
    "MemoryTransport": "testing",
    "NullTransport": "testing",
}


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:  # static analysers see the eager imports
    from .catalog import CATALOG, Group, MetricSpec, Priority, Reduction, Tier, describe, spec
    from .config import ProbeConfig
    from .control import ControlListener, checkpoint_event
    from .discover import discover
    from .export import KafkaTransport, StepEmitter, Transport
    from .monitor import Monitor, NullMonitor, attach
    from .probes.system import transformer_flops_per_token
    from .step import NullStepContext, StepContext
    from .structure_config import StructureConfig
    from .testing import MemoryTransport, NullTransport
    from .wire import Point, RankIdentity
