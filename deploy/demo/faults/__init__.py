"""The demo's faults: one vocabulary for every fault the demo can inject into real training.

``base`` holds the ``Fault`` base class and the helpers faults share, ``training`` the faults
of the training loop and the data (with the registry ``FAULTS``, the must-page-nothing
``SCENARIOS`` and ``parse_fault``), ``structure`` the faults of the model's optional
structures (experts, media, the residual stream). Everything public is re-exported here:
``from probewire.deploy.demo.faults import BadRank, parse_fault``. (The worker's own
test-only fault injection is ``probewire.deploy.fault_injection``.)
"""

from .training import (
    FAULTS,
    MANY_RANKS,
    SCENARIOS,
    BadRank,
    Bf16Swallow,
    EasyBatch,
    Fault,
    FaultError,
    FlakyReplay,
    IgnoredMedia,
    LabelShuffle,
    LayerExplosion,
    MemoryCreep,
    NanWeight,
    PoisonedBatch,
    RoutingCollapse,
    SourceRegression,
    Straggler,
    demo_train_args,
    parse_fault,
)

__all__ = [
    "FAULTS",
    "MANY_RANKS",
    "SCENARIOS",
    "BadRank",
    "Bf16Swallow",
    "EasyBatch",
    "Fault",
    "FaultError",
    "FlakyReplay",
    "IgnoredMedia",
    "LabelShuffle",
    "LayerExplosion",
    "MemoryCreep",
    "NanWeight",
    "PoisonedBatch",
    "RoutingCollapse",
    "SourceRegression",
    "Straggler",
    "demo_train_args",
    "parse_fault",
]
