#!/usr/bin/env bash
# make e2e: the scenarios of test/e2e on the e2e node (the k3s node's are make k3s-e2e), each
# printing its table. Needs root, runc, mkfs.ext4 and losetup (.ci/run installs runc); the tests say
# what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(build/kubelet-workspace.sh)
cd test/e2e
# -v: the tables are the point of the run. A failing scenario prints the end of its node's log.
# The k3s node's and the cluster's tests are make k3s-e2e and make cluster-e2e; the fleet bench
# is make bench's.
GOWORK=$work bash ../../scripts/gotest.sh --show -mod=vendor -count=1 -timeout 20m -skip '^Test(K3s|Cluster|FleetBench)' ./...
