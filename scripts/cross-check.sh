#!/usr/bin/env bash
# The packages a patched k3s imports (pkg/agent/images, pkg/agent/cluster and what they import)
# build for every platform k3s builds: linux/amd64, linux/arm64, linux/arm (v7) and windows/amd64
# (k3s's Windows agents also call PreloadImages; there StartK3s says it is not supported and k3s
# imports itself).
set -euo pipefail
cd "$(dirname "$0")/.."
# -trimpath, CGO_ENABLED=0 and GOARM=7 as make release builds cmd/k3s-pinning (which imports all of
# these): the release in make test then finds its packages compiled in the Go cache (a cold
# .ci/run saves most of the release's three builds).
for platform in linux/amd64 linux/arm64 linux/arm windows/amd64; do
  GOOS=${platform%/*} GOARCH=${platform#*/} GOARM=7 CGO_ENABLED=0 go build -trimpath ./pkg/agent/images ./pkg/agent/cluster ./pkg/airgap ./pkg/pinning ./internal/... \
    || { echo "FAIL  the packages k3s imports do not build for $platform" >&2; exit 1; }
  # vet compiles the tests too, which run a real containerd: Linux only. make test's go vet ./...
  # covers the 64-bit platforms (these packages have no cgo and no per-architecture files); 32-bit
  # ARM is the one whose int size differs.
  if [ "$platform" = linux/arm ]; then
    GOOS=linux GOARCH=arm GOARM=7 CGO_ENABLED=0 go vet -trimpath ./pkg/agent/images ./pkg/agent/cluster ./pkg/airgap ./pkg/pinning ./internal/... \
      || { echo "FAIL  go vet for $platform" >&2; exit 1; }
  fi
  echo "ok    $platform"
done
