#!/usr/bin/env bash
# make k3s K3S_VERSION=v1.xx.y+k3s1: a k3s binary with k3s-pinning built in, on a machine with
# network access (github.com for the k3s source, the Go module proxy, and what k3s's own build
# scripts download). Steps: check out k3s at K3S_VERSION; apply the patches/k3s series that fits
# it (its CLI major matches the checkout's go.mod, and git apply --check accepts it); require and
# replace our module with this checkout; go mod tidy and go mod vendor; apply patches/kubernetes
# to the vendored kubelet; build with k3s's own scripts (download, build, package-cli) on the
# vendor tree. The work tree is under the user cache dir, never in this repository.
#
# Not run on the project's machines: the k3s module and k3s-io forks are not served there.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
version=${K3S_VERSION:-}
remote=${K3S_REMOTE:-https://github.com/k3s-io/k3s.git}
die() { echo "make k3s: $*" >&2; exit 1; }

[ -n "$version" ] || die "set K3S_VERSION to a k3s release tag, e.g. make k3s K3S_VERSION=v1.35.1+k3s1 (series in patches/k3s: $(cd "$repo/patches/k3s" && ls -d */ | tr -d / | tr '\n' ' '))"
command -v git >/dev/null || die "needs git"

# Fail fast, before any download, when the k3s repository cannot be reached.
if ! timeout 20 git ls-remote --exit-code "$remote" "refs/tags/$version" >/dev/null 2>&1; then
  if timeout 20 git ls-remote "$remote" HEAD >/dev/null 2>&1; then
    die "$remote has no tag $version"
  fi
  die "needs network access: cannot reach $remote (also needed: the Go module proxy and the downloads of k3s's scripts/download). Build on a networked machine, or with Dockerfile.k3s there."
fi

work=${K3S_WORK:-${XDG_CACHE_HOME:-$HOME/.cache}/k3s-pinning/k3s-build/$version}
rm -rf "$work"
mkdir -p "$(dirname "$work")"
echo "== k3s $version into $work"
git clone --quiet --depth 1 --branch "$version" "$remote" "$work"
cd "$work"
git config user.email k3s-pinning@localhost; git config user.name k3s-pinning

# The series: CLI major as in go.mod, and applies cleanly.
if grep -q 'github.com/urfave/cli/v2 ' go.mod; then want_cli=github.com/urfave/cli/v2; else want_cli=github.com/urfave/cli; fi
chosen=""
for dir in "$repo"/patches/k3s/*/; do
  [ "$(sed -n 's/^cli: //p' "$dir/SERIES")" = "$want_cli" ] || continue
  if git apply --check "$dir"/*.patch 2>/dev/null; then chosen=$dir; break; fi
done
[ -n "$chosen" ] || die "k3s $version has no patch series: none in patches/k3s applies to it with $want_cli (series were written against: $(sed -n 's/^k3s-commit: //p' "$repo"/patches/k3s/*/SERIES | tr '\n' ' '))"
echo "== applying patches/k3s/$(basename "$chosen") (written against k3s-io/k3s $(sed -n 's/^k3s-commit: //p' "$chosen/SERIES"))"
git am --quiet "$chosen"/*.patch

echo "== adding github.com/k3s-pinning/k3s-pinning (replaced by $repo), vendoring"
go mod edit -require=github.com/k3s-pinning/k3s-pinning@v0.0.0 -replace=github.com/k3s-pinning/k3s-pinning="$repo"
go mod tidy
go mod vendor
echo "== applying patches/kubernetes to the vendored kubelet"
"$repo/build/apply-kubernetes-patches.sh" vendor/k8s.io/kubernetes

echo "== building as k3s does (scripts/download, scripts/build, scripts/package-cli) on the vendor tree"
export GOFLAGS=-mod=vendor
./scripts/download
./scripts/build
./scripts/package-cli
ls -l dist/artifacts/
echo "== k3s with k3s-pinning: $work/dist/artifacts/k3s"
