"""The GPU check (scripts/gpu-check.sh) where there is no GPU, and its report
(scripts/gpu_report.py) on sample results: what it writes into docs/gpu.md."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu-check.sh"
NO_GPU = 3


def _report() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_report", ROOT / "scripts" / "gpu_report.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_report"] = module
    spec.loader.exec_module(module)
    return module


report = _report()

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="3">
<testcase classname="tests.test_gpu_tier" name="test_a" time="12.5"/>
<testcase classname="tests.test_gpu_tier" name="test_b" time="3.0">
<failure message="AssertionError: (1, 'all freed') | x">trace</failure></testcase>
<testcase classname="tests.test_gpu_tier" name="test_c" time="0.0">
<skipped type="pytest.skip" message="device 0 has too little free memory">skip</skipped>
</testcase></testsuite></testsuites>
"""


def reading(step: str, used: int, rss: float, pinned: float | None, **more: float) -> dict:
    return {
        "step": step, "device_used_mb": used, "nvml_process_mb": used - 500,
        "engine_gpu_mb": 4096.0, "rss_mb": rss, "vm_pin_kb": 0, "vm_lck_kb": 0,
        "cgroup_mb": None, "mem_available_mb": 100000.0 - rss, "pinned_mb": pinned,
        "pinned_in_use_mb": pinned, "seconds": more.get("seconds"),
        "rss_shmem_kb": more.get("rss_shmem_kb"), "shmem_kb": more.get("shmem_kb"),
        "cgroup_shmem_mb": more.get("cgroup_shmem_mb"),
    }  # fmt: skip


MEASURE = {
    "date": "2026-12-01 10:00:00 UTC",
    "device": {"index": 0, "name": "NVIDIA H100 80GB HBM3", "memory_mb": 81559, "driver": "570"},
    "engine": {
        "mb": 4096,
        "weights_mb": 2457.6,
        "weights_tensors": 34,
        "weights_pinned_blocks_mb": 3328.0,
        "kv_cache_mb": 1024.0,
        "runtime_mb": 122.9,
        "runtime_pinned_blocks_mb": 128.0,
        "peak_mb": 491.5,
        "device_used_before_mb": 600,
    },
    "readings": [
        reading("ready", 5200, 900.0, None, seconds=9.5),
        reading("first request", 5700, 900.0, None),
        reading(
            "sleep level 1",
            1600,
            4300.0,
            3456.0,
            seconds=1.8,
            rss_shmem_kb=3538944,
            shmem_kb=3600000,
            cgroup_shmem_mb=3456.0,
        ),
    ],
}

MIB_ = 1024 * 1024
DOC = "# GPU\n\n## Results\n\nIntro.\n\n{section}\n## Next\n\nKept.\n"


