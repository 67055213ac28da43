#!/usr/bin/env bash
# make test: vet, every test of the modules (the real containerd, the real kubelet GC code), the
# short soak, the fuzz targets, the k3s series checked against every k3s tree, make e2e, and
# make k3s-e2e and make cluster-e2e on the newest k3s line (a real k3s built with k3s-pinning,
# from ../shared/k3s-src); in the background beside them, the cross-build check and make release
# with its artifacts checked. The other lines (containerd's, k3s's, the kubelet's) are make
# test-lines. Every go test runs through scripts/gotest.sh: a skipped test, or a filter that
# matches nothing, fails the run. Whatever fails, the end checks that no test left a containerd,
# a mount, a namespace or a process behind.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
trap leaks EXIT
require_root "make test"

# A cold run writes about 20 GiB of Go caches (docs/testing.md) and builds in TMPDIR; a full disk
# shows up late, as "no space left on device" in the middle of the k3s build. Say it first.
free_gib() { df -Pk "$1" 2>/dev/null | awk 'NR==2 {print int($4/1048576)}'; }
for dir in "$(go env GOCACHE)" "$(go env GOMODCACHE)" "${TMPDIR:-/tmp}"; do
  mkdir -p "$dir"
  free=$(free_gib "$dir")
  if [ -n "$free" ] && [ "$free" -lt 25 ]; then
    echo "*** WARNING: $free GiB free on the filesystem of $dir; a cold make test writes about 20 GiB of Go caches and builds in ${TMPDIR:-/tmp} ***" >&2
  fi
done

phase "go vet"
go vet ./...
# test/kubelet builds against k8s.io/kubernetes vendored and patched with patches/kubernetes.
kubelet_work=$(build/kubelet-workspace.sh)
(cd test/kubelet && GOWORK=$kubelet_work go vet -mod=vendor ./...)
(cd test/e2e && GOWORK=$kubelet_work go vet -mod=vendor ./...)

phase "module github.com/k3s-pinning/k3s-pinning"
bash scripts/gotest.sh -count=1 -timeout 20m ./...
phase "module test/kubelet (real kubelet image GC code, k8s.io/kubernetes $(cd test/kubelet && go list -m -f '{{.Version}}' k8s.io/kubernetes), patched), with the short soak: 40 seeded random faults against a real containerd (make soak runs the long one)"
soak_log=$(mktemp)
(cd test/kubelet && GOWORK=$kubelet_work GOTEST_LOG=$soak_log bash ../../scripts/gotest.sh -mod=vendor -count=1 -timeout 20m ./...)
grep -E 'soak seed|soak_test.go:[0-9]+:   [a-z-]+ +[0-9]+$|invariant violations' "$soak_log" | sed 's/^ *soak_test.go:[0-9]*: //'
rm -f "$soak_log"

phase "fuzz targets, 5 s each (make fuzz runs them longer)"
FUZZTIME=5s bash scripts/fuzz.sh

phase "make k3s-patches-check (every patches/k3s series well formed and applying to every k3s tree; make k3s fails fast offline)"
bash scripts/k3s-patches-check.sh

