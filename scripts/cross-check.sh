#!/usr/bin/env bash
# The packages a patched k3s imports (pkg/agent/images, pkg/agent/cluster and what they import)
# build for every platform k3s builds: linux/amd64, linux/arm64, linux/arm (v7) and windows/amd64
# (k3s's Windows agents also call PreloadImages; there StartK3s says it is not supported and k3s
# imports itself).
set -euo pipefail
cd "$(dirname "$0")/.."
for platform in linux/amd64 linux/arm64 linux/arm windows/amd64; do
  GOOS=${platform%/*} GOARCH=${platform#*/} GOARM=7 CGO_ENABLED=0 go build ./pkg/agent/images ./pkg/agent/cluster ./pkg/airgap ./pkg/pinning ./internal/... \
    || { echo "FAIL  the packages k3s imports do not build for $platform" >&2; exit 1; }
  # vet compiles the tests too, which run a real containerd: Linux only.
  if [ "${platform%/*}" = linux ]; then
    GOOS=${platform%/*} GOARCH=${platform#*/} GOARM=7 CGO_ENABLED=0 go vet ./pkg/agent/images ./pkg/agent/cluster ./pkg/airgap ./pkg/pinning ./internal/... \
      || { echo "FAIL  go vet for $platform" >&2; exit 1; }
  fi
  echo "ok    $platform"
done