def test_the_report_renders_outcomes_and_figures_and_replaces_the_last_run(
    tmp_path: Path,
) -> None:
    outcomes = report.read_junit(JUNIT)
    assert [(o.name, o.outcome) for o in outcomes] == [
        ("test_a", "passed"), ("test_b", "failed"), ("test_c", "skipped"),
    ]  # fmt: skip
    assert report.verdict(outcomes, 1) == "failed"
    section = report.render("NVIDIA H100 80GB HBM3, 81559 MiB, 570", "2.14.0, CUDA 12.8",
                            outcomes, MEASURE, 1, 300.0, "sh scripts/gpu-check.sh")  # fmt: skip
    assert section.startswith(report.BEGIN) and section.rstrip().endswith(report.END)
    assert "### Last run: failed (2026-12-01 10:00:00 UTC)" in section
    assert "| `test_b` | failed | 3.0 | AssertionError: (1, 'all freed') \\| x |" in section
    assert "| device (NVML, as measured) | NVIDIA H100 80GB HBM3, 81559 MiB, driver 570 |" in (
        section
    )
    assert "(as pinned power-of-two blocks: 3328 MiB)" in section
    # step, took, device used (+ since before start), NVML, holds, RSS, + RSS, pinned, Vm,
    # RssShmem, Shmem, cgroup shmem, avail
    assert "| sleep level 1 | 1.80 | 1600 (+1000) | 1100 | 4096 | 4300 | 3400 | 3456 / 3456 |" in (
        section
    )
    assert "| 0 / 0 | 3538944 | 3600000 | 3456.0 | 3400 |" in section, "where pinned pages show"
    assert "| ready | 9.50 | 5200 (+4600) | 4700 | 4096 | 900 | 0 | n/a / n/a | 0 / 0 | n/a |" in (
        section
    )
    cumem = {
        "torch": "2.11.0+cu130", "alloc_conf": "max_split_size_mb:20", "vocab": 151936,
        "allocation_sizes": [2 * MIB_, 20 * MIB_], "tensor_bytes": 21 * MIB_,
        "pow2_blocks_bytes": 34 * MIB_, "contents_survived": True,
        "steps": [{"step": "sleep", "seconds": 1.5, "allocated_bytes": 22 * MIB_,
                   "pinned_held_bytes": 34 * MIB_, "rss_shmem_kb": 34816, "rss_anon_kb": 1,
                   "vm_pin_kb": 0, "shmem_kb": 40000, "cgroup_shmem": 34 * MIB_}],
    }  # fmt: skip
    with_cumem = report.render("x", "y", outcomes, MEASURE, 1, 300.0, "c", cumem)
    assert "2 allocations in the `weights` pool for 21 MiB of tensors" in with_cumem
    assert "| sleep | 1.50 | 22 | 34 | 34816 | 1 | 0 | 40000 | 34 |" in with_cumem

    doc = tmp_path / "gpu.md"
    doc.write_text(DOC.format(section=f"{report.BEGIN}\nold run\n{report.END}\n"))
    for _ in range(2):
        doc.write_text(report.replace_section(doc.read_text(), section))
        text = doc.read_text()
        assert text.count(report.BEGIN) == 1 and "old run" not in text
        assert text.startswith("# GPU\n\n## Results\n\nIntro.\n\n" + report.BEGIN)
        assert text.endswith(report.END + "\n\n## Next\n\nKept.\n")


def test_the_report_of_a_run_that_only_skipped_says_so(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    junit = JUNIT.replace('time="12.5"/>', 'time="0"><skipped message="needs an NVIDIA GPU"/>')
    junit = junit.replace("<failure", "<skipped").replace("</failure>", "</skipped>")
    (results / "junit.xml").write_text(junit)
    doc = tmp_path / "gpu.md"
    doc.write_text("# GPU\n")
    assert report.main([str(results), str(doc), "--rc", "0"]) == 0
    assert (results / "verdict").read_text() == "skipped\n"
    text = doc.read_text()
    assert "### Last run: skipped" in text and "Nothing was measured" in text
    assert report.verdict([], 124) == "timed out"
    assert report.verdict(report.read_junit(JUNIT)[:1], 0) == "passed"


def run_check(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("GPU_CHECK_", "OUT"))}
    results = tmp_path / "results"
    doc = tmp_path / "gpu.md"
    doc.write_text("unchanged\n")
    more = {"GPU_CHECK_RESULTS": str(results), "GPU_CHECK_DOC": str(doc), **env}
    return subprocess.run(
        ["sh", str(SCRIPT)], env={**base, **more}, capture_output=True, text=True, timeout=60
    )


def test_the_check_without_nvidia_smi_says_no_gpu_and_exits_3_at_once(tmp_path: Path) -> None:
    started = time.monotonic()
    done = run_check(tmp_path, NVIDIA_SMI=str(tmp_path / "no-nvidia-smi"))
    assert time.monotonic() - started < 10
    assert done.returncode == NO_GPU, done.stdout + done.stderr
    assert "gpu-check: no GPU:" in done.stdout and "nothing was run" in done.stdout
    assert (tmp_path / "gpu.md").read_text() == "unchanged\n"
    assert not (tmp_path / "results").exists()


def test_the_check_with_a_torch_without_cuda_says_no_gpu(tmp_path: Path) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text('#!/bin/sh\necho "GPU 0: stub"\n')
    smi.chmod(0o755)
    stub = tmp_path / "stub" / "torch"
    stub.mkdir(parents=True)
    stub.joinpath("__init__.py").write_text(
        "import types\n__version__ = '0.0-stub'\n"
        "cuda = types.SimpleNamespace(is_available=lambda: False)\n"
    )
    done = run_check(
        tmp_path, NVIDIA_SMI=str(smi), PYTHON=sys.executable, PYTHONPATH=str(stub.parent)
    )
    assert done.returncode == NO_GPU, done.stdout + done.stderr
    assert "torch 0.0-stub sees no CUDA device" in done.stdout
    assert (tmp_path / "gpu.md").read_text() == "unchanged\n"


