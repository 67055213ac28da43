#!/usr/bin/env bash
# make test-lines: what make test leaves out to stay within CI's time, for release checks (and
# after a bump of any line): the lines besides the newest.
#  - containerd: the agent's real-containerd tests and the short soak against each older line k3s
#    ships (build/containerd-<line>, each daemon built once from its module into the user cache);
#  - k3s: every k3s tree of ../shared/k3s-src/current besides the newest, built with k3s-pinning
#    (make k3s) and run through make k3s-e2e, with pinning and stock;
#  - kubernetes: make patches-check, patches/kubernetes on every kubelet line (1.34-1.37).
# A line that is missing (no build dir, no k3s tree besides the newest) fails the run, as does a
# skipped or empty suite (scripts/gotest.sh). The end checks for leaks as make test does.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
trap leaks EXIT
require_root "make test-lines"
kubelet_work=$(build/kubelet-workspace.sh)

lines=()
for dir in build/containerd-*/; do
  lines+=("$(basename "$dir" | sed 's/^containerd-//')")
done
[ ${#lines[@]} -gt 0 ] || { echo "FAIL: no build/containerd-<line> directory" >&2; exit 1; }
for line in "${lines[@]}"; do
  phase "containerd $line: the agent's tests and the short soak"
  K3S_PINNING_CONTAINERD=$line bash scripts/gotest.sh -count=1 -timeout 20m ./pkg/agent/...
  soak_log=$(mktemp)
  (cd test/kubelet && K3S_PINNING_CONTAINERD=$line GOWORK=$kubelet_work GOTEST_LOG=$soak_log bash ../../scripts/gotest.sh -mod=vendor -count=1 -timeout 20m -run '^TestSoakShort$' ./soak)
  grep -E 'soak seed|invariant violations' "$soak_log" | sed 's/^ *soak_test.go:[0-9]*: //'
  rm -f "$soak_log"
done

newest=$(build/k3s-newest.sh)
others=()
for archive in ../shared/k3s-src/current/k3s-*.tar.gz; do
  [ -f "$archive" ] && [ "$(realpath "$archive")" != "$(realpath "$newest")" ] && others+=("$archive")
done
[ ${#others[@]} -gt 0 ] || { echo "FAIL: no k3s tree in ../shared/k3s-src/current besides the newest ($newest)" >&2; exit 1; }
for archive in "${others[@]}"; do
  phase "make k3s-e2e K3S_SOURCE=$archive (builds it first)"
  K3S_SOURCE=$archive bash scripts/k3s-e2e.sh
done

phase "make patches-check (patches/kubernetes on kubernetes 1.34-1.37)"
bash scripts/patches-check.sh
