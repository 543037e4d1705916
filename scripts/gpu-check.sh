#!/bin/sh
# The GPU check: the GPU tier (tests/test_gpu_tier.py) on this host's NVIDIA GPU, device 0,
# and what it measured written into docs/gpu.md ("## Results", between its markers).
#
# For a GPU host with its driver and a Python (3.12 or 3.11) with torch built for CUDA, without
# network and without vLLM: the project's pure-Python dependencies come as wheels in wheels/
# (scripts/gpu-wheels.sh downloads them on a machine with network). Run from anywhere:
#
#     sh scripts/gpu-check.sh
#
# Exit status: 0 every test passed; 1 a test failed; 2 the check could not be set up (missing
# wheels, a broken venv); 3 no GPU here (no nvidia-smi, no device, or torch without CUDA):
# nothing ran and nothing was written; 4 the tests ran past their time bound.
#
# Environment: PYTHON (default python3; its torch is used), GPU_CHECK_TIMEOUT_S (the bound on
# the tests, default 400 s, so that the whole check stays under 8 minutes), GPU_CHECK_RESULTS
# (folder for the logs and figures, default gpu-check-results/), GPU_CHECK_DOC (default
# docs/gpu.md), GPU_CHECK_VENV (default .venv-gpu/), NVIDIA_SMI (default nvidia-smi), OUT (if
# set, the results and the document are copied there as well).
set -u
cd "$(dirname "$0")/.." || exit 2
ROOT=$(pwd)
PY=${PYTHON:-python3}
SMI=${NVIDIA_SMI:-nvidia-smi}
BOUND=${GPU_CHECK_TIMEOUT_S:-400}
RESULTS=${GPU_CHECK_RESULTS:-$ROOT/gpu-check-results}
DOC=${GPU_CHECK_DOC:-$ROOT/docs/gpu.md}
VENV=${GPU_CHECK_VENV:-$ROOT/.venv-gpu}
STARTED=$(date +%s)

say() { echo "gpu-check: $*"; }
no_gpu() {
    say "no GPU: $*"
    say "skipped: nothing was run or measured, $DOC is unchanged"
    exit 3
}

# -- is there a GPU? (quick: before any venv or torch import) -------------------------------
command -v "$SMI" >/dev/null 2>&1 || no_gpu "$SMI not found (no NVIDIA driver on this host)"
"$SMI" -L >/dev/null 2>&1 || no_gpu "'$SMI -L' fails (the driver sees no device)"
command -v "$PY" >/dev/null 2>&1 || { say "$PY not found (set PYTHON)"; exit 2; }

FILES="smi.csv nvidia-smi.txt torch.txt torch.err venv.log junit.xml measure.json pytest.log rc
verdict section.md"
mkdir -p "$RESULTS" || exit 2
for f in $FILES; do rm -f "$RESULTS/$f"; done
"$SMI" --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$RESULTS/smi.csv"
"$SMI" | tee "$RESULTS/nvidia-smi.txt"

"$PY" - >"$RESULTS/torch.txt" 2>"$RESULTS/torch.err" <<'EOF'
import torch
if not torch.cuda.is_available():
    raise SystemExit(f"torch {torch.__version__} sees no CUDA device")
print(f"{torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
EOF
if [ $? -ne 0 ]; then
    no_gpu "$PY has no torch with CUDA: $(tail -n 1 "$RESULTS/torch.err")"
fi
say "torch $(cat "$RESULTS/torch.txt")"

# -- the dependencies: the host's torch, the project's from wheels/ ---------------------------
# A venv that sees the host's torch; where the host's Python has no venv or pip, the wheels
# are unpacked into .gpu-site/ and put on the path instead (they need no build step).
RUNPY=""
SITE=""
if [ -x "$VENV/bin/python" ] ||
    "$PY" -m venv --system-site-packages "$VENV" >"$RESULTS/venv.log" 2>&1; then
    RUNPY=$VENV/bin/python
    if ls wheels/*.whl >/dev/null 2>&1; then
        "$RUNPY" -m pip install -q --no-index --no-deps --disable-pip-version-check \
            wheels/*.whl >>"$RESULTS/venv.log" 2>&1 || RUNPY=""
    fi
fi
if [ -z "$RUNPY" ]; then
    say "no working venv with pip ($(tail -n 1 "$RESULTS/venv.log" 2>/dev/null)):" \
        "unpacking wheels/*.whl into .gpu-site/"
    rm -rf "$ROOT/.gpu-site"
    mkdir -p "$ROOT/.gpu-site" || exit 2
    for wheel in wheels/*.whl; do
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
        say "machine with network, for this host's Python: $("$PY" -V 2>&1)) into wheels/"
        exit 2
    fi
done

# -- the GPU tier, bounded -------------------------------------------------------------------
export PYTHONPATH="${SITE}$ROOT" PYTHONUNBUFFERED=1 GPU_CHECK_OUT="$RESULTS/measure.json"
COMMAND="pytest -m gpu -v -rs tests/test_gpu_tier.py"
say "running $COMMAND (bound: ${BOUND}s)"
{
    timeout -k 15 "$BOUND" "$RUNPY" -m pytest -m gpu -v -rs -p no:cacheprovider \
        --junitxml="$RESULTS/junit.xml" tests/test_gpu_tier.py 2>&1
    echo $? >"$RESULTS/rc"
} | tee "$RESULTS/pytest.log"
RC=$(cat "$RESULTS/rc" 2>/dev/null || echo 1)
ELAPSED=$(($(date +%s) - STARTED))

"$RUNPY" scripts/gpu_report.py "$RESULTS" "$DOC" --rc "$RC" --seconds "$ELAPSED" \
    --command "sh scripts/gpu-check.sh ($COMMAND)" || say "writing the report failed"
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
    for f in nvidia-smi.txt pytest.log junit.xml measure.json section.md; do
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
