#!/bin/sh
# The GPU check: the GPU tier (tests/gpu/test_gpu_tier.py) on this host's NVIDIA GPU, device 0, then
# the real allocator check (scripts/gpu_cumem_check.py: vLLM 0.33's CuMem allocator), and what
# they measured written into docs/gpu.md ("## Results", between its markers).
#
# For a GPU host with its driver and a Python (3.12 or 3.11) with torch built for CUDA, without
# network and without vLLM: the project's pure-Python dependencies come as wheels in wheels/,
# with vLLM 0.33's CuMem allocator library and sources in wheels/vllm-cumem/
# (scripts/gpu-wheels.sh downloads them on a machine with network; wheels/ is ignored by git,
# so copy it with the checkout). python3 may itself be a venv with torch preinstalled: the
# check's venv then sees that venv's packages through a .pth file. Run from anywhere:
#
#     sh scripts/gpu-check.sh            # the GPU tier, then the real allocator check
#     sh scripts/gpu-check.sh --dry-run  # everything short of CUDA: set-up, imports, files
#
# Exit status: 0 every test passed (--dry-run: set-up passed); 1 a test failed; 2 the check
# could not be set up (missing wheels or allocator files, a broken venv, no torch); 3 no GPU
# here (no nvidia-smi, no device, or torch without CUDA): nothing ran and nothing was written;
# 4 the tests ran past their time bound.
#
# Environment: PYTHON (default python3; its torch is used), GPU_CHECK_TIMEOUT_S (the bound on
# the tests, default 200 s; the allocator check has 90 s more, so that the whole check stays
# under 5 minutes), GPU_CHECK_WHEELS (default wheels/), GPU_CHECK_RESULTS (folder for the logs
# and figures, default gpu-check-results/), GPU_CHECK_DOC (default docs/gpu.md),
# GPU_CHECK_VENV (default .venv-gpu/), NVIDIA_SMI (default nvidia-smi), OUT (if set, the
# results and the document are copied there as well).
set -u
cd "$(dirname "$0")/.." || exit 2
ROOT=$(pwd)
PY=${PYTHON:-python3}
SMI=${NVIDIA_SMI:-nvidia-smi}
BOUND=${GPU_CHECK_TIMEOUT_S:-200}
CUMEM_BOUND=90
WHEELS=${GPU_CHECK_WHEELS:-$ROOT/wheels}
RESULTS=${GPU_CHECK_RESULTS:-$ROOT/gpu-check-results}
DOC=${GPU_CHECK_DOC:-$ROOT/docs/gpu.md}
VENV=${GPU_CHECK_VENV:-$ROOT/.venv-gpu}
STARTED=$(date +%s)
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1

say() { echo "gpu-check: $*"; }
no_gpu() {
    say "no GPU: $*"
    say "skipped: nothing was run or measured, $DOC is unchanged"
    exit 3
}

# -- is there a GPU? (quick: before any venv or torch import) -------------------------------
if [ "$DRY" -eq 0 ]; then
    command -v "$SMI" >/dev/null 2>&1 || no_gpu "$SMI not found (no NVIDIA driver on this host)"
    "$SMI" -L >/dev/null 2>&1 || no_gpu "'$SMI -L' fails (the driver sees no device)"
fi
command -v "$PY" >/dev/null 2>&1 || { say "$PY not found (set PYTHON)"; exit 2; }

FILES="smi.csv nvidia-smi.txt torch.txt torch.err venv.log junit.xml measure.json pytest.log rc
verdict section.md cumem.json cumem.log"
mkdir -p "$RESULTS" || exit 2
for f in $FILES; do rm -f "$RESULTS/$f"; done
if [ "$DRY" -eq 0 ]; then
    "$SMI" --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$RESULTS/smi.csv"
    "$SMI" | tee "$RESULTS/nvidia-smi.txt"
fi

GPU_CHECK_DRY=$DRY "$PY" - >"$RESULTS/torch.txt" 2>"$RESULTS/torch.err" <<'EOF'
import os
import torch
if os.environ["GPU_CHECK_DRY"] == "1":
    print(f"{torch.__version__} (dry run: CUDA not asked)")
    raise SystemExit(0)
if not torch.cuda.is_available():
    raise SystemExit(f"torch {torch.__version__} sees no CUDA device")
