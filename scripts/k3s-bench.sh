#!/usr/bin/env bash
# make bench's k3s section: make k3s (K3S_SOURCE, by default the newest k3s line in ../shared/k3s-src)
# with k3s-pinning and the same build without it (K3S_WITHOUT_PINNING=1), make release's amd64
# binary and image archives, then TestK3sBench (test/e2e/k3sbench_test.go): a single k3s server
# node booted on the same generated images dir with k3s-pinning and with --disable-image-pinning,
# the cold boot, the warm restarts and the memory of each, and the sizes, as one table.
# K3S_BENCH_SETS (large,small,huge) and K3S_BENCH_ROUNDS (2) size it; K3S_E2E_BIN and
# K3S_BENCH_STOCK_BIN, bin dirs make k3s built, skip the builds. Needs root (as make k3s-e2e).
set -euo pipefail
cd "$(dirname "$0")/.."
source=${K3S_SOURCE:-$(build/k3s-newest.sh)}
[ -n "$source" ] || { echo "make bench: no K3S_SOURCE and no k3s archive in ../shared/k3s-src" >&2; exit 1; }
# The k3s with k3s-pinning is scripts/k3s-e2e.sh's own build (unless K3S_E2E_BIN is set).
if [ -z "${K3S_BENCH_STOCK_BIN:-}" ]; then
  echo "== make k3s K3S_WITHOUT_PINNING=1 (the same build without k3s-pinning)"
  log=$(mktemp)
  K3S_WITHOUT_PINNING=1 K3S_SOURCE="$source" bash scripts/build-k3s.sh > "$log" 2>&1 || { cat "$log" >&2; rm -f "$log"; exit 1; }
  K3S_BENCH_STOCK_BIN=$(dirname "$(tail -1 "$log")"); rm -f "$log"
fi
release=$(mktemp -d)
trap 'rm -rf "$release"' EXIT
echo "== make release (its amd64 binary and image archives)"
VERSION=bench bash scripts/release.sh > "$release/log" 2>&1 || { cat "$release/log" >&2; exit 1; }
cp dist/k3s-pinning-linux-amd64 dist/k3s-pinning-image-amd64.tar dist/k3s-pinning-image.tar "$release/"
rm -rf dist
export K3S_SOURCE=$source K3S_BENCH_STOCK_BIN K3S_BENCH=1 K3S_BENCH_RELEASE=$release
K3S_E2E_RUN='^TestK3sBench$' K3S_E2E_TIMEOUT=${K3S_E2E_TIMEOUT:-180m} bash scripts/k3s-e2e.sh
