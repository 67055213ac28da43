package main_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/k3s-pinning/k3s-pinning/pkg/agent/statefile"
	"github.com/k3s-pinning/k3s-pinning/pkg/containerdtest"
	"github.com/k3s-pinning/k3s-pinning/pkg/imagetest"
)

var binary, faultBinary string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "k3s-pinning-bin-")
	if err != nil {
		panic(err)
	}
	binary = filepath.Join(dir, "k3s-pinning")
	if out, err := exec.Command("go", "build", "-o", binary, ".").CombinedOutput(); err != nil {
		panic(string(out))
	}
	// The crash tests' binary stops at a named fault point (K3S_PINNING_FAULT) to be killed there.
	faultBinary = filepath.Join(dir, "k3s-pinning-faultinject")
	if out, err := exec.Command("go", "build", "-tags", "faultinject", "-o", faultBinary, ".").CombinedOutput(); err != nil {
		panic(string(out))
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// run runs the built command as a user would and returns stdout, stderr and the exit code.
func run(t *testing.T, args ...string) (string, string, int) {
	t.Helper()
	cmd := exec.Command(binary, args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	code := 0
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	return stdout.String(), stderr.String(), code
}

// agentProcess is a running `k3s-pinning run`, killed when the test ends if still running.
type agentProcess struct {
	cmd     *exec.Cmd
	exited  chan struct{}
	waitErr error // valid once exited is closed
	stderr  bytes.Buffer
}

func startRun(t *testing.T, args ...string) *agentProcess {
	t.Helper()
	return startProcess(t, exec.Command(binary, append([]string{"run"}, args...)...))
}

// startProcess starts cmd (a `k3s-pinning run`) and kills it at the end of the test.
func startProcess(t *testing.T, cmd *exec.Cmd) *agentProcess {
	t.Helper()
	p := &agentProcess{cmd: cmd, exited: make(chan struct{})}
	if p.cmd.Stderr == nil {
		p.cmd.Stderr = &p.stderr
	}
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { p.waitErr = p.cmd.Wait(); close(p.exited) }()
	t.Cleanup(func() { p.cmd.Process.Kill(); <-p.exited })
	return p
}

// stop sends SIGTERM, as systemd does, and waits up to 10 s for the process to exit.
func (p *agentProcess) stop(t *testing.T) {
	t.Helper()
	p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.exited:
	case <-time.After(10 * time.Second):
		t.Fatal("run did not exit within 10 s of SIGTERM")
	}
}

// awaitState waits up to 20 s for the state file at path to satisfy cond (an unreadable or
// missing file is the empty state), and fails naming what with the process's stderr.
func (p *agentProcess) awaitState(t *testing.T, path, what string, cond func(*statefile.State) bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for s, _ := statefile.Load(path); !cond(s); s, _ = statefile.Load(path) {
		if time.Now().After(deadline) {
			t.Fatalf("not within 20 s: %s\n%s", what, p.stderr.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

type statusRow map[string]any

func status(t *testing.T, flags ...string) map[string]statusRow {
	t.Helper()
	out, stderr, code := run(t, append([]string{"status", "-o", "json"}, flags...)...)
	if code != 0 {
		t.Fatalf("status exit %d: %s", code, stderr)
	}
	var doc struct {
		Images []statusRow `json:"images"`
	}
	dec := json.NewDecoder(strings.NewReader(out))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&doc); err != nil {
		t.Fatalf("status -o json: %v\n%s", err, out)
	}
	rows := map[string]statusRow{}
	for _, r := range doc.Images {
		if len(r) != 6 {
			t.Errorf("row %v: want exactly the keys ref, digest, source, pinned, wanted, present", r)
		}
		rows[r["ref"].(string)] = r
	}
	return rows
}

func TestSyncStatusDoctorPinUnpin(t *testing.T) {
	d := containerdtest.New(t, containerdtest.Options{})
	imagesDir := t.TempDir()
	img, err := imagetest.Image(32<<10, imagetest.Amd64)
	if err != nil {
		t.Fatal(err)
	}
	if err := imagetest.WriteDocker(filepath.Join(imagesDir, "app.tar.gz"), map[string]v1.Image{"acc.example/app:1.0": img}); err != nil {
		t.Fatal(err)
	}
	hand := filepath.Join(t.TempDir(), "hand.tar")
	if err := imagetest.WriteDocker(hand, map[string]v1.Image{"hand.example/tool:1.0": img, "hand.example/other:1.0": img}); err != nil {
		t.Fatal(err)
	}
	ctr := func(args ...string) {
		t.Helper()
		if out, err := exec.Command(d.Bin.Ctr, append([]string{"-a", d.Address, "-n", "k8s.io"}, args...)...).CombinedOutput(); err != nil {
			t.Fatalf("ctr %v: %v\n%s", args, err, out)
		}
	}
	ctr("images", "import", hand)
	ctr("images", "label", "hand.example/other:1.0", "io.cri.containerd.pinned=pinned") // the seed report's misspelling

	common := []string{"--containerd-address", d.Address, "--images-dir", imagesDir, "--state-file", filepath.Join(t.TempDir(), "state.json")}

	// Before sync, doctor finds the unpinned archive image and the misspelled label.
	out, _, code := run(t, append([]string{"doctor"}, common...)...)
	if code != 1 || !strings.Contains(out, "acc.example/app:1.0") || !strings.Contains(out, "io.cri.containerd.pinned") {
		t.Errorf("doctor before sync: exit %d, want 1 naming the missing image and the misspelled label:\n%s", code, out)
	}

	out, stderr, code := run(t, append([]string{"sync", "--pinned-images", "hand.example/tool"}, common...)...)
	if code != 0 {
		t.Fatalf("sync exit %d:\n%s\n%s", code, out, stderr)
	}
	rows := status(t, append(common, "--pinned-images", "hand.example/tool")...)
	for ref, want := range map[string]statusRow{
		"docker.io/library/nonexistent:0": nil,
		"acc.example/app:1.0":             {"source": "app.tar.gz", "pinned": true, "wanted": true, "present": true},
		"hand.example/tool:1.0":           {"source": "policy", "pinned": true, "wanted": true, "present": true},
		"hand.example/other:1.0":          {"source": "", "pinned": false, "wanted": false, "present": true},
	} {
		got, ok := rows[ref]
		if want == nil {
			if ok {
				t.Errorf("status lists %s", ref)
			}
			continue
		}
		if !ok {
			t.Errorf("status does not list %s: %v", ref, rows)
			continue
		}
		for k, v := range want {
			if got[k] != v {
				t.Errorf("status %s: %s=%v, want %v", ref, k, got[k], v)
			}
		}
		if !strings.HasPrefix(got["digest"].(string), "sha256:") {
			t.Errorf("status %s: digest %v", ref, got["digest"])
		}
	}

	// pin by hand, then unpin; a pin we did not set is refused.
	if out, stderr, code := run(t, append([]string{"pin", "hand.example/other:1.0"}, common...)...); code != 0 {
		t.Fatalf("pin: exit %d\n%s%s", code, out, stderr)
	}
	if r := status(t, common...)["hand.example/other:1.0"]; r["pinned"] != true || r["source"] != "manual" || r["wanted"] != true {
		t.Errorf("after pin: %v", r)
	}
	if _, stderr, code := run(t, append([]string{"unpin", "hand.example/other:1.0"}, common...)...); code != 0 {
		t.Fatalf("unpin: exit %d: %s", code, stderr)
	}
	if r := status(t, common...)["hand.example/other:1.0"]; r["pinned"] != false {
		t.Errorf("after unpin: %v", r)
	}
	ctr("images", "label", "hand.example/tool:1.0", "io.k3s-pinning.source=") // now the user's pin, not ours
	_, stderr, code = run(t, append([]string{"unpin", "hand.example/tool:1.0"}, common...)...)
	if code != 1 || !strings.Contains(stderr, "not set by k3s-pinning") {
		t.Errorf("unpin of a foreign pin: exit %d, stderr %q", code, stderr)
	}
	if r := status(t, common...)["hand.example/tool:1.0"]; r["pinned"] != true {
		t.Errorf("foreign pin removed: %v", r)
	}

	// Usage errors name the flag and exit 2.
	_, stderr, code = run(t, append([]string{"sync", "--pinned-images", "bad[glob"}, common...)...)
	if code != 2 || !strings.Contains(stderr, "--pinned-images") || !strings.Contains(stderr, "bad[glob") {
		t.Errorf("malformed pattern: exit %d, stderr %q", code, stderr)
	}
	_, stderr, code = run(t, "status", "--no-such-flag")
	if code != 2 || !strings.Contains(stderr, "no-such-flag") {
		t.Errorf("unknown flag: exit %d, stderr %q", code, stderr)
	}
}
