#!/bin/sh
# Debian packages the test suite and the benchmarks need:
#   chromium    the status page test (headless screenshot and DOM)
#   prometheus  the scrape test against /metrics
#   systemd     systemd-analyze, for the unit file test
#   haproxy     the cluster tier (tests/cluster/test_cluster.py: HAProxy in front of three proxies)
#   nginx, wrk  the benchmarks
#   stress-ng   `make test-busy` (the suite with one core kept busy)
# Idempotent: nothing is installed when every binary is already there.
set -eu

# binary:package pairs
DEPS="/usr/bin/chromium:chromium /usr/bin/prometheus:prometheus /usr/bin/systemd-analyze:systemd
      /usr/sbin/haproxy:haproxy /usr/sbin/nginx:nginx /usr/bin/wrk:wrk
      /usr/bin/stress-ng:stress-ng"

missing=""
for dep in $DEPS; do
    bin=${dep%%:*}
    pkg=${dep#*:}
    if [ -x "$bin" ]; then
        echo "system-deps: $pkg: present ($bin)"
    else
        echo "system-deps: $pkg: missing ($bin)"
        missing="$missing $pkg"
    fi
done

if [ -z "$missing" ]; then
    echo "system-deps: all present, nothing to install"
    exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
    echo "system-deps: not root; install these packages first:$missing" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "system-deps: apt-get not found; install these packages first:$missing" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
echo "system-deps: apt-get update"
if ! apt-get update -q; then
    echo "system-deps: apt-get update failed" >&2
    exit 1
fi
echo "system-deps: apt-get install -y --no-install-recommends$missing"
# shellcheck disable=SC2086  # word splitting of the package list is intended
if ! apt-get install -y -q --no-install-recommends $missing; then
    echo "system-deps: apt-get install failed:$missing" >&2
    exit 1
fi

failed=""
for dep in $DEPS; do
    bin=${dep%%:*}
    pkg=${dep#*:}
    [ -x "$bin" ] || failed="$failed $pkg"
done
if [ -n "$failed" ]; then
    echo "system-deps: still missing after install:$failed" >&2
    exit 1
fi
echo "system-deps: installed$missing"
