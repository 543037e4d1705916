#!/bin/sh
# Download the wheels scripts/gpu-check.sh installs on a GPU host without network: the
# proxy's dependencies ([project] dependencies in pyproject.toml) and the pinned test runner,
# built for the GPU host's Python (PYVER, default 3.12) on x86-64 Linux, into wheels/ (ignored
# by git). Run it on any machine with network, in the checkout, then copy the checkout over.
# torch is not among them: its CUDA build is several GB; the GPU host's own is used.
#
#     PYVER=3.12 sh scripts/gpu-wheels.sh
set -eu
cd "$(dirname "$0")/.."
PYVER=${PYVER:-3.12}
PY=${PYTHON:-python3}
mkdir -p wheels
"$PY" -m pip download --only-binary=:all: --python-version "$PYVER" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d wheels \
    'aiohttp>=3.9' 'uvloop>=0.23' 'httptools>=0.6' 'pydantic>=2.5' 'PyYAML>=6' \
    'prometheus-client>=0.19' 'psutil>=5.9' 'nvidia-ml-py>=12' \
    'pytest==9.2.0' 'pytest-asyncio==1.5.0' 'pytest-timeout==2.4.0'
echo "gpu-wheels: $(ls wheels/*.whl | wc -l) wheels, $(du -sh wheels | cut -f1) in wheels/ for Python $PYVER"
