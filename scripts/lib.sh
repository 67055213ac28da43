# shellcheck shell=bash
# Sourced by scripts/test.sh (make test) and scripts/test-lines.sh (make test-lines): the phase
# headers, the refusal to run the real suites without root, and the check at the end that no test
# left a containerd, kubelet, k3s, mount, loop device, namespace or path behind.

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

# require_root: the real suites (containerd, the kubelet, k3s) need root; without it they would
# skip, and a run that skipped them proves nothing. make unit runs what needs no root.
require_root() {
  if [ "$(id -u)" != 0 ]; then
    echo "FAIL: not root: $1 runs the tests against a real containerd, the kubelet and k3s, which need root (make unit runs the tests that do not)" >&2
    exit 1
  fi
}
