#!/usr/bin/env bash
# make k3s: a k3s binary with k3s-pinning built in.
#
#   make k3s                                  (here: k3s master 469d009fb, ../shared/k3s-src/current)
#   make k3s K3S_SOURCE=../shared/k3s-src/current/k3s-release-1.34-75826e8af.tar.gz
#   make k3s K3S_SOURCE=/path/to/a/k3s/checkout
#   make k3s K3S_VERSION=v1.34.3+k3s1                                         (networked machine)
#
# Steps, in order:
#  1. the k3s tree: unpacked from K3S_SOURCE (an archive or a tree) or cloned at K3S_VERSION, into
#     the user cache dir (never into this repository), as a git repository so patches apply.
#  2. from a tree or archive (K3S_SOURCE without K3S_ONLINE=1): every github.com/k3s-io fork that
#     k3s's go.mod replaces is used wherever the module proxy serves it; a fork it refuses is
#     substituted by its upstream module, with the patches/k3s-offline patch that stand-in needs
#     (build/k3s-forks.sh asks the proxy at every build and prints each decision). k8s.io/kubernetes
#     is a local copy with patches/kubernetes. A networked build (K3S_VERSION) uses k3s's own scripts.
#  3. the versions k3s selects are recorded, github.com/k3s-pinning/k3s-pinning is added (replaced
#     by this checkout), and the build fails, naming the module, if that changed any version k3s
#     selected (build/k3s-versions-check.sh).
#  4. the patches/k3s series that applies (git apply --check, in the order of patches/k3s/SERIES
#     dirs: newest line first) is applied; patches/kubernetes goes into the kubelet k3s builds.
#  5. go build ./cmd/server with k3s's build tags and version flags (scripts/build's), plus the
#     containerd shim from the containerd module k3s selects; k3s's multicall links beside it.
#
# Prints the binary's path last. K3S_BUILD_TAGS_EXTRA adds tags (no_cri_dockerd is added when an empty
# module stands in for a refused cri-dockerd fork). K3S_WITHOUT_PINNING=1 builds the same k3s without
# k3s-pinning (no module, no patches/k3s series, no patches/kubernetes; into <name>-stock): make
# bench's anchor for the size of the binary.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
die() { echo "make k3s: $*" >&2; exit 1; }
source=${K3S_SOURCE:-}
version=${K3S_VERSION:-}
cache=${XDG_CACHE_HOME:-$HOME/.cache}/k3s-pinning

[ -n "$source$version" ] || die "set K3S_SOURCE to a k3s tree or archive (here: $(ls "$repo"/../shared/k3s-src/k3s-*.tar.gz 2>/dev/null | tr '\n' ' ')) or K3S_VERSION to a k3s release tag on a networked machine"
command -v git >/dev/null || die "needs git"
command -v go >/dev/null || die "needs go"
export GOFLAGS=-mod=mod GOWORK=off
export GIT_CONFIG_GLOBAL=/dev/null

# 1. The tree.
if [ -n "$source" ]; then
  [ -e "$source" ] || die "K3S_SOURCE=$source: no such file or directory"
  source=$(cd "$(dirname "$source")" && pwd)/$(basename "$source")
  name=$(basename "$source"); name=${name%.tar.gz}; name=${name%.tgz}
  offline=1; [ "${K3S_ONLINE:-}" = 1 ] && offline=""
else
  name=$version; offline=""
fi
stock=""; [ "${K3S_WITHOUT_PINNING:-}" = 1 ] && stock=1 && export K3S_WITHOUT_PINNING
work=${K3S_WORK:-$cache/k3s-build/$name${stock:+-stock}}
src=$work/k3s
rm -rf "$src"; mkdir -p "$work"
if [ -n "$source" ] && [ -f "$source" ]; then
  echo "== k3s from $source into $src"
  tmp=$(mktemp -d "$work/unpack.XXXXXX")
  tar -xzf "$source" -C "$tmp" || die "$source: not a tar.gz archive"
  top=$(find "$tmp" -mindepth 1 -maxdepth 1 -type d | head -1)
  [ -f "$top/go.mod" ] && grep -q '^module github.com/k3s-io/k3s' "$top/go.mod" || die "$source: no k3s go.mod at its top directory"
  mv "$top" "$src"; rm -rf "$tmp"
