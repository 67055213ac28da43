# k3s-pinning. Everything builds into the Go caches (GOCACHE, GOMODCACHE, and the user cache dir
# for the containerd binaries the tests run), never into the repository.
GO ?= go
GOBIN ?= $(shell $(GO) env GOPATH)/bin

.PHONY: demo test unit build vet

## demo: build containerd, load a generated air-gap images dir, run the real kubelet image GC
## with the image filesystem 95% full, print what survived (needs root)
demo:
	cd test/kubelet && $(GO) run ./cmd/demo

## test: every test, including those against a real containerd and the real kubelet GC code (root)
test:
	bash scripts/test.sh

## unit: tests that need no root and no daemon
unit:
	$(GO) test -count=1 -run 'Policy|Misspelled|ReadIndex|ReadList|Scan' ./pkg/...

## build: install the k3s-pinning command into GOBIN
build:
	GOBIN=$(GOBIN) $(GO) install ./cmd/k3s-pinning

vet:
	$(GO) vet ./...
	cd test/kubelet && $(GO) vet ./...
