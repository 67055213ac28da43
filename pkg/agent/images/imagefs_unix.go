//go:build unix

package images

import "syscall"

// fsUsage is how full the filesystem holding path is, as the kubelet computes it (capacity less
// what is available to unprivileged users).
func fsUsage(path string) (DiskUsage, error) {
	var st syscall.Statfs_t
	if err := syscall.Statfs(path, &st); err != nil {
		return DiskUsage{}, err
	}
	capacity := int64(st.Blocks) * int64(st.Bsize)
	return DiskUsage{Path: path, Used: capacity - int64(st.Bavail)*int64(st.Bsize), Capacity: capacity}, nil
}
