package images_test

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/core/leases"

	"github.com/k3s-pinning/k3s-pinning/internal/filelock"
	"github.com/k3s-pinning/k3s-pinning/pkg/agent/images"
)

// An agent deletes the import leases that dead agents of its own state file left, and only
// those: not another state file's, not an unlabelled one, and none at all while another live
// agent of its state file holds the lock (a `sync` by hand beside `run`).
func TestSyncDeletesImportLeasesOfDeadAgentsOnly(t *testing.T) {
	n := newNode(t)
	stateFile := filepath.Join(t.TempDir(), "state", "state.json")
	lm := n.client.LeasesService()
	create := func(id string, labels map[string]string) {
		if _, err := lm.Create(n.ctx, leases.WithID(id), leases.WithExpiration(time.Hour), leases.WithLabels(labels)); err != nil {
			t.Fatal(err)
		}
	}
	ids := func() []string {
		all, err := lm.List(n.ctx)
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, l := range all {
			out = append(out, l.ID)
		}
		slices.Sort(out)
		return out
	}
	create("dead-agent", map[string]string{images.LabelImportLease: stateFile})
	create("other-state-file", map[string]string{images.LabelImportLease: "/elsewhere/state.json"})
	create("not-ours", nil)

	// Another live agent holds the lock: nothing is deleted.
	if err := os.MkdirAll(filepath.Dir(stateFile), 0o700); err != nil {
		t.Fatal(err)
	}
	held, err := os.OpenFile(filepath.Join(filepath.Dir(stateFile), ".agent.lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if ok, err := filelock.TryLock(held); !ok || err != nil {
		t.Fatalf("lock: %v %v", ok, err)
	}
	images.NewAgent(images.Services(n.client), images.Config{ImagesDir: n.imagesDir, StateFile: stateFile}).Sync(n.ctx)
	if got, want := ids(), []string{"dead-agent", "not-ours", "other-state-file"}; !slices.Equal(got, want) {
		t.Errorf("leases while another agent holds the lock: %v, want %v", got, want)
	}

	// That agent gone: the next deletes its dead predecessors' lease, and only that.
	held.Close()
	images.NewAgent(images.Services(n.client), images.Config{ImagesDir: n.imagesDir, StateFile: stateFile}).Sync(n.ctx)
	if got, want := ids(), []string{"not-ours", "other-state-file"}; !slices.Equal(got, want) {
		t.Errorf("leases after the sync: %v, want %v", got, want)
	}
}
