#!/usr/bin/env bash
# make test: vet, every test of the modules, the short soak, the fuzz targets, make e2e, make
# k3s-e2e on two k3s lines (a real k3s built with k3s-pinning, from ../shared/k3s-src), make
# cluster-e2e on the newest (a server and two agents), and, in the background beside them, the
# cross-build check and make release with its artifacts checked. Tests that need root
# (a real containerd) skip with a loud SKIPPED line when not root; this script says so again.
# Whatever fails, the end checks that no test left a containerd or a mount behind.
set -euo pipefail
cd "$(dirname "$0")/.."
# Each phase's header says how far into the run it starts (a cold CI run must stay within budget).
t0=$(date +%s)
phase() { echo "== [$(( $(date +%s) - t0 )) s] $*"; }

# A /run/k3s that was there before (a k3s of the machine) is not the tests' to judge.
had_run_k3s=$([ -e /run/k3s ] && echo yes || echo no)
# The host paths the cluster e2e mounts over in its nodes' namespaces: those absent now must be
# absent at the end (it creates them as mount points and removes them).
cluster_paths=()
for p in /var/lib/rancher /var/lib/kubelet /var/log/pods /var/log/containers /etc/rancher /var/lib/cni; do
  [ -e "$p" ] || cluster_paths+=("$p")
done

# leaks [rc]: the exit code so far is $? (as the EXIT trap), or the argument when a trap that ran
# commands first passes it on.
leaks() {
  local rc=${1:-$?}
  if pgrep -f 'k3s-pinning/containerd-.*/containerd --config' >/dev/null; then
    echo "FAIL: a test left a containerd running:" >&2
    pgrep -af 'k3s-pinning/containerd-.*/containerd --config' >&2
    rc=1
  fi
  if grep -q ' /tmp/ctrd-\| /tmp/k3s-pinning-demo-\| /tmp/k3s-pinning-e2e-\| /tmp/k3s-pinning-soak-' /proc/self/mounts; then
    echo "FAIL: a test left mounts behind:" >&2
    grep ' /tmp/ctrd-\| /tmp/k3s-pinning-demo-\| /tmp/k3s-pinning-e2e-\| /tmp/k3s-pinning-soak-' /proc/self/mounts >&2
    rc=1
  fi
  if losetup -a 2>/dev/null | grep -q 'k3s-pinning-e2e-\|k3s-pinning-k3s-e2e-\|k3s-pinning-cluster-e2e-'; then
    echo "FAIL: a test left a loop device behind:" >&2
    losetup -a | grep 'k3s-pinning-e2e-\|k3s-pinning-k3s-e2e-\|k3s-pinning-cluster-e2e-' >&2
    rc=1
  fi
  # A pod's processes outlive a shim killed with SIGKILL; they hold the node's ext4 (and so its
  # loop device) in their mount namespace.
  local left
  left=$(find /sys/fs/cgroup -path '*kubepods*' -name cgroup.procs -exec cat {} + 2>/dev/null | sort -u | tr '\n' ' ')
  if [ -n "${left// /}" ]; then
    echo "FAIL: a test left pod processes in the kubelet's cgroups: $left" >&2
    ps -o pid,etime,cmd -p "$(xargs <<<"$left" | tr " " ",")" >&2 || true
    rc=1
  fi
  if pgrep -f 'k3s-pinning/e2e/e2e-node' >/dev/null; then
    echo "FAIL: a test left a kubelet (e2e-node) running" >&2
    rc=1
  fi
  if pgrep -f 'k3s-build/.*/bin/k3s (server|agent)' >/dev/null || { [ "$had_run_k3s" = no ] && [ -e /run/k3s ]; } || grep -q ' /run/k3s/\| /tmp/k3s-pinning-k3s-e2e-\| /tmp/k3s-pinning-cluster-e2e-' /proc/self/mounts; then
    echo "FAIL: the k3s e2e left k3s, /run/k3s or a mount behind:" >&2
    pgrep -af 'k3s-build/.*/bin/k3s (server|agent)' >&2 || true
    grep ' /run/k3s/\| /tmp/k3s-pinning-k3s-e2e-\| /tmp/k3s-pinning-cluster-e2e-' /proc/self/mounts >&2 || true
    rc=1
  fi
  # The cluster e2e's network namespaces (k3spPID-*) and its kubelets' cgroup roots (k3sp-NODE).
  if ip netns list 2>/dev/null | grep -q '^k3sp[0-9]*-' || compgen -G '/sys/fs/cgroup/*/k3sp-*' >/dev/null; then
    echo "FAIL: the cluster e2e left network namespaces or cgroups behind:" >&2
    ip netns list 2>/dev/null | grep '^k3sp[0-9]*-' >&2 || true
    compgen -G '/sys/fs/cgroup/*/k3sp-*' >&2 || true
    rc=1
  fi
  for p in "${cluster_paths[@]}"; do
    if [ -e "$p" ]; then
      echo "FAIL: a test left $p behind (absent when make test started)" >&2
      rc=1
    fi
  done
  [ "$rc" -eq 0 ] && echo "== all tests passed ($(( $(date +%s) - t0 )) s)"
  exit "$rc"
}
trap leaks EXIT

