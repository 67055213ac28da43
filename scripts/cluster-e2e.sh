#!/usr/bin/env bash
# make cluster-e2e: the k3s of make k3s (K3S_SOURCE, by default the newest line; K3S_E2E_BIN, a bin
# dir make k3s built, skips the build) as a cluster of a server and two agents on this machine,
# each node in network and mount namespaces of its own, with k3s's flannel (test/e2e/cluster_test.go).
# The nodes' iptables and CNI plugins come from build/cluster-tools.sh (into the user cache).
# Needs root, runc, mkfs.ext4, losetup, ip and nsenter (.ci/run installs them).
set -euo pipefail
cd "$(dirname "$0")/.."
K3S_CLUSTER_TOOLS=$(build/cluster-tools.sh)
export K3S_CLUSTER_TOOLS
# CLUSTER_E2E_RUN: make bench runs TestFleetBench on the same cluster.
K3S_E2E_RUN=${CLUSTER_E2E_RUN:-'^TestCluster$'} exec bash scripts/k3s-e2e.sh
