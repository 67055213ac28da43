package containerdtest_test

import (
	"os"
	"testing"

	"github.com/k3s-pinning/k3s-pinning/pkg/containerdtest"
)

// TestProcessMemory reads this test process's own memory: resident more than nothing, and a peak
// at least the resident (make bench's memory rows read k3s's and the daemon's this way).
func TestProcessMemory(t *testing.T) {
	m, err := containerdtest.ProcessMemory(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if m.RSS <= 0 || m.HWM < m.RSS || m.File <= 0 || m.File >= m.RSS {
		t.Errorf("VmRSS %.1f MiB, VmHWM %.1f MiB, RssFile %.1f MiB: want a resident size above 0, a peak at least that, and the binary's pages part of it", m.RSS, m.HWM, m.File)
	}
	if _, err := containerdtest.ProcessMemory(-1); err == nil {
		t.Errorf("no error for pid -1")
	}
}
