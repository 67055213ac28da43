package main_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/k3s-pinning/k3s-pinning/pkg/agent/images"
	"github.com/k3s-pinning/k3s-pinning/pkg/containerdtest"
	"github.com/k3s-pinning/k3s-pinning/pkg/imagetest"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// TestKilledAgentRecovers kills `k3s-pinning run` with SIGKILL at seeded random moments of its
// start-up sync (while archives are being imported and the state written), then starts it again
// each time: the state file is always readable JSON, and once the last run settles every
// reference of the images dir is present and pinned.
func TestKilledAgentRecovers(t *testing.T) {
	d := containerdtest.New(t, containerdtest.Options{})
	imagesDir := t.TempDir()
	var refs []string
	for i := range 6 {
		img, err := imagetest.Image(4<<20, imagetest.Amd64)
		if err != nil {
			t.Fatal(err)
		}
		ref := fmt.Sprintf("crash.example/app%d:1.0", i)
		path := filepath.Join(imagesDir, fmt.Sprintf("app%d.tar.gz", i))
		if err := imagetest.WriteDocker(path, map[string]v1.Image{ref: img}); err != nil {
			t.Fatal(err)
		}
		refs = append(refs, ref)
	}
	state := filepath.Join(t.TempDir(), "state.json")
	common := []string{"--containerd-address", d.Address, "--images-dir", imagesDir, "--state-file", state}
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 0))

	kills := 0
	for range 8 {
		agent := startRun(t, common...)
		time.Sleep(time.Duration(rng.IntN(600)) * time.Millisecond)
		agent.cmd.Process.Signal(syscall.SIGKILL)
		<-agent.exited
		kills++
		if data, err := os.ReadFile(state); err == nil && !json.Valid(data) {
			t.Fatalf("after SIGKILL %d the state file is not valid JSON:\n%s", kills, data)
		}
	}
	startRun(t, common...)
	waitPresentAndPinned(t, refs, common...)
	leftovers, _ := filepath.Glob(filepath.Join(filepath.Dir(state), ".state-*.json"))
	t.Logf("%d SIGKILLs survived; %d temporary state files left by killed writes", kills, len(leftovers))
}

