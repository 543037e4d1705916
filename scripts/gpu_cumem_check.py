"""The real allocator check: vLLM 0.33's own CuMem allocator on this host's GPU, without vLLM.

`scripts/gpu-wheels.sh` takes vLLM 0.33.0's ``cumem_allocator.abi3.so`` (27 KB) and its
``vllm/device_allocator/{__init__,alloc_conf,cumem}.py`` out of the vLLM wheel into
``wheels/vllm-cumem/``. This script puts them into a throw-away ``vllm`` package beside small
stand-ins for what they import (a logger, the CUDA platform, ``find_loaded_library``,
``PIN_MEMORY``, and ``CudaRTLibrary.cudaMemcpy`` through ctypes), so that vLLM's own
``CuMemAllocator`` runs unchanged on torch's CUDA. It then does what an engine's level-1
sleep does with a realistic weight set:

1. allocates the weights of a 1.5B Llama-shaped model (bf16, vocabulary `--vocab`) and a
   ``[1024, vocab]`` int32 tensor (Model Runner V2's ``output_bin_counts``) in the ``weights``
   pool with ``max_split_size_mb=20``, as ``Worker.load_model`` does
   (``vllm/v1/worker/gpu_worker.py:594-600``);
2. sleeps (weights offloaded to pinned host tensors), wakes, sleeps again and wakes again;
3. records after each step the CuMem allocations (their sizes: torch's segments, not the
   tensors), torch's host allocator statistics (the whole dict, keys as this torch names them),
   ``RssShmem``/``RssAnon``/``VmPin`` of this process, ``Shmem`` and ``MemAvailable`` from
   ``/proc/meminfo``, the cgroup's ``memory.stat`` ``shmem`` and ``file``, and the time taken.

What it settles: the real pinned size per allocation (power-of-two blocks of torch's host
allocator, or not), whether the blocks are kept after the wake and reused by the next sleep,
and where the kernel accounts them. Exit status: 0 measured, 2 set-up (files or torch missing),
3 no CUDA device. ``--dry-run`` checks the files and the package, short of loading the library.

    python scripts/gpu_cumem_check.py --cumem wheels/vllm-cumem --out results/cumem.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MIB = 1024 * 1024
#: The files taken out of the vLLM 0.33.0 wheel (`scripts/gpu-wheels.sh`).
FILES = {
    "cumem_allocator.abi3.so": "cumem_allocator.abi3.so",
    "cumem.py": "device_allocator/cumem.py",
    "alloc_conf.py": "device_allocator/alloc_conf.py",
    "device_allocator_init.py": "device_allocator/__init__.py",
}

#: Stand-ins for the modules the allocator imports (path in the package -> source).
STUBS = {
    "__init__.py": "",
    "logger.py": "import logging\n\ndef init_logger(name):\n    return logging.getLogger(name)\n",
    "platforms/__init__.py": (
        "class _Cuda:\n"
        "    device_type = 'cuda'\n"
        "    def is_rocm(self): return False\n"
        "    def is_cuda_alike(self): return True\n"
        "    def is_xpu(self): return False\n"
        "    def is_cpu(self): return False\n"
        "current_platform = _Cuda()\n"
    ),
    "utils/__init__.py": "",
    "utils/system_utils.py": (
        "def find_loaded_library(lib_name):\n"
        "    with open('/proc/self/maps') as f:\n"
        "        for line in f:\n"
        "            start = line.find('/')\n"
        "            if start == -1:\n"
        "                continue\n"
        "            path = line[start:].strip()\n"
        "            name = path.rsplit('/', 1)[-1]\n"
        "            if name.startswith((lib_name + '.', lib_name + '-')):\n"
        "                return path\n"
        "    return None\n"
    ),
    "utils/torch_utils.py": "PIN_MEMORY = True\n",
    "distributed/__init__.py": "",
    "distributed/device_communicators/__init__.py": "",
    "distributed/device_communicators/cuda_wrapper.py": (
        "import ctypes\n"
        "from vllm.utils.system_utils import find_loaded_library\n\n"
        "class CudaRTLibrary:\n"
        "    def __init__(self):\n"
        "        path = find_loaded_library('libcudart')\n"
        "        if path is None:\n"
        "            import torch\n"
        "            torch.cuda.init()\n"
        "            path = find_loaded_library('libcudart')\n"
        "        self.lib = ctypes.CDLL(path)\n"
        "        self.lib.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p,\n"
        "                                        ctypes.c_size_t, ctypes.c_int]\n"
        "    def cudaMemcpy(self, dst, src, count):\n"
        "        err = self.lib.cudaMemcpy(dst, src, count, 4)  # cudaMemcpyDefault\n"
        "        if err != 0:\n"
        "            raise RuntimeError(f'cudaMemcpy failed: {err}')\n"
        "    def cudaMemset(self, ptr, value, count):\n"
        "        self.lib.cudaMemset(ctypes.c_void_p(ptr), value, ctypes.c_size_t(count))\n"
    ),
}


def missing(cumem: Path) -> list[str]:
    """The files `scripts/gpu-wheels.sh` should have put into `cumem`, absent there."""
    return [name for name in FILES if not (cumem / name).is_file()]


def build_package(cumem: Path, into: Path) -> Path:
    """The throw-away ``vllm`` package under `into`: vLLM's files and the stand-ins."""
    root = into / "vllm"
    for rel, text in STUBS.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    for name, rel in FILES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(cumem / name, root / rel)
    return root


