"""The prepared accelerator check for a lent GPU or NPU host (or cpu and npu-sim here): environment, the device
lane of the tests, offload against a pinned copy, the collective sync against a raw broadcast, the ipc engine;
each step with its own deadline, one summary table at the end (:mod:`hal.apps.benchmarks.accel_check`).

    python scripts/accel_check.py [--device cuda|npu|npu-sim|cpu] [--budget-s 480] [--json FILE]

Exit status 0 when every step passed (or was skipped, saying why), 1 otherwise. Runs from a plain copy of the
checkout too: the checkout goes first on ``sys.path``. Where ``$OUT`` is set, the JSON is also written there.
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from hal.apps.benchmarks.accel_check import main  # after the line above: the checkout first on sys.path

if __name__ == "__main__":
    sys.exit(main())
