package main_test

import (
	"context"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/k3s-pinning/k3s-pinning/pkg/agent/statefile"
	"github.com/k3s-pinning/k3s-pinning/pkg/containerdtest"
	"github.com/k3s-pinning/k3s-pinning/pkg/imagetest"
)

// appNode is a real containerd and an images dir of one archive, app.tar (acc.example/app:1.0).
func appNode(t *testing.T) (*containerdtest.Daemon, string) {
	t.Helper()
	d := containerdtest.New(t, containerdtest.Options{})
	imagesDir := t.TempDir()
	img, _ := imagetest.Image(32<<10, imagetest.Amd64)
	if err := imagetest.WriteDocker(filepath.Join(imagesDir, "app.tar"), map[string]v1.Image{"acc.example/app:1.0": img}); err != nil {
		t.Fatal(err)
	}
	return d, imagesDir
}

// TestRunDaemon runs `k3s-pinning run` as systemd would: metrics on loopback, the agent's view in
// `status` and `doctor` from the state file, and a clean exit 0 on SIGTERM.
func TestRunDaemon(t *testing.T) {
	d, imagesDir := appNode(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	state := filepath.Join(t.TempDir(), "state.json")
	common := []string{"--containerd-address", d.Address, "--images-dir", imagesDir, "--state-file", state}

	agent := startRun(t, append([]string{"--metrics-address", ":" + strconv.Itoa(port)}, common...)...)

	var metrics string
	deadline := time.Now().Add(15 * time.Second)
	for !strings.Contains(metrics, "k3s_pinning_pinned_references 2") {
		if time.Now().After(deadline) {
			t.Fatalf("metrics never showed 2 pinned references:\n%s\nstderr:\n%s", metrics, agent.stderr.String())
		}
		time.Sleep(100 * time.Millisecond)
		if resp, err := http.Get("http://127.0.0.1:" + strconv.Itoa(port) + "/metrics"); err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			metrics = string(b)
		}
	}
	for _, want := range []string{"k3s_pinning_wanted_references 2", "k3s_pinning_missing_references 0", "k3s_pinning_reconcile_seconds_count"} {
		if !strings.Contains(metrics, want) {
			t.Errorf("metrics lack %q", want)
		}
	}

	out, _, code := run(t, append([]string{"status"}, common...)...)
	if code != 0 || !strings.Contains(out, "agent: last reconcile") {
		t.Errorf("status does not show the agent's view (exit %d):\n%s", code, out)
	}

	agent.stop(t)
	if agent.waitErr != nil {
		t.Errorf("run exited with %v after SIGTERM, want 0\n%s", agent.waitErr, agent.stderr.String())
	}
}

// TestProbesSayWhenTheAgentIsStuck: /readyz once the first sync ended; /healthz answers 200 while
// reconciles end, 503 naming the stall once none has ended for three reconcile intervals
// (containerd frozen: every call of the agent hangs), and 200 again once containerd goes on.
func TestProbesSayWhenTheAgentIsStuck(t *testing.T) {
	d, imagesDir := appNode(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	base := "http://" + l.Addr().String()
	l.Close()
	agent := startRun(t, "--containerd-address", d.Address, "--images-dir", imagesDir, "--state-file", filepath.Join(t.TempDir(), "state.json"),
		"--metrics-address", strings.TrimPrefix(base, "http://"), "--reconcile-interval", "1s")
	get := func(path string) (int, string) {
		c := http.Client{Timeout: 2 * time.Second}
		resp, err := c.Get(base + path)
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, strings.TrimSpace(string(b))
	}
	await := func(what, path string, code int) string {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for {
			got, body := get(path)
			if got == code {
				return body
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: %s answered %d %q, want %d, for 30 s\n%s", what, path, got, body, code, agent.stderr.String())
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	await("after the first sync", "/readyz", http.StatusOK)
	t.Logf("/healthz: %s", await("while reconciles end", "/healthz", http.StatusOK))
	thaw := d.Freeze()
	defer thaw()
	t.Logf("/healthz: %s", await("containerd frozen", "/healthz", http.StatusServiceUnavailable))
	thaw()
	t.Logf("/healthz: %s", await("containerd thawed", "/healthz", http.StatusOK))
}

// TestRunExitsWhenItsSocketMountGoesStale: `run` reaching containerd through its socket
// bind-mounted alone, as the DaemonSet mounts it; containerd restarts and makes a new socket, which
// that mount cannot show: run exits non-zero naming the socket, for the kubelet to start a
// container with a fresh mount, instead of retrying for ever.
func TestRunExitsWhenItsSocketMountGoesStale(t *testing.T) {
	d, imagesDir := appNode(t)
	mounted := filepath.Join(t.TempDir(), "containerd.sock")
	if err := os.WriteFile(mounted, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mount(d.Address, mounted, "", syscall.MS_BIND, ""); err != nil {
		t.Fatalf("bind-mount %s on %s: %v", d.Address, mounted, err)
	}
	t.Cleanup(func() { syscall.Unmount(mounted, syscall.MNT_DETACH) })
	state := filepath.Join(t.TempDir(), "state.json")
	agent := startRun(t, "--containerd-address", mounted, "--images-dir", imagesDir, "--state-file", state)
	agent.awaitState(t, state, "app.tar loaded through the mounted socket", func(s *statefile.State) bool { return s.Archives["app.tar"] != nil })
	if err := d.Restart(context.Background()); err != nil {
		t.Fatal(err)
	}
	select {
	case <-agent.exited:
		if agent.waitErr == nil {
			t.Errorf("run exited 0 after its socket was replaced")
		}
		if !strings.Contains(agent.stderr.String(), "socket "+mounted+" was replaced") {
			t.Errorf("run's error does not name the replaced socket:\n%s", agent.stderr.String())
		}
	case <-time.After(30 * time.Second):
		t.Fatal("run did not exit within 30 s of its socket being replaced")
	}
}
