package containerdtest_test

import (
	"os"
	"testing"

	"github.com/k3s-pinning/k3s-pinning/pkg/containerdtest"
)

// TestProcessMemory reads this test process's own memory: resident more than nothing, and a peak
// at least the resident (make bench's memory rows read k3s's and the daemon's this way).
func TestProcessMemory(t *testing.T) {
	rss, hwm, err := containerdtest.ProcessMemory(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if rss <= 0 || hwm < rss {
		t.Errorf("VmRSS %.1f MiB, VmHWM %.1f MiB: want a resident size above 0 and a peak at least that", rss, hwm)
	}
	if _, _, err := containerdtest.ProcessMemory(-1); err == nil {
		t.Errorf("no error for pid -1")
	}
}
