package images

import (
	"context"
	"os"
	"path/filepath"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/k3s-pinning/k3s-pinning/internal/filelock"
)

// LabelImportLease marks the lease an import holds its content with until the references exist;
// its value is the state file of the agent that made it. An agent killed mid-import (SIGKILL, a
// power cut) leaves it behind, holding the half-imported content for its 24 hours. Only the one
// live agent of a state file (the holder of .agent.lock beside it) labels its leases, so a label
// whose lock is free names a dead agent's lease.
const LabelImportLease = "io.k3s-pinning.import-lease"

// ownImportLeases, once per agent (at its first sync), makes this agent the one live agent of its
// state file if no other is (a lock held until Run ends or the process dies: the kernel releases
// it), from then on labels its import leases, and deletes the labelled leases that earlier agents
// of that state file left: none of them can be importing any more. An agent that finds the lock
// held (a `sync` by hand beside `run`) neither labels nor deletes. A failed list is tried again at
// the next sync.
func (a *Agent) ownImportLeases(ctx context.Context) {
	if a.cfg.StateFile == "" || a.importLeasesDone {
		return
	}
	if a.agentLock == nil {
		dir := filepath.Dir(a.cfg.StateFile)
		if err := os.MkdirAll(dir, 0o700); err != nil {
			a.importLeasesDone = true // saveState says what is wrong with the state dir
			return
		}
		f, err := os.OpenFile(filepath.Join(dir, ".agent.lock"), os.O_CREATE|os.O_RDWR, 0o600)
		if err != nil {
			logrus.Warnf("agent lock in %s: %v; leaving earlier import leases to expire", dir, err)
			a.importLeasesDone = true
			return
		}
		if ok, err := filelock.TryLock(f); !ok {
			f.Close()
			if err != nil {
				logrus.Warnf("agent lock in %s: %v; leaving earlier import leases to expire", dir, err)
			}
			a.importLeasesDone = true
			return
		}
		a.agentLock = f
		a.importer.leaseLabels = map[string]string{LabelImportLease: a.cfg.StateFile}
	}
	all, err := a.cd.Leases.List(ctx)
	if err != nil {
		logrus.Warnf("listing containerd's leases: %v; looking for import leases of killed agents again at the next sync", err)
		return
	}
	a.importLeasesDone = true
	for _, l := range all {
		if l.Labels[LabelImportLease] != a.cfg.StateFile {
			continue
		}
		if err := a.cd.Leases.Delete(ctx, l); err != nil {
			logrus.Warnf("deleting import lease %s left by an agent killed mid-import: %v", l.ID, err)
			continue
		}
		logrus.Infof("deleted import lease %s, left by an agent killed mid-import (created %s)", l.ID, l.CreatedAt.Format(time.RFC3339))
	}
}

// releaseAgentLock gives up being the live agent of the state file (when Run ends).
func (a *Agent) releaseAgentLock() {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.agentLock != nil {
		a.agentLock.Close()
		a.agentLock = nil
		a.importer.leaseLabels = nil // no longer the live agent: a killed import's lease is not ours to find
	}
}
