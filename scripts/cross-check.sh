#!/usr/bin/env bash
# The package a patched k3s imports (pkg/k3spinning and what it imports) builds for every platform
# k3s builds: linux/amd64, linux/arm64, linux/arm (v7) and windows/amd64 (k3s's Windows agents
# also call PreloadImages; there k3spinning.Start says it is not supported and k3s imports itself).
set -euo pipefail
cd "$(dirname "$0")/.."
# -trimpath, CGO_ENABLED=0 and GOARM=7 as make release builds cmd/k3s-pinning (which imports all of
# these): the release in make test then finds its packages compiled in the Go cache (a cold
# .ci/run saves most of the release's three builds). No go vet per platform: make test's go vet ./...
# covers the code (no cgo, no per-architecture files; internal/filelock's Windows file is compiled
# by the windows/amd64 build), and the compiler type-checks each platform (an int constant too big
# for 32-bit ARM fails the build).
for platform in linux/amd64 linux/arm64 linux/arm windows/amd64; do
  GOOS=${platform%/*} GOARCH=${platform#*/} GOARM=7 CGO_ENABLED=0 go build -trimpath ./pkg/k3spinning ./internal/... \
    || { echo "FAIL  the packages k3s imports do not build for $platform" >&2; exit 1; }
  echo "ok    $platform"
done
# The test support packages too (pkg/containerdtest, pkg/imagetest), on the platform where they are
# furthest from Linux: a builder who builds ./pkg/... for k3s's Windows agents must not stop there.
GOOS=windows GOARCH=amd64 CGO_ENABLED=0 go build -trimpath ./pkg/... \
  || { echo "FAIL  ./pkg/... does not build for windows/amd64" >&2; exit 1; }
echo "ok    windows/amd64 ./pkg/..."
