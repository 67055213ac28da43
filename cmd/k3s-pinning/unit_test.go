package main_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// TestSystemdUnitIsSandboxed (issue "Trust", item 7): deploy/k3s-pinning.service, with the built
// binary as ExecStart, passes systemd's own `systemd-analyze verify`, and its offline security
// analysis rates it at most 2.0 of 10 exposure, with no new privileges, no capabilities and the
// file system read-only but for the state dir. systemd does not run here (no PID 1 of its own):
// the daemon is not started inside the sandbox.
func TestSystemdUnitIsSandboxed(t *testing.T) {
	analyze, err := exec.LookPath("systemd-analyze")
	if err != nil {
		t.Fatalf("systemd-analyze (Debian's systemd) is needed: %v", err)
	}
	unit, err := os.ReadFile("../../deploy/k3s-pinning.service")
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "k3s-pinning.service")
	text := strings.ReplaceAll(string(unit), "@BINDIR@/k3s-pinning", binary)
	if err := os.WriteFile(path, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(analyze, "verify", path).CombinedOutput(); err != nil || len(strings.TrimSpace(string(out))) > 0 {
		t.Errorf("systemd-analyze verify: %v\n%s", err, out)
	}
	out, err := exec.Command(analyze, "security", "--offline=true", path).CombinedOutput()
	if err != nil {
		t.Fatalf("systemd-analyze security: %v\n%s", err, out)
	}
	m := regexp.MustCompile(`Overall exposure level for k3s-pinning.service: ([0-9.]+)`).FindSubmatch(out)
	if m == nil {
		t.Fatalf("no overall exposure in:\n%s", out)
	}
	exposure, _ := strconv.ParseFloat(string(m[1]), 64)
	t.Logf("exposure %.1f of 10", exposure)
	if exposure > 2.0 {
		t.Errorf("exposure %.1f, want at most 2.0:\n%s", exposure, out)
	}
	for _, want := range []string{"NoNewPrivileges=", "ProtectSystem=", "CapabilityBoundingSet=~CAP_SYS_ADMIN", "ProtectHome="} {
		found := false
		for _, line := range strings.Split(string(out), "\n") {
			if strings.Contains(line, want) {
				found = true
				if !strings.HasPrefix(strings.TrimSpace(line), "✓") {
					t.Errorf("%s not set: %s", want, line)
				}
			}
		}
		if !found {
			t.Errorf("the analysis does not name %s", want)
		}
	}
	if !strings.Contains(text, "ReadWritePaths=-/var/lib/rancher/k3s/agent/k3s-pinning\n") {
		t.Error("the state dir is not the unit's one writable path")
	}
}