def llama_shapes(
    vocab: int, hidden: int = 1536, layers: int = 28
) -> list[tuple[str, tuple[int, ...]]]:
    """A Qwen2.5-1.5B-shaped checkpoint (bf16): embedding, per layer fused qkv, o, fused
    gate_up, down and two norms, the final norm; the LM head tied to the embedding."""
    inter, kv = 8960, 256
    shapes: list[tuple[str, tuple[int, ...]]] = [("embed", (vocab, hidden))]
    for i in range(layers):
        shapes += [
            (f"l{i}.qkv", (hidden + 2 * kv, hidden)),
            (f"l{i}.qkv_bias", (hidden + 2 * kv,)),
            (f"l{i}.o", (hidden, hidden)),
            (f"l{i}.gate_up", (2 * inter, hidden)),
            (f"l{i}.down", (hidden, inter)),
            (f"l{i}.norm1", (hidden,)),
            (f"l{i}.norm2", (hidden,)),
        ]
    shapes.append(("norm", (hidden,)))
    return shapes


def _kb(text: str, key: str) -> int | None:
    match = re.search(rf"^{key}:\s+(\d+) kB", text, re.M)
    return int(match.group(1)) if match else None


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _stat(text: str, key: str) -> int | None:
    match = re.search(rf"^{key} (\d+)$", text, re.M)
    return int(match.group(1)) if match else None


def host_reading(torch: Any) -> dict[str, Any]:
    """This process's and the host's memory figures (bytes unless ``_kb``)."""
    status, meminfo = _read("/proc/self/status"), _read("/proc/meminfo")
    cgroup = _read("/sys/fs/cgroup/memory.stat") or _read("/sys/fs/cgroup/memory/memory.stat")
    stats_of = getattr(torch.cuda, "host_memory_stats", None)
    stats = dict(stats_of()) if stats_of is not None else {}
    return {
        "host_memory_stats": {
            k: v
            for k, v in stats.items()
            if k.endswith(".current") or k.startswith(("num_", "host_"))
        },
        "rss_shmem_kb": _kb(status, "RssShmem"),
        "rss_anon_kb": _kb(status, "RssAnon"),
        "vm_pin_kb": _kb(status, "VmPin"),
        "vm_lck_kb": _kb(status, "VmLck"),
        "shmem_kb": _kb(meminfo, "Shmem"),
        "mem_available_kb": _kb(meminfo, "MemAvailable"),
        "cgroup_shmem": _stat(cgroup, "shmem") or _stat(cgroup, "total_shmem"),
        "cgroup_file": _stat(cgroup, "file") or _stat(cgroup, "total_cache"),
    }


def pinned_held(stats: dict[str, Any]) -> int | None:
    """Bytes torch's host allocator holds (in use and cached), by the keys this torch has:
    newer ones count it in ``allocated_bytes`` beside ``active_bytes``; older ones in
    ``reserved_bytes``, with ``allocated_bytes`` the part in use."""
    if "active_bytes.current" in stats and "allocated_bytes.current" in stats:
        return int(stats["allocated_bytes.current"])
    if "reserved_bytes.current" in stats:
        return int(stats["reserved_bytes.current"])
    return None


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def import_allocator(torch: Any) -> Any:
    """vLLM's `CuMemAllocator` from the throw-away package; where its library needs NVRTC
    that torch did not load, NVRTC is loaded first (from torch's own ``nvidia`` packages)."""
    import ctypes
    import importlib
    import site

    try:
        return importlib.import_module("vllm.device_allocator.cumem").CuMemAllocator
    except ImportError as err:
        if "nvrtc" not in str(err):
            raise
        for folder in [*site.getsitepackages(), os.path.dirname(os.path.dirname(torch.__file__))]:
            for lib in sorted(Path(folder).glob("nvidia/**/libnvrtc.so*")):
                ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
                for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
                    del sys.modules[name]
                return importlib.import_module("vllm.device_allocator.cumem").CuMemAllocator
        raise


