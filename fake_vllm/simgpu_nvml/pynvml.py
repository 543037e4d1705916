"""``import pynvml`` for a process that should see the simulated GPUs of ``$SIMGPU_LEDGER``.

This directory is not a package: prepend it to ``PYTHONPATH`` of a subprocess (a proxy, say)
and set ``SIMGPU_LEDGER`` to a ledger made by ``fake_vllm.simgpu.Ledger.create``; its
``import pynvml`` then gets this module instead of nvidia-ml-py. The calls are those of
``fake_vllm.simgpu.nvml_module``; the ledger path is read once, at import.
"""

import os
import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.append(_ROOT)  # appended: a fake_vllm already importable wins

from fake_vllm.simgpu import nvml_module  # noqa: E402 - needs the path above

globals().update(vars(nvml_module(os.environ.get("SIMGPU_LEDGER", ""))))