if [ "$(id -u)" != 0 ]; then
  echo "*** WARNING: not root: the tests against a real containerd and the kubelet GC will SKIP ***" >&2
fi

# A cold run writes about 20 GiB (the cold .ci/run of 7ab989b: GOCACHE 16 GiB, GOMODCACHE 3.3 GiB,
# the user cache 1.1 GiB) and builds in TMPDIR; a full disk shows up late, as "no space left on
# device" in the middle of the k3s build. Say it first, with the figures.
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
go test -count=1 -timeout 20m ./...
phase "module test/kubelet (real kubelet image GC code, k8s.io/kubernetes $(cd test/kubelet && go list -m -f '{{.Version}}' k8s.io/kubernetes), patched)"
(cd test/kubelet && GOWORK=$kubelet_work go test -mod=vendor -count=1 -timeout 20m -skip TestSoakShort ./...)

phase "short soak: 40 seeded random faults against a real containerd (make soak runs the long one)"
if ! soak=$(cd test/kubelet && GOWORK=$kubelet_work go test -mod=vendor -count=1 -timeout 20m -v -run TestSoakShort ./soak 2>&1); then
  echo "$soak"
  exit 1
fi
grep -E 'soak seed|SKIPPED|soak_test.go:[0-9]+:   [a-z-]+ +[0-9]+$|invariant violations' <<<"$soak" | sed 's/^ *soak_test.go:[0-9]*: //'


# The containerd lines k3s ships besides the newest: each daemon built once from its module
# (build/containerd-<line>) into the user cache, then the agent's real-containerd tests and the
# short soak against it.
for line in $(sed -n 's/^var Matrix = \[\]string{\(.*\)}$/\1/p' pkg/containerdtest/containerdtest.go | tr -d '",'); do
  phase "containerd $line (the matrix): the agent's tests and the short soak"
  K3S_PINNING_CONTAINERD=$line go test -count=1 -timeout 20m ./pkg/agent/images
  if ! soak=$(cd test/kubelet && K3S_PINNING_CONTAINERD=$line GOWORK=$kubelet_work go test -mod=vendor -count=1 -timeout 20m -v -run TestSoakShort ./soak 2>&1); then
    echo "$soak"
    exit 1
  fi
  grep -E 'soak seed|SKIPPED|invariant violations' <<<"$soak" | sed 's/^ *soak_test.go:[0-9]*: //'
done

phase "fuzz targets, 5 s each (make fuzz runs them longer)"
FUZZTIME=5s bash scripts/fuzz.sh

phase "make k3s-patches-check (patches/k3s series well formed; make k3s fails fast offline)"
bash scripts/k3s-patches-check.sh

