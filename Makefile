# k3s-pinning. Everything builds into the Go caches (GOCACHE, GOMODCACHE, and the user cache dir
# for the containerd binaries the tests run), never into the repository.
GO ?= go
GOBIN ?= $(shell $(GO) env GOPATH)/bin

.PHONY: demo test test-lines unit build vet docs release patches-check k3s-patches-check k3s k3s-e2e cluster-e2e e2e bench fuzz soak

## demo: build containerd, load a generated air-gap images dir, run the real kubelet image GC
## with the image filesystem 95% full, print what survived (needs root)
demo:
	cd test/kubelet && GOWORK=$$(../../build/kubelet-workspace.sh) $(GO) run -mod=vendor ./cmd/demo

## test: every test, including those against a real containerd, the real kubelet GC code and a
## real k3s of the newest line (root; fails when not root, or when a suite skipped or ran nothing)
test:
	bash scripts/test.sh

## test-lines: the lines besides the newest, for release checks: the agent's tests and the short
## soak on containerd 1.7 and 2.1, make k3s-e2e on every other k3s tree of ../shared/k3s-src/current,
## make patches-check (kubernetes 1.34-1.37) (root)
test-lines:
	bash scripts/test-lines.sh

## patches-check: apply patches/kubernetes to the newest served release of each kubernetes line
## (1.34-1.37) in a vendor tree, build it, run the kubelet's pkg/kubelet/images tests and ours
patches-check:
	bash scripts/patches-check.sh

## k3s: a k3s binary with k3s-pinning built in. Here: K3S_SOURCE=<k3s tree or archive>, by default
## the newest k3s line in ../shared/k3s-src (master, v1.36; build/k3s-newest.sh), with k3s's own
## k3s-io forks wherever the module proxy serves them and an upstream stand-in for each it refuses
## (every decision printed). Networked: K3S_VERSION=v1.36.3+k3s1 (k3s's own build scripts). Into
## the user cache dir; prints the binary's path last. See scripts/build-k3s.sh
K3S_SOURCE ?= $(shell build/k3s-newest.sh)
k3s:
	K3S_SOURCE=$(if $(K3S_VERSION),,$(K3S_SOURCE)) K3S_VERSION=$(K3S_VERSION) bash scripts/build-k3s.sh

## k3s-e2e: make k3s (K3S_SOURCE, by default the newest line), then a real k3s node (k3s server,
## sqlite, containerd on a loop-mounted ext4) through k3s issues 10209, 14265, 2961, hand imports,
## a stripped pin, archives removed and added, with pinning and with --disable-image-pinning, one
## table for both (root)
k3s-e2e:
	K3S_SOURCE=$(K3S_SOURCE) bash scripts/k3s-e2e.sh

## cluster-e2e: make k3s (K3S_SOURCE, by default the newest line), then a cluster of a server and two
## agents joined with a token, each in network and mount namespaces of its own on a LAN the test
## makes, with k3s's flannel; disk pressure on one agent (root)
cluster-e2e:
	K3S_SOURCE=$(K3S_SOURCE) bash scripts/cluster-e2e.sh

## k3s-patches-check: every patches/k3s and patches/k3s-offline series well formed and applying to
## the k3s trees in ../shared/k3s-src, Dockerfile.k3s as k3s's build environment, make k3s
## failing fast without network for K3S_VERSION
k3s-patches-check:
	bash scripts/k3s-patches-check.sh

## e2e: the seed scenario on a real kubelet (patched, in one process with the agent), a private
## containerd on a loop-mounted ext4, Debian's runc, a static pod and real disk pressure (root)
e2e:
	bash scripts/e2e.sh

## bench: every cost against its baseline in the same run (real containerd, the kubelet's GC),
## one table; BENCH_FLAGS=-h for the sizes; then the k3s section (scripts/k3s-bench.sh: k3s with
## k3s-pinning against --disable-image-pinning on one node, cold boot, warm restarts, memory, and
## the sizes against the same k3s built without k3s-pinning; K3S_BENCH_SETS, K3S_BENCH_ROUNDS);
## then the fleet row on make cluster-e2e's cluster (a 51 MiB image to two peers through k3s's
## embedded registry, against ctr images import) (root)
bench:
	bash scripts/bench-needs.sh
	cd test/kubelet && GOWORK=$$(../../build/kubelet-workspace.sh) $(GO) run -mod=vendor ./cmd/bench $(BENCH_FLAGS)
	$(GO) test -run '^$$' -bench . -benchmem ./pkg/...
	bash scripts/k3s-bench.sh
	K3S_FLEET_BENCH=1 CLUSTER_E2E_RUN='^TestFleetBench$$' bash scripts/cluster-e2e.sh

## soak: the randomized soak (real containerd on a tmpfs, the kubelet's DeleteUnusedImages, 13
## kinds of fault) for SOAK_FLAGS (default -duration 10m; -seed N replays a run), SOAK_RUNS runs
## back to back from consecutive seeds (default 1); a failure's last line names its seed and the
## command that replays it (root)
SOAK_FLAGS ?= -duration 10m
SOAK_RUNS ?= 1
soak:
	cd test/kubelet && GOWORK=$$(../../build/kubelet-workspace.sh) $(GO) run -mod=vendor ./cmd/soak -runs $(SOAK_RUNS) $(SOAK_FLAGS)

## fuzz: the fuzz targets (archive index reader, policy parser, the quick reading of a digest
## reference against the grammar), FUZZTIME each (default 60s)
fuzz:
	bash scripts/fuzz.sh

## unit: tests that need no root and no daemon (the planner, the archive reader, the policy, the
## agent on containerd's own metadata store)
unit:
	$(GO) test -count=1 -run 'Policy|Misspelled|Read|Scan|Plan|Condition|KeeperIsThePlan|OnContainerdsStore|RunCallsAfterSync|Dependencies|K3sFlags|LockExcludes' ./pkg/... ./internal/...

## release: into dist/ (not committed): static binaries (linux amd64, arm64, arm v7) with their
## version, .deb and .rpm (nfpm), the image archive for agent/images, the DaemonSet manifest,
## the offline install.sh, sha256sum.txt. VERSION=... (default: git describe)
release:
	bash scripts/release.sh

## docs: render the pictures of docs/ (docs/*.dot, Graphviz) to SVG beside their source; make test
## fails when a picture was not rendered from its current source
docs:
	bash scripts/docs.sh

## build: install the k3s-pinning command into GOBIN
build:
	GOBIN=$(GOBIN) $(GO) install ./cmd/k3s-pinning

vet:
	$(GO) vet ./...
	cd test/kubelet && GOWORK=$$(../../build/kubelet-workspace.sh) $(GO) vet -mod=vendor ./...
