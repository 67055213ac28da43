// Package containerd pins a containerd daemon of the matrix the tests also run against
// (K3S_PINNING_CONTAINERD=1.7; build/containerd is the default): pkg/containerdtest builds its
// containerd, ctr and containerd-shim-runc-v2 from this module's tool entries.
package containerd