# What is left is mostly waiting (kubelets and k3s nodes under disk pressure) and compiling (two
# k3s lines, and the four platforms of the cross-build check and make release), so the compiles run
# in the background, in one session of their own with two queues:
#  - the k3s builds, one after the other: the newest line (beside make e2e, then alone), then
#    release-1.34 at 75826e8af (k3s PR 14266 in it) while the newest line's node runs;
#  - the cross-build check, then make release with its check, at nice 19 inside the session: they
#    take the cores only when the k3s builds leave them (fetching modules, linking) and, mostly,
#    beside release-1.34's node, the end of the run, when the cores were idle (seen: 64-99% idle).
# Not from the start of make test: a cold run that started the k3s builds there took longer (the
# phases ran slower beside the compiles than the waits they filled). setsid makes the session, so a
# failed run stops all of it (its go and compile processes too) before the leak check; each job's
# exit code lands in $bg/JOB.rc, its output in $bg/JOB.log.
k3s_newest=$(build/k3s-newest.sh)
k3s_134=../shared/k3s-src/current/k3s-release-1.34-75826e8af.tar.gz
k3s_sources=("$k3s_newest")
if [ -f "$k3s_134" ]; then
  k3s_sources+=("$k3s_134")
else
  echo "*** WARNING: $k3s_134 is not here: make k3s-e2e runs on the newest line only ***" >&2
fi
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
  n=0
  for source; do
    n=$((n + 1))
    run "k3s-$n" env K3S_SOURCE="$source" nice -n "$k3s_nice" bash scripts/build-k3s.sh
  done
  wait' background "$bg" "${k3s_sources[@]}" &
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
# k3s_build_wait N SOURCE: waits for the Nth k3s build, prints its decisions (stand-ins) on stderr
# and the directory of its binaries on stdout.
k3s_build_wait() {
  bg_wait "k3s-$1" "make k3s K3S_SOURCE=$2"
  grep -E '^(== |stand-in:)' "$bg/k3s-$1.log" >&2 || true
  dirname "$(tail -1 "$bg/k3s-$1.log")"
}

phase "make e2e (a real kubelet under real disk pressure; the background jobs have started)"
bash scripts/e2e.sh

phase "make k3s ($k3s_newest): waiting for its build"
newest_bin=$(k3s_build_wait 1 "$k3s_newest")
bg_failed
phase "make k3s-e2e ($k3s_newest: a real k3s node under real disk pressure, with k3s-pinning and stock)"
K3S_E2E_BIN=$newest_bin bash scripts/k3s-e2e.sh
# The cluster runs while release-1.34 compiles in the background, as master's node did.
phase "make cluster-e2e ($k3s_newest: a server and two agents in namespaces of their own, with k3s's flannel)"
K3S_E2E_BIN=$newest_bin bash scripts/cluster-e2e.sh
if [ -f "$k3s_134" ]; then
  phase "make k3s K3S_SOURCE=$k3s_134: waiting for its build"
  bin_134=$(k3s_build_wait 2 "$k3s_134")
  bg_failed
  # Every scenario once, with k3s-pinning (the stock column, the wrapper, bad-flag and daemon tests
  # ran on the newest line above; make k3s-e2e K3S_SOURCE=... runs both columns on this line).
  phase "make k3s-e2e K3S_SOURCE=$k3s_134 K3S_E2E_RUN='^TestK3sNode\$/^with-k3s-pinning\$'"
  K3S_E2E_BIN=$bin_134 K3S_E2E_RUN='^TestK3sNode$/^with-k3s-pinning$' bash scripts/k3s-e2e.sh
fi

phase "the packages k3s imports build for every platform k3s builds agents for (in the background since make e2e)"
bg_wait cross "the cross-build check"
cat "$bg/cross.log"
phase "make release, its artifacts checked from outside (binaries, .deb installed and purged, .rpm, install.sh; in the background after the cross-build check)"
bg_wait release "make release's check"
cat "$bg/release.log"

# patches/kubernetes is compiled and run on kubernetes 1.36 and 1.34 inside the k3s above, and on 1.37 by
# test/kubelet and make e2e; make patches-check checks all four lines (1.34-1.37) and is not in
# make test, to keep a cold .ci/run within CI's time with the k3s build and make release in it.
