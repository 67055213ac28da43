package filelock

import (
	"os"
	"path/filepath"
	"testing"
	"time"
)

// A second holder waits until the first unlocks: the lock excludes, and Unlock releases it.
func TestLockExcludesUntilUnlock(t *testing.T) {
	path := filepath.Join(t.TempDir(), "lock")
	first, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer first.Close()
	if err := Lock(first); err != nil {
		t.Fatal(err)
	}
	second, err := os.OpenFile(path, os.O_RDWR, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer second.Close()
	got := make(chan error, 1)
	go func() { got <- Lock(second) }()
	select {
	case err := <-got:
		t.Fatalf("second Lock returned (%v) while the first held the lock", err)
	case <-time.After(200 * time.Millisecond):
	}
	if err := Unlock(first); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-got:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("second Lock still waiting after the first unlocked")
	}
}

// TryLock fails, without waiting, while another holds the lock, and takes it once released.
func TestTryLockFailsWhileHeld(t *testing.T) {
	path := filepath.Join(t.TempDir(), "lock")
	first, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer first.Close()
	if ok, err := TryLock(first); !ok || err != nil {
		t.Fatalf("TryLock of a free lock: %v, %v", ok, err)
	}
	second, err := os.OpenFile(path, os.O_RDWR, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer second.Close()
	if ok, err := TryLock(second); ok || err != nil {
		t.Fatalf("TryLock while another holds the lock: %v, %v; want false, nil", ok, err)
	}
	first.Close()
	if ok, err := TryLock(second); !ok || err != nil {
		t.Fatalf("TryLock after the holder closed the file: %v, %v", ok, err)
	}
}
