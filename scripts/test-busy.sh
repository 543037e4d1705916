#!/usr/bin/env bash
# `make test-busy`: the suite with one core kept busy by another program (stress-ng), as on a
# shared CI runner or a workstation that is compiling meanwhile. Every wait in a test must hold
# there; a test that fails only here has a bound that holds only on an idle machine.
#   bash scripts/test-busy.sh [make target]      (default: test)
set -euo pipefail
if ! command -v stress-ng >/dev/null 2>&1; then
    echo "test-busy: stress-ng is missing (apt-get install stress-ng)" >&2
    exit 1
fi
# In a session of its own, so that the whole group (stress-ng and its worker) goes at the end;
# the timeout is a backstop should this script itself be killed.
setsid stress-ng --cpu 1 --cpu-method matrixprod --timeout 3h --quiet &
hog=$!
trap 'kill -TERM -- -$hog 2>/dev/null; wait $hog 2>/dev/null || true' EXIT INT TERM
start=$(date +%s)
status=0
make "${1:-test}" || status=$?
echo "test-busy: make ${1:-test} with one core busy: exit $status after $(( $(date +%s) - start )) s"
exit $status
