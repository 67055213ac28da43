#!/usr/bin/env bash
# make release: every artifact an operator carries to an air-gapped node, into dist/ (not
# committed): static k3s-pinning binaries for linux/amd64, linux/arm64 and linux/arm (v7) with
# their version, .deb and .rpm packages (nfpm), the OCI image archive for agent/images (all three
# architectures, and one archive per architecture), the
# DaemonSet manifest for server/manifests, the offline install script with the unit and defaults
# it installs, and sha256sum.txt over all of them. VERSION defaults to git describe.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${VERSION:-$(git describe --tags --always --dirty 2>/dev/null || echo dev)}
nfpm_version=v2.48.0
image=docker.io/k3s-pinning/k3s-pinning:$version
rm -rf dist
mkdir -p dist
gobin=$(go env GOPATH)/bin
# nfpm built from its module at this version (a go-installed nfpm reports no version of its own;
# its build information does).
[ -x "$gobin/nfpm" ] && go version -m "$gobin/nfpm" | grep -q "mod.*github.com/goreleaser/nfpm/v2.*$nfpm_version" ||
  go install "github.com/goreleaser/nfpm/v2/cmd/nfpm@$nfpm_version"

# Packages want a version that starts with a digit, without "-" (rpm): a git describe without a
# tag becomes 0.0.0~<commit>.
pkg_version=${version#v}
[[ $pkg_version =~ ^[0-9] ]] || pkg_version=0.0.0~$pkg_version
pkg_version=${pkg_version//-/.}
declare -A platform=([amd64]=linux/amd64 [arm64]=linux/arm64 [arm]=linux/arm/v7)
# nfpm's names: arm7 is Debian's armhf and rpm's armv7hl.
declare -A nfpm_arch=([amd64]=amd64 [arm64]=arm64 [arm]=arm7)
images=()
sed "s#@BINDIR@#/usr/bin#" deploy/k3s-pinning.service > dist/.k3s-pinning.service.usr-bin
for arch in amd64 arm64 arm; do
  bin=dist/k3s-pinning-linux-$arch
  GOOS=linux GOARCH=$arch GOARM=7 CGO_ENABLED=0 \
    go build -trimpath -ldflags "-s -w -X main.version=$version" -o "$bin" ./cmd/k3s-pinning
  images+=("${platform[$arch]}=$bin")
  # nfpm expands the environment in a few fields only: the values are written into a copy.
  sed -e "s#\${ARCH}#${nfpm_arch[$arch]}#" -e "s#\${VERSION}#$pkg_version#" -e "s#\${BINARY}#$bin#" \
    -e "s#\${UNIT}#dist/.k3s-pinning.service.usr-bin#" deploy/nfpm.yaml > dist/.nfpm.yaml
  for packager in deb rpm; do
    "$gobin/nfpm" package --config dist/.nfpm.yaml --packager "$packager" --target dist/ >/dev/null
  done
done
rm dist/.k3s-pinning.service.usr-bin dist/.nfpm.yaml
go run ./build/release-image -ref "$image" -version "$version" -out dist/k3s-pinning-image.tar "${images[@]}"
# One archive per architecture as well, as k3s ships its own air-gap images: a node carries only
# its own (about a third of the size).
for arch in amd64 arm64 arm; do
  go run ./build/release-image -ref "$image" -version "$version" -out "dist/k3s-pinning-image-$arch.tar" "${platform[$arch]}=dist/k3s-pinning-linux-$arch"
done
sed "s#__IMAGE__#$image#" deploy/k3s-pinning.yaml > dist/k3s-pinning.yaml
cp deploy/install.sh deploy/k3s-pinning.service deploy/k3s-pinning.default deploy/k3s-pinning-workloads.yaml dist/
(cd dist && sha256sum -- * > sha256sum.txt)
echo "== make release $version: dist/"
(cd dist && ls -l --time-style=+ | awk 'NR > 1 { printf "%12d  %s\n", $5, $NF }')
