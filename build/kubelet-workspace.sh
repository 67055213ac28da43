#!/usr/bin/env bash
# Prepare the build of test/kubelet and test/e2e against k8s.io/kubernetes vendored and patched with
# patches/kubernetes (the Go -overlay flag refuses files in the module cache, so the patched
# kubelet is built from a vendor tree). Prints the path of a go.work to build with:
#
#   GOWORK=$(build/kubelet-workspace.sh) go test -mod=vendor ./...     (in test/kubelet)
#
# The workspace and its vendor tree live in the user cache dir, one per checkout, never in the
# repository. It is vendored again on every call (a few seconds): the vendor tree holds a copy of
# this repository's packages, which must be current.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
modules=("$root/test/kubelet" "$root/test/e2e")
ws=${XDG_CACHE_HOME:-$HOME/.cache}/k3s-pinning/kubelet-workspace-$(printf %s "$root" | sha256sum | cut -c1-12)
mkdir -p "$ws"
exec 9>"$ws/.lock"
flock 9
goversion=$(cat "${modules[@]/%//go.mod}" | sed -n 's/^go \([0-9.]*\)$/\1/p' | sort -V | tail -1)
{
  printf 'go %s\n\nuse (\n' "$goversion"
  printf '\t%s\n' "${modules[@]}"
  printf ')\n'
} >"$ws/go.work"
if ! out=$(cd "$ws" && GOWORK="$ws/go.work" GOFLAGS=-mod=mod go work vendor 2>&1); then
  echo "go work vendor for ${modules[*]} failed:" >&2
  echo "$out" >&2
  exit 1
fi
"$root/build/apply-kubernetes-patches.sh" "$ws/vendor/k8s.io/kubernetes"
echo "$ws/go.work"
