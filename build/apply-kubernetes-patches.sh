#!/usr/bin/env bash
# Apply patches/kubernetes/*.patch, in name order, to a k8s.io/kubernetes source tree: a checkout,
# or the vendor/k8s.io/kubernetes dir of a `go mod vendor` tree. Every hunk must match its context
# exactly (git apply: offsets allowed, no fuzz). A patch already applied is skipped, so running
# this twice is harmless.
#
#   build/apply-kubernetes-patches.sh <kubernetes-tree>
set -euo pipefail
tree=${1:?usage: $0 <k8s.io/kubernetes tree, e.g. vendor/k8s.io/kubernetes>}
patches=$(cd "$(dirname "$0")/../patches/kubernetes" && pwd)
if [ ! -f "$tree/pkg/kubelet/images/image_gc_manager.go" ]; then
  echo "$tree: no pkg/kubelet/images/image_gc_manager.go: not a k8s.io/kubernetes tree (did go mod vendor run?)" >&2
  exit 1
fi
tree=$(cd "$tree" && pwd)
# git apply takes paths from the top of the repository it runs in: keep it from finding the one a
# vendor tree sits in (a k3s checkout), so that paths are relative to the kubernetes tree.
export GIT_CEILING_DIRECTORIES=$(dirname "$tree")
cd "$tree"
for p in "$patches"/*.patch; do
  if git apply --check "$p" 2>/dev/null; then
    git apply "$p"
  elif git apply --check --reverse "$p" 2>/dev/null; then
    echo "$tree: $(basename "$p") is already applied" >&2
  else
    echo "$tree: $(basename "$p") does not apply:" >&2
    git apply --check "$p" >&2 || true
    exit 1
  fi
done
