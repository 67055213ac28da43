// Package containerd pins the containerd daemon the tests run (pkg/containerdtest builds its
// containerd, ctr and containerd-shim-runc-v2 from this module's tool entries). It is its own module so
// that the daemon's version and dependencies never enter the requirements of the k3s-pinning module,
// which k3s imports: the daemon is a test fixture, the client is what k3s-pinning links.
package containerd
