"""vLLM-style log lines on stdout/stderr (nothing is logged per request)."""

import os
import sys
import time
from typing import Any


def log(message: str, level: str = "INFO", stream: Any = None) -> None:
    stamp = time.strftime("%m-%d %H:%M:%S")
    line = f"(APIServer pid={os.getpid()}) {level} {stamp} [fake_vllm.py] {message}"
    print(line, file=stream or sys.stdout, flush=True)