# What is left is mostly waiting (kubelets and k3s nodes under disk pressure) and compiling (k3s,
# and the four platforms of the cross-build check and make release), so the compiles run in the
# background, in one session of their own with two queues:
#  - the k3s build of the newest line, beside make e2e;
#  - the cross-build check, then make release with its check, at nice 19 inside the session: they
#    take the cores only when the k3s build leaves them (fetching modules, linking) and, mostly,
#    beside the k3s nodes, whose work is waiting.
# Not from the start of make test: a cold run that started the k3s builds there took longer (the
# phases ran slower beside the compiles than the waits they filled). setsid makes the session, so a
# failed run stops all of it (its go and compile processes too) before the leak check; each job's
# exit code lands in $bg/JOB.rc, its output in $bg/JOB.log.
k3s_newest=$(build/k3s-newest.sh)
[ -n "$k3s_newest" ] || { echo "FAIL: no k3s archive in ../shared/k3s-src: make test builds and runs the newest k3s line" >&2; exit 1; }
bg=$(mktemp -d)
# Under the kernel's autogroup scheduling (/proc/sys/kernel/sched_autogroup_enabled, on here)
# sessions share the cores equally whatever their processes' nice: so the session itself gets nice
# 19, from inside (no race with setsid); inside it, nice orders the two queues. Seen in a cold run
# without it: nice-19 compiles took an equal share beside go vet. Without autogroup scheduling
# every process competes on its own nice: the k3s builds then get 10, below the foreground's 0.
# shellcheck disable=SC2016 # the script's own arguments
setsid bash -c 'k3s_nice=10
  if [ "$(cat /proc/sys/kernel/sched_autogroup_enabled 2>/dev/null)" = 1 ] && echo 19 > /proc/self/autogroup 2>/dev/null; then k3s_nice=0; fi
  dir=$1; shift
  run() { local rc=0; "${@:2}" > "$dir/$1.log" 2>&1 || rc=$?; echo "$rc" > "$dir/$1.rc"; }
  ( run cross nice -n 19 bash scripts/cross-check.sh
    run release nice -n 19 bash scripts/release-check.sh ) &
  run k3s env K3S_SOURCE="$1" nice -n "$k3s_nice" bash scripts/build-k3s.sh
  wait' background "$bg" "$k3s_newest" &
builder=$!
# Under set -e every command of an EXIT trap must succeed (a failing one would end the script with
# its status and skip the leak check): the jobs have usually ended, and kill then fails.
stop_background() {
  local rc=$?
  kill -- -"$builder" 2>/dev/null || true
  wait "$builder" 2>/dev/null || true
  rm -rf "$bg"
  leaks "$rc"
}
trap stop_background EXIT
# bg_failed: a background job that already failed ends the run now, with its log, rather than at
# its turn.
bg_failed() {
  local rc_file
  for rc_file in "$bg"/*.rc; do
    if [ ! -f "$rc_file" ] || [ "$(cat "$rc_file")" = 0 ]; then continue; fi
    cat "${rc_file%.rc}.log" >&2
    echo "FAIL: $(basename "${rc_file%.rc}") (in the background) failed" >&2
    exit 1
  done
}
# bg_wait JOB WHAT: waits for a background job; a failed one prints its log and ends the run.
bg_wait() {
  local rc_file=$bg/$1.rc
  while [ ! -f "$rc_file" ]; do
    bg_failed
    # rc_file again: the session may have written it and exited since the loop's test.
    if ! kill -0 "$builder" 2>/dev/null && [ ! -f "$rc_file" ]; then
      cat "$bg/$1.log" >&2 2>/dev/null || true
      echo "FAIL: the background jobs ended before $2 finished" >&2
      exit 1
    fi
    sleep 2
  done
  if [ "$(cat "$rc_file")" != 0 ]; then
    cat "$bg/$1.log" >&2
    echo "FAIL: $2 failed" >&2
    exit 1
  fi
}

phase "make e2e (a real kubelet under real disk pressure; the background jobs have started)"
bash scripts/e2e.sh

phase "make k3s ($k3s_newest): waiting for its build"
bg_wait k3s "make k3s K3S_SOURCE=$k3s_newest"
grep -E '^(== |stand-in:)' "$bg/k3s.log" || true   # the decisions that are not k3s's own forks
newest_bin=$(dirname "$(tail -1 "$bg/k3s.log")")
bg_failed
phase "make k3s-e2e ($k3s_newest: a real k3s node under real disk pressure, with k3s-pinning and stock)"
K3S_E2E_BIN=$newest_bin bash scripts/k3s-e2e.sh
phase "make cluster-e2e ($k3s_newest: a server and two agents in namespaces of their own, with k3s's flannel)"
K3S_E2E_BIN=$newest_bin bash scripts/cluster-e2e.sh

phase "the packages k3s imports build for every platform k3s builds agents for (in the background since make e2e)"
bg_wait cross "the cross-build check"
cat "$bg/cross.log"
phase "make release, its artifacts checked from outside (binaries, .deb installed and purged, .rpm, install.sh; in the background after the cross-build check)"
bg_wait release "make release's check"
cat "$bg/release.log"

# The other lines (containerd 1.7 and 2.1, k3s release-1.34, kubernetes 1.34-1.37 with
# patches/kubernetes) are make test-lines, for release checks: make test stays within CI's time.
