#!/usr/bin/env bash
# make test: vet, then every test of both modules. Tests that need root (a real containerd) skip
# with a loud SKIPPED line when not root; this script says so again at the end.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
  echo "*** WARNING: not root: the tests against a real containerd and the kubelet GC will SKIP ***" >&2
fi

echo "== go vet"
go vet ./...
(cd test/kubelet && go vet ./...)

echo "== module github.com/k3s-pinning/k3s-pinning"
go test -count=1 -timeout 20m ./...
echo "== module test/kubelet (real kubelet image GC code, k8s.io/kubernetes $(cd test/kubelet && go list -m -f '{{.Version}}' k8s.io/kubernetes))"
(cd test/kubelet && go test -count=1 -timeout 20m ./...)

# Nothing we started may outlive the tests.
if pgrep -f 'k3s-pinning/containerd-.*/containerd --config' >/dev/null; then
  echo "FAIL: a test left a containerd running:" >&2
  pgrep -af 'k3s-pinning/containerd-.*/containerd --config' >&2
  exit 1
fi
if grep -q ' /tmp/ctrd-\| /tmp/k3s-pinning-demo-' /proc/self/mounts; then
  echo "FAIL: a test left mounts behind:" >&2
  grep ' /tmp/ctrd-\| /tmp/k3s-pinning-demo-' /proc/self/mounts >&2
  exit 1
fi
echo "== all tests passed"
