"""What a training process loads: the probes, the settings and the demo's training script
load none of the worker's libraries. Each is resident memory in every rank (pyarrow alone
25 MiB with torch loaded), and the ranks' RSS baseline is what the memory-creep rule
measures growth against: an Arrow import reached through ``deploy.settings`` once made
that fault page a step late."""

from __future__ import annotations

import subprocess
import sys

WORKER_ONLY = ("pyarrow", "chdb", "clickhouse_connect", "faust", "aiokafka", "pandas")


def test_a_training_process_loads_none_of_the_worker_s_libraries() -> None:
    script = (
        "import sys\n"
        "import probewire.instrument, probewire.deploy.settings, probewire.deploy.demo.train\n"
        f"print(sorted(m for m in {WORKER_ONLY!r} if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"