elif [ -n "$source" ]; then
  [ -f "$source/go.mod" ] && grep -q '^module github.com/k3s-io/k3s' "$source/go.mod" || die "$source: not a k3s tree (no go.mod of github.com/k3s-io/k3s)"
  echo "== k3s from $source into $src"
  mkdir -p "$src"; (cd "$source" && git ls-files -z 2>/dev/null | xargs -0 -I{} cp --parents {} "$src" 2>/dev/null) || cp -a "$source/." "$src"
else
  remote=${K3S_REMOTE:-https://github.com/k3s-io/k3s.git}
  if ! timeout 20 git ls-remote --exit-code "$remote" "refs/tags/$version" >/dev/null 2>&1; then
    if timeout 20 git ls-remote "$remote" HEAD >/dev/null 2>&1; then die "$remote has no tag $version"; fi
    die "needs network access: cannot reach $remote. Offline, build from a k3s tree or archive: make k3s K3S_SOURCE=..."
  fi
  echo "== k3s $version from $remote into $src"
  git clone --quiet --depth 1 --branch "$version" "$remote" "$src"
fi
cd "$src"
if [ ! -d .git ]; then git init -q; git add -A; git -c user.email=k3s-pinning@localhost -c user.name=k3s-pinning commit -qm "k3s as given"; fi
git config user.email k3s-pinning@localhost; git config user.name k3s-pinning
# The kubernetes k3s builds: its replace of k8s.io/kubernetes (the fork, less -k3sN) wins over
# the version its require names.
k8s_version=$(go mod edit -json | python3 -c '
import json, re, sys
m = json.load(sys.stdin)
v = [r["Version"] for r in m["Require"] if r["Path"] == "k8s.io/kubernetes"][0]
v = next((r["New"].get("Version") or v for r in m.get("Replace") or [] if r["Old"]["Path"] == "k8s.io/kubernetes"), v)
print(re.sub(r"-k3s[0-9.]*$", "", v))')
echo "== k3s tree: $(sed -n 's/^go //p' go.mod | head -1) go directive, kubernetes $k8s_version"

# 2. The forks k3s's go.mod replaces: k3s's own where the proxy serves them, stand-ins elsewhere.
tags_extra=${K3S_BUILD_TAGS_EXTRA:-}
if [ -n "$offline" ]; then
  K3S_SRC_DIR=${K3S_SRC_DIR:-$repo/../shared/k3s-src} "$repo/build/k3s-forks.sh" "$src" "$work/standins"
  # An empty module stands in for a refused cri-dockerd fork: build without it, as k3s can.
  if grep -q '^github.com/k3s-io/cri-dockerd@' "$work/standins/standins"; then tags_extra="$tags_extra no_cri_dockerd"; fi
fi

# k3s's scripts/build copies these before compiling; its charts come from scripts/download, which
# needs the network: an empty static dir builds (the bundled charts are then absent, and the node
# disables those components).
mkdir -p pkg/deploy/embed pkg/static/embed
cp -a manifests/* pkg/deploy/embed/
[ -n "$(ls -A pkg/static/embed)" ] || echo "k3s-pinning offline build: no bundled charts" > pkg/static/embed/README

# 3. Versions, before and after adding the module (with the go directive: a module that needs a
# newer Go raises it).
versions() { { echo "go $(go mod edit -json | python3 -c 'import json,sys; print(json.load(sys.stdin)["Go"])')"; go list -m -e all; } > "$1" 2>"$work/go-list.err" || { cat "$work/go-list.err" >&2; die "go list -m -e all failed on the k3s tree"; }; }
versions "$work/versions-k3s.txt"
if [ -n "$stock" ]; then
  cp "$work/versions-k3s.txt" "$work/versions-with-k3s-pinning.txt" # what step 5 reads
else
go mod edit -require=github.com/k3s-pinning/k3s-pinning@v0.0.0 -replace=github.com/k3s-pinning/k3s-pinning="$repo"
versions "$work/versions-with-k3s-pinning.txt"
"$repo/build/k3s-versions-check.sh" "$work/versions-k3s.txt" "$work/versions-with-k3s-pinning.txt"
fi

# 4. Our series: the first (newest line first) that applies.
tags="ctrd netcgo osusergo providerless urfave_cli_no_docs sqlite_omit_load_extension apparmor seccomp $tags_extra"
if [ -n "$stock" ]; then
  echo "== K3S_WITHOUT_PINNING=1: k3s as given, without k3s-pinning"
else
chosen=""
for dir in $(ls -d "$repo"/patches/k3s/*/ | sort -r); do
  [ -f "$dir/SERIES" ] || continue
  if git apply --check "$dir"/*.patch 2>/dev/null; then chosen=$dir; break; fi
done
[ -n "$chosen" ] || die "no series in patches/k3s applies to this k3s tree (series written against: $(sed -n 's/^k3s-commit: //p' "$repo"/patches/k3s/*/SERIES | tr '\n' ' ')); see patches/k3s/README.md"
echo "== applying patches/k3s/$(basename "$chosen") (written against k3s-io/k3s $(sed -n 's/^k3s-commit: //p' "$chosen/SERIES"))"
before_series=$(git rev-parse HEAD)
git am --quiet "$chosen"/*.patch
# Every Go file the series touches must be compiled into the binary k3s ships (./cmd/server; the
# agent and every other command are links to it): a hunk anywhere else is dead code.
deps=$(go list -deps -tags "$tags" -f '{{.Dir}}' ./cmd/server)
for f in $(git diff --name-only "$before_series" HEAD -- '*.go'); do
  grep -qx "$src/$(dirname "$f")" <<<"$deps" || die "patches/k3s/$(basename "$chosen") patches $f, which is in no package of ./cmd/server (what k3s's scripts/build compiles): dead code"
done
fi
if [ -z "$offline" ]; then
  # A networked build: k3s's own forks, vendored, with patches/kubernetes on its kubelet; then k3s's
  # own scripts make the release artifacts (scripts/download fetches the bundled charts and
  # binaries, scripts/build, scripts/package-cli the self-extracting k3s).
  go mod vendor
  [ -n "$stock" ] || "$repo/build/apply-kubernetes-patches.sh" vendor/k8s.io/kubernetes
  export GOFLAGS=-mod=vendor
  ./scripts/download
  ./scripts/build
  ./scripts/package-cli
  ls -l dist/artifacts/
  echo "$src/dist/artifacts/k3s"
  exit 0
fi

# 5. Offline: build what k3s's scripts/build builds for the main binary, with its tags and
# version flags (the charts scripts/download fetches, and package-cli's self-extracting wrapper
# around them, need the network).
goversion=$(go env GOVERSION)
commit=$(git rev-parse HEAD)
k3s_version="${k8s_version}+k3s-pinning-${commit:0:8}"
[ -z "$stock" ] || k3s_version="${k8s_version}+stock-${commit:0:8}"
containerd_version=$(awk '$1=="github.com/containerd/containerd/v2"{print $NF}' "$work/versions-with-k3s-pinning.txt")
ldflags="-X github.com/k3s-io/k3s/pkg/version.Version=$k3s_version
 -X github.com/k3s-io/k3s/pkg/version.GitCommit=${commit:0:8}
 -X github.com/k3s-io/k3s/pkg/version.UpstreamGolang=$goversion
 -X k8s.io/client-go/pkg/version.gitVersion=$k3s_version
 -X k8s.io/component-base/version.gitVersion=$k3s_version
 -X k8s.io/component-base/version.gitCommit=$commit
 -X github.com/containerd/containerd/v2/version.Version=$containerd_version
 -w -s"
mkdir -p "$work/bin"
echo "== go build ./cmd/server -tags '$tags' ($goversion)"
start=$(date +%s)
CGO_ENABLED=1 go build -trimpath -tags "$tags" -ldflags "$ldflags" -o "$work/bin/k3s" ./cmd/server
echo "== built in $(( $(date +%s) - start )) s: $(du -m "$work/bin/k3s" | cut -f1) MB"
# The outer wrapper a release ships as `k3s` (cmd/k3s): it parses the server and agent flags with
# k3s's own commands before it extracts its data (k3s's binaries, which package-cli embeds) and execs
# the inner binary. Built with empty data: enough to check that it accepts the flags.
mkdir -p pkg/data/embed; [ -n "$(ls -A pkg/data/embed)" ] || : > pkg/data/embed/empty
CGO_ENABLED=1 go build -trimpath -tags "$tags" -ldflags "$ldflags" -o "$work/bin/k3s-wrapper" ./cmd/k3s
# The shim containerd starts for every pod: from the containerd module k3s selected.
go build -trimpath -tags "$tags" -o "$work/bin/containerd-shim-runc-v2" github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2
for link in k3s-agent k3s-server kubectl crictl ctr containerd; do ln -sf k3s "$work/bin/$link"; done
echo "$work/bin/k3s"
