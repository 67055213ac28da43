package main_test

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/k3s-pinning/k3s-pinning/pkg/containerdtest"
	"github.com/k3s-pinning/k3s-pinning/pkg/imagetest"
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
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for {
		rows := status(t, common...)
		ok := true
		for _, ref := range refs {
			if r := rows[ref]; r == nil || r["present"] != true || r["pinned"] != true {
				ok = false
			}
		}
		if ok {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("after %d SIGKILLs and a restart, not every reference is present and pinned: %v", kills, rows)
		}
		time.Sleep(200 * time.Millisecond)
	}
	leftovers, _ := filepath.Glob(filepath.Join(filepath.Dir(state), ".state-*.json"))
	t.Logf("%d SIGKILLs survived; %d temporary state files left by killed writes", kills, len(leftovers))
}
