#!/usr/bin/env bash
# make k3s-e2e: build k3s with k3s-pinning in it (make k3s, from K3S_SOURCE, by default the newest
# k3s line in ../shared/k3s-src), then run a real k3s node through the scenarios of
# test/e2e/k3s_test.go, with pinning and with --disable-image-pinning, and print their table.
# K3S_E2E_RUN narrows the tests (go test -run; default every TestK3s* but make bench's
# TestK3sBench); a filter that matches nothing fails (scripts/gotest.sh). K3S_E2E_BIN, a bin dir
# make k3s built, skips the build; K3S_E2E_TIMEOUT is go test's -timeout (30m).
# Needs root, runc, mkfs.ext4 and losetup (.ci/run installs them).
set -euo pipefail
cd "$(dirname "$0")/.."
source=${K3S_SOURCE:-$(build/k3s-newest.sh)}
[ -n "$source" ] || { echo "make k3s-e2e: no K3S_SOURCE and no k3s archive in ../shared/k3s-src" >&2; exit 1; }
if [ -z "${K3S_E2E_BIN:-}" ]; then
  start=$(date +%s)
  log=$(mktemp)
  K3S_SOURCE=$source bash scripts/build-k3s.sh > "$log" 2>&1 || { cat "$log"; rm -f "$log"; exit 1; }
  grep -E '^(== |fork:|stand-in:|offline)' "$log" | grep -v '^fork:' || true   # the decisions that are not k3s's own forks
  bin=$(tail -1 "$log"); rm -f "$log"
  echo "== make k3s: $(( $(date +%s) - start )) s"
  K3S_E2E_BIN=$(dirname "$bin")
  export K3S_E2E_BIN
fi
work=$(build/kubelet-workspace.sh)
cd test/e2e
filter=(-run "${K3S_E2E_RUN:-^TestK3s}")
[ -n "${K3S_E2E_RUN:-}" ] || filter+=(-skip '^TestK3sBench$')
GOWORK=$work bash ../../scripts/gotest.sh --show -mod=vendor -count=1 -timeout "${K3S_E2E_TIMEOUT:-30m}" "${filter[@]}" .
