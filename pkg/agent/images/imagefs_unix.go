//go:build unix

package images

import "syscall"

// fsUsage is how full the filesystem holding path is, in percent, as the kubelet computes it
// (capacity less what is available to unprivileged users).
func fsUsage(path string) (float64, error) {
	var st syscall.Statfs_t
	if err := syscall.Statfs(path, &st); err != nil {
		return 0, err
	}
	capacity := float64(st.Blocks) * float64(st.Bsize)
	if capacity == 0 {
		return 0, nil
	}
	return 100 * (capacity - float64(st.Bavail)*float64(st.Bsize)) / capacity, nil
}
