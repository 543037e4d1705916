#!/bin/sh
# Download what scripts/gpu-check.sh needs on a GPU host without network, into wheels/ (ignored
# by git: copy it with the checkout): the proxy's dependencies ([project] dependencies in
# pyproject.toml) and the pinned test runner, built for the GPU host's Python (PYVER, default
# 3.12) on x86-64 Linux; and, for the real allocator check, vLLM 0.33.0's CuMem allocator
# library (cumem_allocator.abi3.so, 27 KB) and vllm/device_allocator/{__init__,alloc_conf,
# cumem}.py, taken out of the vLLM wheel (336 MB, downloaded to a temporary folder and
# deleted) into wheels/vllm-cumem/. Run it on any machine with network, in the checkout.
# torch is not among them: its CUDA build is several GB; the GPU host's own is used.
#
#     PYVER=3.12 sh scripts/gpu-wheels.sh
set -eu
cd "$(dirname "$0")/.."
PYVER=${PYVER:-3.12}
PY=${PYTHON:-python3}
VLLM=${VLLM_VERSION:-0.33.0}
mkdir -p wheels/vllm-cumem
"$PY" -m pip download --only-binary=:all: --python-version "$PYVER" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d wheels \
    'aiohttp>=3.9' 'uvloop>=0.23' 'httptools>=0.6' 'pydantic>=2.5' 'PyYAML>=6' \
    'prometheus-client>=0.19' 'psutil>=5.9' 'nvidia-ml-py>=12' \
    'pytest==9.2.0' 'pytest-asyncio==1.5.0' 'pytest-timeout==2.4.0'

if [ ! -f wheels/vllm-cumem/cumem_allocator.abi3.so ] || [ ! -f wheels/vllm-cumem/cumem.py ]; then
    TMP=$(mktemp -d)
    trap 'rm -rf "$TMP"' EXIT
    "$PY" -m pip download --no-deps --only-binary=:all: --python-version "$PYVER" \
        --implementation cp --platform manylinux_2_28_x86_64 -d "$TMP" "vllm==$VLLM"
    "$PY" - "$TMP"/vllm-*.whl wheels/vllm-cumem <<'EOF'
import sys, zipfile
from pathlib import Path
wheel, out = sys.argv[1], Path(sys.argv[2])
names = {
    "vllm/cumem_allocator.abi3.so": "cumem_allocator.abi3.so",
    "vllm/device_allocator/cumem.py": "cumem.py",
    "vllm/device_allocator/alloc_conf.py": "alloc_conf.py",
    "vllm/device_allocator/__init__.py": "device_allocator_init.py",
    "vllm/_version.py": "vllm_version.py",
}
with zipfile.ZipFile(wheel) as z:
    for member, name in names.items():
        (out / name).write_bytes(z.read(member))
print(f"gpu-wheels: {', '.join(names.values())} from {Path(wheel).name} into {out}")
EOF
fi
echo "gpu-wheels: $(ls wheels/*.whl | wc -l) wheels and wheels/vllm-cumem/, $(du -sh wheels | cut -f1) in wheels/ for Python $PYVER (copy wheels/ with the checkout)"
