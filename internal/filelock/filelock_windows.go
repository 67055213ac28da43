//go:build windows

package filelock

import (
	"os"

	"golang.org/x/sys/windows"
)

// The whole file, as flock locks it: one byte range as large as can be said.
const allBytes = ^uint32(0)

func lock(f *os.File) error {
	return windows.LockFileEx(windows.Handle(f.Fd()), windows.LOCKFILE_EXCLUSIVE_LOCK, 0, allBytes, allBytes, new(windows.Overlapped))
}

func unlock(f *os.File) error {
	return windows.UnlockFileEx(windows.Handle(f.Fd()), 0, allBytes, allBytes, new(windows.Overlapped))
}
