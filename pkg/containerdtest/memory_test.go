package containerdtest_test

import (
	"os"
	"os/exec"
	"testing"
	"time"

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
	// An exited child not yet waited for (a zombie): its /proc/<pid>/status is there, without
	// memory lines.
	cmd := exec.Command("true")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Wait()
	deadline := time.Now().Add(10 * time.Second)
	for {
		stat, err := containerdtest.ProcessStat(cmd.Process.Pid)
		if err != nil {
			t.Fatal(err)
		}
		if stat[0] == "Z" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("true (pid %d) not exited within 10 s: state %s", cmd.Process.Pid, stat[0])
		}
		time.Sleep(10 * time.Millisecond)
	}
	if m, err := containerdtest.ProcessMemory(cmd.Process.Pid); err == nil {
		t.Errorf("an exited process read as %+v, want an error", m)
	}
}
