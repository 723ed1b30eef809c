#!/usr/bin/env bash
# The overhead figures on a GPU, for a task that is lent one (the device tool runs this in a
# copy of the repository): P0 and P1 step-time ratios with pinned host buffers and event
# timing, the emit cost, and the eager and compiled scan ratios on the device. It prints the
# same lines as `python benchmarks/overhead.py` on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
PYTHONUNBUFFERED=1 python3 benchmarks/overhead.py --device cuda