print(f"{torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
EOF
if [ $? -ne 0 ]; then
    [ "$DRY" -eq 1 ] && { say "$PY has no torch: $(tail -n 1 "$RESULTS/torch.err")"; exit 2; }
    no_gpu "$PY has no torch with CUDA: $(tail -n 1 "$RESULTS/torch.err")"
fi
say "torch $(cat "$RESULTS/torch.txt")"

# -- the dependencies: the host's torch, the project's from wheels/ ---------------------------
# A venv that sees the host's torch. `--system-site-packages` shows it the *base* interpreter's
# packages only: where python3 is itself a venv (torch installed in it), the new venv would not
# see torch, so a .pth file in it names that venv's site-packages (after its own, so that the
# wheels installed here win). Where the host's Python has no venv or pip, the wheels are
# unpacked into .gpu-site/ and put on the path instead (they need no build step).
PARENT_SITES=$("$PY" -c 'import site, sys, sysconfig
if sys.prefix != sys.base_prefix:
    paths = [sysconfig.get_path("purelib"), sysconfig.get_path("platlib"), *site.getsitepackages()]
    print("\n".join(dict.fromkeys(p for p in paths if p)))')
RUNPY=""
SITE=""
if [ -x "$VENV/bin/python" ] ||
    "$PY" -m venv --system-site-packages "$VENV" >"$RESULTS/venv.log" 2>&1; then
    RUNPY=$VENV/bin/python
    if [ -n "$PARENT_SITES" ]; then
        OWN=$("$RUNPY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))') &&
            printf '%s\n' "$PARENT_SITES" >"$OWN/gpu_check_parent.pth" &&
            say "$PY is a venv: $VENV sees its site-packages ($OWN/gpu_check_parent.pth)"
    fi
    if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        "$RUNPY" -m pip install -q --no-index --no-deps --disable-pip-version-check \
            "$WHEELS"/*.whl >>"$RESULTS/venv.log" 2>&1 || RUNPY=""
    fi
fi
if [ -z "$RUNPY" ]; then
    say "no working venv with pip ($(tail -n 1 "$RESULTS/venv.log" 2>/dev/null)):" \
        "unpacking $WHEELS/*.whl into .gpu-site/"
    rm -rf "$ROOT/.gpu-site"
    mkdir -p "$ROOT/.gpu-site" || exit 2
    for wheel in "$WHEELS"/*.whl; do
        [ -f "$wheel" ] || break
        "$PY" -m zipfile -e "$wheel" "$ROOT/.gpu-site" || { say "cannot unpack $wheel"; exit 2; }
    done
    RUNPY=$PY
    SITE="$ROOT/.gpu-site:"
fi
MODULES="aiohttp uvloop httptools pydantic yaml prometheus_client psutil pynvml pytest \
pytest_asyncio pytest_timeout torch"
for mod in $MODULES; do
    if ! PYTHONPATH="${SITE}${PYTHONPATH:-}" "$RUNPY" -c "import $mod" 2>/dev/null; then
        say "$RUNPY cannot import $mod: bring the wheels (sh scripts/gpu-wheels.sh on a"
        say "machine with network, for this host's Python: $("$PY" -V 2>&1)) into $WHEELS"
        exit 2
    fi
done
PYTHONPATH="${SITE}$ROOT" "$RUNPY" scripts/gpu_cumem_check.py --dry-run \
    --cumem "$WHEELS/vllm-cumem" || exit 2

# The host's pytest plugins (cov, xdist, benchmark, ...) must not load against the pinned
# pytest: with warnings as errors, one deprecation warning in them fails every test.
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
PLUGINS="-p pytest_asyncio.plugin -p pytest_timeout"
if [ "$DRY" -eq 1 ]; then
    # shellcheck disable=SC2086
    if ! PYTHONPATH="${SITE}$ROOT" "$RUNPY" -m pytest $PLUGINS -p no:cacheprovider -q \
        --collect-only -m gpu tests/gpu/test_gpu_tier.py >"$RESULTS/pytest.log" 2>&1; then
        tail -n 20 "$RESULTS/pytest.log"
        say "dry run: the GPU tier does not collect"
        exit 2
    fi
    say "dry run passed: set-up, imports, wheels and the allocator files in order ($RUNPY)"
    exit 0
fi

# -- the GPU tier, bounded -------------------------------------------------------------------
export PYTHONPATH="${SITE}$ROOT" PYTHONUNBUFFERED=1 GPU_CHECK_OUT="$RESULTS/measure.json"
COMMAND="pytest -m gpu -v -rs tests/gpu/test_gpu_tier.py"
say "running $COMMAND (bound: ${BOUND}s)"
{
    # shellcheck disable=SC2086
    timeout -k 15 "$BOUND" "$RUNPY" -m pytest $PLUGINS -m gpu -v -rs -p no:cacheprovider \
        --junitxml="$RESULTS/junit.xml" tests/gpu/test_gpu_tier.py 2>&1
    echo $? >"$RESULTS/rc"
} | tee "$RESULTS/pytest.log"
RC=$(cat "$RESULTS/rc" 2>/dev/null || echo 1)

# -- the real allocator: vLLM 0.33's CuMem allocator, a weight set slept and woken twice ---------
say "running the allocator check (bound: ${CUMEM_BOUND}s)"
timeout -k 10 "$CUMEM_BOUND" "$RUNPY" scripts/gpu_cumem_check.py --cumem "$WHEELS/vllm-cumem" \
    --out "$RESULTS/cumem.json" 2>&1 | tee "$RESULTS/cumem.log"
ELAPSED=$(($(date +%s) - STARTED))

"$RUNPY" scripts/gpu_report.py "$RESULTS" "$DOC" --rc "$RC" --seconds "$ELAPSED" \
    --command "sh scripts/gpu-check.sh ($COMMAND)" || say "writing the report failed"
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
    for f in nvidia-smi.txt pytest.log junit.xml measure.json section.md cumem.json cumem.log; do
        [ -f "$RESULTS/$f" ] && cp "$RESULTS/$f" "$OUT/"
    done
    cp "$DOC" "$OUT/"
fi
VERDICT=$(cat "$RESULTS/verdict" 2>/dev/null || echo failed)
case "$VERDICT" in
    passed)
        if grep -q '^SKIPPED' "$RESULTS/pytest.log"; then
            say "passed, but some tests were skipped (reasons above): not a full run"
        fi
        say "passed in ${ELAPSED}s"
        exit 0
        ;;
    skipped)
        say "skipped: every test was skipped (reasons above); nothing was measured"
        exit 3
        ;;
    "timed out")
        say "the tests ran past ${BOUND}s and were stopped (${ELAPSED}s in all)"
        exit 4
        ;;
    *)
        say "failed: pytest exit status $RC (${ELAPSED}s in all)"
        exit 1
        ;;
esac