def dry_import(cumem: Path) -> str | None:
    """Import vLLM's allocator module from the package without its library (no CUDA driver
    needed): every other import it makes must resolve to vLLM's files or the stand-ins. None
    when it does, else why not."""
    import importlib

    with tempfile.TemporaryDirectory() as tmp:
        root = build_package(cumem, Path(tmp))
        (root / "cumem_allocator.abi3.so").unlink()  # the import takes its no-CUDA branch
        sys.path.insert(0, tmp)
        try:
            module = importlib.import_module("vllm.device_allocator.cumem")
            if not hasattr(module, "CuMemAllocator"):
                return "vllm/device_allocator/cumem.py has no CuMemAllocator"
        except Exception as err:
            return f"importing vllm/device_allocator/cumem.py: {err!r}"
        finally:
            sys.path.remove(tmp)
            for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
                del sys.modules[name]
    return None


def run(cumem: Path, vocab: int, out: Path | None) -> int:
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:20")
    import torch

    if not torch.cuda.is_available():
        print(f"gpu-cumem-check: torch {torch.__version__} sees no CUDA device")
        return 3
    torch.cuda.init()
    work = Path(tempfile.mkdtemp(prefix="vllm-cumem-"))
    build_package(cumem, work)
    sys.path.insert(0, str(work))
    CuMemAllocator = import_allocator(torch)
    allocator = CuMemAllocator.get_instance()
    record: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0),
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "vocab": vocab,
        "steps": [],
    }

    def step(name: str, began: float) -> None:
        sizes = sorted((d.handle[1] for d in allocator.pointer_to_data.values()), reverse=True)
        reading = {
            "step": name,
            "seconds": round(time.monotonic() - began, 3),
            "allocations": len(sizes),
            "allocated_bytes": sum(sizes),
            "device_free_bytes": torch.cuda.mem_get_info()[0],
            **host_reading(torch),
        }
        reading["pinned_held_bytes"] = pinned_held(reading["host_memory_stats"])
        record["steps"].append(reading)
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(record, indent=2) + "\n")
        held = reading["pinned_held_bytes"]
        print(f"gpu-cumem-check: {name}: {reading['seconds']}s, {len(sizes)} allocations,"
              f" {sum(sizes) / MIB:.0f} MiB on the device, pinned held"
              f" {'n/a' if held is None else f'{held / MIB:.0f} MiB'},"
              f" RssShmem {reading['rss_shmem_kb']} kB")  # fmt: skip

    began = time.monotonic()
    tensors: list[Any] = []
    with allocator.use_memory_pool(tag="weights"):
        for _name, shape in llama_shapes(vocab):
            tensors.append(torch.ones(shape, dtype=torch.bfloat16, device="cuda"))
        tensors.append(torch.zeros((1024, vocab), dtype=torch.int32, device="cuda"))
    torch.cuda.synchronize()
    step("allocated", began)
    sizes = [d.handle[1] for d in allocator.pointer_to_data.values()]
    record["allocation_sizes"] = sorted(sizes, reverse=True)
    record["tensor_bytes"] = sum(t.numel() * t.element_size() for t in tensors)
    record["pow2_blocks_bytes"] = sum(next_pow2(s) for s in sizes)
    for name in ("sleep", "wake", "sleep again", "wake again"):
        began = time.monotonic()
        if name.startswith("sleep"):
            allocator.sleep(offload_tags=("weights",))
        else:
            allocator.wake_up()
        torch.cuda.synchronize()
        step(name, began)
    ok = bool(torch.all(tensors[0][:4] == 1).item()) and bool(
        torch.all(tensors[-1][:4] == 0).item()
    )
    record["contents_survived"] = ok
    if out is not None:
        out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"gpu-cumem-check: {len(sizes)} allocations for {len(tensors)} tensors,"
          f" {record['tensor_bytes'] / MIB:.0f} MiB of tensors; as power-of-two blocks"
          f" {record['pow2_blocks_bytes'] / MIB:.0f} MiB; contents survived: {ok}")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cumem", type=Path, default=Path("wheels/vllm-cumem"))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    absent = missing(args.cumem)
    if absent:
        print(f"gpu-cumem-check: missing in {args.cumem}: {', '.join(absent)}"
              " (run sh scripts/gpu-wheels.sh on a machine with network)")  # fmt: skip
        return 2
    if args.dry_run:
        try:
            import torch
        except ImportError as err:
            print(f"gpu-cumem-check: no torch: {err}")
            return 2
        with tempfile.TemporaryDirectory() as tmp:
            root = build_package(args.cumem, Path(tmp))
            for rel in ("device_allocator/cumem.py", "device_allocator/alloc_conf.py"):
                compile((root / rel).read_text(), str(root / rel), "exec")
            head = (root / "cumem_allocator.abi3.so").read_bytes()[:4]
            if head != b"\x7fELF":
                print("gpu-cumem-check: cumem_allocator.abi3.so is not an ELF library")
                return 2
        why = dry_import(args.cumem)
        if why is not None:
            print(f"gpu-cumem-check: {why}")
            return 2
        print(f"gpu-cumem-check: dry run: files present, package builds, torch {torch.__version__}")
        return 0
    return run(args.cumem, args.vocab, args.out)


if __name__ == "__main__":
    sys.exit(main())