def _torch_importable(python: str) -> bool:
    done = subprocess.run([python, "-c", "import torch"], capture_output=True, timeout=120)
    return done.returncode == 0


def _allocator_files(into: Path) -> Path:
    """The files `gpu-wheels.sh` takes out of the vLLM wheel: this checkout's own where it has
    fetched them, else stand-ins of the same names (the dry run loads no library)."""
    cumem = into / "vllm-cumem"
    fetched = ROOT / "wheels" / "vllm-cumem"
    if (fetched / "cumem_allocator.abi3.so").is_file():
        shutil.copytree(fetched, cumem)
        return cumem
    cumem.mkdir(parents=True)
    (cumem / "cumem_allocator.abi3.so").write_bytes(b"\x7fELF" + bytes(60))
    for name in ("alloc_conf.py", "device_allocator_init.py"):
        (cumem / name).write_text("import torch\n")
    (cumem / "cumem.py").write_text("import torch\n\n\nclass CuMemAllocator:\n    pass\n")
    return cumem


@pytest.mark.timeout(420)
def test_the_dry_run_sets_up_inside_a_venv_made_inside_a_venv_with_torch(tmp_path: Path) -> None:
    """Regression (review 3, section 4): where python3 is itself a venv with torch installed,
    the check's `venv --system-site-packages` saw the base interpreter's packages only, not
    torch, and set-up stopped with exit 2. The dry run does all of the set-up short of CUDA."""
    outer = sys.executable
    if sys.prefix == sys.base_prefix:  # not a venv: make one that sees this torch
        made = tmp_path / "outer"
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(made)],
                       check=True, capture_output=True, timeout=120)  # fmt: skip
        outer = str(made / "bin" / "python")
    if not _torch_importable(outer):
        pytest.skip("no torch here to run the dry run against (pip install torch, a CPU build)")
    wheels = tmp_path / "wheels"
    _allocator_files(wheels)
    inner = tmp_path / "venv-gpu"
    env = {"PYTHON": outer, "GPU_CHECK_WHEELS": str(wheels), "GPU_CHECK_VENV": str(inner),
           "NVIDIA_SMI": str(tmp_path / "no-nvidia-smi")}  # fmt: skip
    base = {k: v for k, v in os.environ.items() if not k.startswith(("GPU_CHECK_", "OUT"))}
    base.pop("PYTHONPATH", None)
    more = {"GPU_CHECK_RESULTS": str(tmp_path / "results"), **env}
    done = subprocess.run(["sh", str(SCRIPT), "--dry-run"], env={**base, **more},
                          capture_output=True, text=True, timeout=400)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "dry run passed" in done.stdout
    assert "is a venv" in done.stdout, "the inner venv was given the outer one's site-packages"
    pth = list(inner.glob("lib/python*/site-packages/gpu_check_parent.pth"))
    assert pth and pth[0].read_text().strip()
    missing = subprocess.run(["sh", str(SCRIPT), "--dry-run"],
                             env={**base, **more, "GPU_CHECK_WHEELS": str(tmp_path / "none")},
                             capture_output=True, text=True, timeout=400)  # fmt: skip
    assert missing.returncode == 2, missing.stdout + missing.stderr
    assert "cumem_allocator.abi3.so" in missing.stdout, "names the allocator files missing"


# -- the real-vLLM check's pure parts ---------------------------------------------------------


def _vllm_check() -> ModuleType:
    path = ROOT / "scripts" / "gpu_check_vllm.py"
    spec = importlib.util.spec_from_file_location("gpu_check_vllm", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check_vllm"] = module
    spec.loader.exec_module(module)
    return module


def write_header_only_checkpoint(module: ModuleType, shape: object, out: Path) -> None:
    """config.json and a safetensors file whose data is a hole: the estimate reads only the
    header, so the full model's plan needs no 3.3 GB of weights."""
    out.mkdir()
    ids = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    (out / "config.json").write_text(json.dumps(module.model_config(shape, ids)))
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dims in module.tensor_shapes(shape):
        size = 2 * math.prod(dims)
        header[name] = {
            "dtype": "BF16",
            "shape": list(dims),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header).encode()
    with (out / "model.safetensors").open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)


