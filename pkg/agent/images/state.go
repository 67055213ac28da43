package images

import (
	"maps"
	"os"
	"reflect"
	"slices"

	"github.com/k3s-pinning/k3s-pinning/pkg/agent/statefile"
	"github.com/sirupsen/logrus"
)

// saveState writes the state if a file is configured. A failure (full or read-only disk) is
// reported in the agent's view and otherwise ignored: protection goes on from memory.
func (a *Agent) saveState() {
	if a.cfg.StateFile == "" {
		return
	}
	a.state.Agent.StateError = ""
	err := statefile.WithLock(a.cfg.StateFile, a.writeStateLocked)
	if err != nil {
		a.state.Agent.StateError = err.Error()
		logrus.Errorf("%v; protecting from memory", err)
	}
}

// writeStateLocked is a save, its caller holding the state lock.
func (a *Agent) writeStateLocked() error {
	if err := a.keepAsideUnreadable(); err != nil {
		return err
	}
	// An unpin by another process since the last save is not written back; read under the
	// lock, so that one between this read and the write waits for the write, and is applied at
	// the next.
	a.reloadRetained()
	if err := a.state.WriteLocked(a.cfg.StateFile); err != nil {
		return err
	}
	a.stateSeen, _ = os.Stat(a.cfg.StateFile)
	a.noteRetained()
	a.savedWork = workOf(a.state.Agent)
	return nil
}

// saveViewChange saves the state when what status and doctor show of the agent's waiting work
// changed since the last save: a restore or fetch failing again the same way, at each retry,
// writes nothing (the whole file, with fsync, for one counter).
func (a *Agent) saveViewChange() {
	a.updateView()
	if !reflect.DeepEqual(workOf(a.state.Agent), a.savedWork) {
		a.saveState()
	}
}

// workOf is the part of view that says what waits and why, empty parts as nil.
func workOf(view statefile.RunStatus) statefile.RunStatus {
	orNil := func(s []string) []string {
		if len(s) == 0 {
			return nil
		}
		return slices.Clone(s)
	}
	mapOrNil := func(m map[string]string) map[string]string {
		if len(m) == 0 {
			return nil
		}
		return maps.Clone(m)
	}
	return statefile.RunStatus{RestoresPending: orNil(view.RestoresPending), WaitingForDisk: orNil(view.WaitingForDisk), FetchesPending: orNil(view.FetchesPending),
		ArchiveErrors: mapOrNil(view.ArchiveErrors), FetchErrors: mapOrNil(view.FetchErrors)}
}
