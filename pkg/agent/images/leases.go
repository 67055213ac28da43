package images

import (
	"context"
	"os"
	"path/filepath"

	"github.com/sirupsen/logrus"

	"github.com/k3s-pinning/k3s-pinning/internal/filelock"
)

// LabelImportLease marks the lease an import holds its content with until the references exist;
// its value is the state file of the agent that made it. An agent killed mid-import (SIGKILL, a
// power cut) leaves it behind, holding the half-imported content for its 24 hours.
const LabelImportLease = "io.k3s-pinning.import-lease"

// importLeaseLabels are the labels of the import leases of an agent with state file stateFile.
func importLeaseLabels(stateFile string) map[string]string {
	if stateFile == "" {
		return nil
	}
	return map[string]string{LabelImportLease: stateFile}
}

// ownImportLeases makes this agent the one live agent of its state file, if no other is (a lock
// held until the process ends: the kernel releases it when it dies), and then deletes the import
// leases that earlier agents of that state file left: none of them can be importing any more. An
// agent that finds the lock held (a `sync` by hand beside `run`) deletes nothing.
func (a *Agent) ownImportLeases(ctx context.Context) {
	if a.cfg.StateFile == "" || a.agentLock != nil {
		return
	}
	dir := filepath.Dir(a.cfg.StateFile)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return // saveState says what is wrong with the state dir
	}
	f, err := os.OpenFile(filepath.Join(dir, ".agent.lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		logrus.Warnf("agent lock in %s: %v; leaving earlier import leases to expire", dir, err)
		return
	}
	if ok, err := filelock.TryLock(f); !ok {
		f.Close()
		if err != nil {
			logrus.Warnf("agent lock in %s: %v; leaving earlier import leases to expire", dir, err)
		}
		return
	}
	a.agentLock = f
	all, err := a.cd.Leases.List(ctx)
	if err != nil {
		logrus.Warnf("listing containerd's leases: %v; leaving earlier import leases to expire", err)
		return
	}
	for _, l := range all {
		if l.Labels[LabelImportLease] != a.cfg.StateFile {
			continue
		}
		if err := a.cd.Leases.Delete(ctx, l); err != nil {
			logrus.Warnf("deleting import lease %s left by an agent killed mid-import: %v", l.ID, err)
			continue
		}
		logrus.Infof("deleted import lease %s, left by an agent killed mid-import (created %s)", l.ID, l.CreatedAt.Format("2006-01-02T15:04:05Z07:00"))
	}
}

// releaseAgentLock gives up being the live agent of the state file (when Run ends).
func (a *Agent) releaseAgentLock() {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.agentLock != nil {
		a.agentLock.Close()
		a.agentLock = nil
	}
}
