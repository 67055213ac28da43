// Package filelock takes an exclusive advisory lock on an open file, portably (flock on Unix,
// LockFileEx on Windows, whose agents k3s also builds). The lock goes with the file: closing it,
// or the death of the process that holds it, releases it.
package filelock

import "os"

// Lock blocks until f is exclusively locked by this process.
func Lock(f *os.File) error { return lock(f) }

// TryLock locks f exclusively if no one else holds it, and says whether it did; it never blocks.
func TryLock(f *os.File) (bool, error) { return tryLock(f) }

// Unlock releases the lock Lock took; closing f does too.
func Unlock(f *os.File) error { return unlock(f) }