// TestKilledAtEachCrashPoint kills `k3s-pinning run` with SIGKILL exactly at each crash point
// (built in with -tags faultinject): after an import's content is in containerd but before any
// reference is created, halfway through writing the state's temporary file, and between that
// file's fsync and its rename. Each time the state file on disk is the previous one, whole; the
// next run removes the killed writer's temporary file and ends with every reference of the images
// dir present and pinned.
func TestKilledAtEachCrashPoint(t *testing.T) {
	d := containerdtest.New(t, containerdtest.Options{})
	for i, point := range []string{"import", "state-write", "state-rename"} {
		t.Run(point, func(t *testing.T) {
			imagesDir := t.TempDir()
			addArchive := func(name string) string {
				img, err := imagetest.Image(1<<20, imagetest.Amd64)
				if err != nil {
					t.Fatal(err)
				}
				ref := fmt.Sprintf("crash%d.example/%s:1.0", i, name)
				if err := imagetest.WriteDocker(filepath.Join(imagesDir, name+".tar.zst"), map[string]v1.Image{ref: img}); err != nil {
					t.Fatal(err)
				}
				return ref
			}
			state := filepath.Join(t.TempDir(), "state.json")
			common := []string{"--containerd-address", d.Address, "--images-dir", imagesDir, "--state-file", state}
			refs := []string{addArchive("first")}
			if _, stderr, code := run(t, append([]string{"sync"}, common...)...); code != 0 {
				t.Fatalf("first sync: exit %d\n%s", code, stderr)
			}
			before, err := os.ReadFile(state)
			if err != nil {
				t.Fatal(err)
			}
			refs = append(refs, addArchive("second"))

			log := filepath.Join(t.TempDir(), "stderr")
			logFile, err := os.Create(log)
			if err != nil {
				t.Fatal(err)
			}
			defer logFile.Close()
			cmd := exec.Command(faultBinary, append([]string{"run"}, common...)...)
			cmd.Env = append(os.Environ(), "K3S_PINNING_FAULT="+point)
			cmd.Stderr = logFile
			agent := startProcess(t, cmd)
			deadline := time.Now().Add(time.Minute)
			for {
				out, _ := os.ReadFile(log)
				if strings.Contains(string(out), "FAULT POINT "+point+" REACHED") {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("fault point %s not reached within a minute:\n%s", point, out)
				}
				time.Sleep(20 * time.Millisecond)
			}
			agent.cmd.Process.Signal(syscall.SIGKILL)
			<-agent.exited

			after, err := os.ReadFile(state)
			if err != nil {
				t.Fatalf("state file gone after SIGKILL at %s: %v", point, err)
			}
			if !bytes.Equal(before, after) {
				t.Errorf("SIGKILL at %s changed the state file (it must be the previous one, whole)", point)
			}
			temps, _ := filepath.Glob(filepath.Join(filepath.Dir(state), ".state-*.json"))
			if point != "import" && len(temps) != 1 {
				t.Errorf("SIGKILL at %s left %d temporary state files, want the killed writer's one", point, len(temps))
			}

			// Killed mid-import, the agent left its import lease (content held, no reference yet).
			leases := importLeases(t, d.Address)
			if point == "import" && leases == 0 {
				t.Errorf("no import lease after SIGKILL at %s: the content was held by none", point)
			}

			next := startRun(t, common...)
			waitPresentAndPinned(t, refs, common...)
			// The killed run's lease is the next run's to delete, at its first sync, which may come
			// after the references are seen (the killed run had created them at state-write).
			for deadline := time.Now().Add(time.Minute); ; time.Sleep(50 * time.Millisecond) {
				n := importLeases(t, d.Address)
				if n == 0 {
					break
				}
				if time.Now().After(deadline) {
					t.Errorf("%d import lease(s) left a minute into the next run (SIGKILL at %s had left %d)", n, point, leases)
					break
				}
			}
			for deadline := time.Now().Add(time.Minute); ; time.Sleep(50 * time.Millisecond) {
				data, _ := os.ReadFile(state)
				if strings.Contains(string(data), "second.tar.zst") {
					if !json.Valid(data) {
						t.Fatalf("state after recovery is not valid JSON:\n%s", data)
					}
					break
				}
				if time.Now().After(deadline) {
					t.Fatal("the next run did not record second.tar.zst in the state within a minute")
				}
			}
			// Stopped, so that no save of its own is under way when the dir is read (on a busy disk
			// one was seen mid-fsync).
			next.stop(t)
			if temps, _ := filepath.Glob(filepath.Join(filepath.Dir(state), ".state-*.json")); len(temps) != 0 {
				t.Errorf("temporary state files left after the next run saved and stopped: %v", temps)
			}
		})
	}
}

// importLeases counts k3s-pinning's import leases in the daemon at address.
func importLeases(t *testing.T, address string) int {
	t.Helper()
	client, err := containerd.New(address)
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	all, err := client.LeasesService().List(namespaces.WithNamespace(context.Background(), pinning.DefaultNamespace))
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, l := range all {
		if _, ok := l.Labels[images.LabelImportLease]; ok {
			n++
		}
	}
	return n
}

// waitPresentAndPinned waits up to a minute for `status` to show every ref present and pinned.
func waitPresentAndPinned(t *testing.T, refs []string, common ...string) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		rows := status(t, common...)
		ok := true
		for _, ref := range refs {
			if r := rows[ref]; r == nil || r["present"] != true || r["pinned"] != true {
				ok = false
			}
		}
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("not every reference is present and pinned: %v", rows)
		}
		time.Sleep(200 * time.Millisecond)
	}
}