def test_the_vllm_checks_model_is_planned_as_the_proxy_plans_it(tmp_path: Path) -> None:
    check = _vllm_check()
    assert check.parameters(check.FULL) == 1_751_222_272
    write_header_only_checkpoint(check, check.FULL, tmp_path / "M")
    h100 = check.planned(tmp_path / "M", 81559)
    assert h100["detail"]["weights_mb"] == 3341 and h100["detail"]["kv_cache_mb"] == 3072
    # H100 defaults: 1024 sequences. Model Runner V2 profiles the sampler over 1024 rows x
    # 131072 x 8 bytes (v1/worker/gpu/model_runner.py:1010-1034) and keeps 1024 x (131072 +
    # 4096) int32 of sampler state in the weights pool (v1/worker/gpu/sample/penalties.py:43-50)
    assert (h100["detail"]["max_num_seqs"], h100["detail"]["sampler_mb"]) == (1024, 1024)
    assert h100["detail"]["sampler_state_mb"] == 528
    assert (h100["budget_mb"], h100["footprint_mb"], h100["util"]) == (8509, 9277, 0.104329)
    assert check.planned(tmp_path / "M", 143771)["util"] == 0.059184
    boosted = check.planned(tmp_path / "M", 81559, boost_mb=1738)
    assert boosted["budget_mb"] == 8509 + 1738 and boosted["util"] == 0.125639


def test_the_vllm_checks_log_figures_are_read_from_vllms_own_lines() -> None:
    check = _vllm_check()
    log = (
        "INFO Memory profiling takes 12.31 seconds. Total non KV cache memory: 5.1GiB; torch "
        "peak memory increase: 1.42GiB; total consumed (from mem_get_info): 3.9GiB; weights "
        "memory: 3.26GiB.\nINFO Available KV cache memory: 1.67 GiB\n"
        "INFO GPU KV cache size: 13,680 tokens, Maximum concurrency for 4,096 tokens per "
        "request: 3.34x\nINFO CuMemAllocator: sleep freed 5.02 GiB memory in total, of which "
        "3.41 GiB is backed up in CPU and the rest 1.61 GiB is discarded directly.\n"
        "INFO Sleep mode freed 5.1 GiB memory, 0.93 GiB memory is still in use.\n"
    )
    assert check.log_figures(log) == {
        "profiling": [12.31, 5.1, 1.42, 3.9, 3.26],
        "available_kv_gib": [1.67],
        "kv_tokens": [13680.0],
        "cumem_sleep": [5.02, 3.41],
        "sleep_freed": [5.1, 0.93],
    }


def test_the_vllm_checks_summary_names_the_figures_and_survives_missing_steps() -> None:
    check = _vllm_check()
    empty = check.summarize({"baseline": {"error": "x"}})
    assert set(empty) >= {"P_ready", "overhead", "P_full", "P_woken", "R1", "H1_rss", "R2", "W"}
    assert empty["P_ready"] is None and empty["wake_l2_s"] == [None, None, None]

    def at(mb: int, avail: float = 100000.0, seconds: float | None = None) -> dict:
        return {"engine_mb": mb, "rss_mb": 900.0, "mem_available_mb": avail, "seconds": seconds}

    results = {
        "start": {"P_ready": at(7400), "overhead_mb": 700, "log": {"profiling": [9, 5, 1.4, 4, 3]}},
        "peak": {"P_full": at(8900)},
        "level1": {"first": {"awake": at(8900), "asleep": at(1100, 95000.0)}, "R1": at(1100),
                   "H1_mb": 4500.0, "P_woken": at(7400, seconds=1.2)},
        "level2": {"sleep": {"awake": at(8900), "asleep": at(1000, 99800.0)}, "R2": at(1000),
                   "after_weights": at(4400, seconds=0.1), "after_reload": at(4900, seconds=3.0),
                   "P_l2": at(7400, seconds=0.2), "greedy_same": True},
    }  # fmt: skip
    summary = check.summarize(results)
    assert summary["torch_peak_gib"] == 1.4 and summary["H1_mem_available"] == 5000.0
    assert (summary["W"], summary["T"], summary["P_l2"]) == (3400, 500, 7400)
    assert summary["wake_l1_s"] == 1.2 and summary["wake_l2_s"] == [0.1, 3.0, 0.2]
    assert summary["H2_mem_available"] == 200.0 and summary["greedy_same"] is True
