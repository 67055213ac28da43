package images

import (
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"slices"

	"github.com/opencontainers/go-digest"
	"github.com/sirupsen/logrus"

	"github.com/k3s-pinning/k3s-pinning/pkg/agent/imagelist"
	"github.com/k3s-pinning/k3s-pinning/pkg/agent/statefile"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// The state file is a cache: containerd is the truth. A file missing, truncated, damaged or
// written by a newer version at start costs a re-index of the images dir, and what only the state
// knew, the archives retained after they left the images dir, is read back from the pins in
// containerd, which name their archive. A file damaged while the agent runs costs nothing: the
// agent writes it again from memory. An unreadable file is never replaced: it is kept aside for
// the operator, and reported.

// openState reads the state file the agent starts from. When there is none that this version can
// read (or no file is configured), the state is empty and lost: the first sync rebuilds it.
func (a *Agent) openState() {
	a.state, a.stateLost = statefile.New(), true
	if a.cfg.StateFile == "" {
		return
	}
	s, err := statefile.Load(a.cfg.StateFile)
	switch {
	case err == nil:
		a.state, a.stateLost = s, false
		a.stateSeen, _ = os.Stat(a.cfg.StateFile)
	case errors.Is(err, fs.ErrNotExist):
		logrus.Infof("no state file %s (a first start, or it was removed): re-indexing the images dir; what was retained is read back from the pins in containerd", a.cfg.StateFile)
	default:
		a.stateUnreadable = err
		logrus.Warnf("%v; re-indexing the images dir, what was retained is read back from the pins in containerd, and the file is kept aside at the first save", err)
	}
}

// keepAsideUnreadable, its caller holding the state lock before a save, sets the state file aside
// when this version cannot read it (damaged, truncated, a newer version's), so that the save does
// not replace it. The file is read only when another hand changed it since this agent last read
// or wrote it. An error means the file could not be set aside: the save must not happen.
func (a *Agent) keepAsideUnreadable() error {
	path := a.cfg.StateFile
	fi, err := os.Stat(path)
	if errors.Is(err, fs.ErrNotExist) {
		if a.stateSeen != nil {
			logrus.Warnf("state file %s was removed while the agent ran: written again from memory", path)
			a.stateSeen = nil
		}
		return nil
	}
	if err != nil {
		return fmt.Errorf("state %s: %w", path, err)
	}
	if seen := a.stateSeen; seen != nil && os.SameFile(fi, seen) && fi.Size() == seen.Size() && fi.ModTime().Equal(seen.ModTime()) {
		return nil
	}
	_, unreadable := statefile.Load(path)
	if unreadable == nil || errors.Is(unreadable, fs.ErrNotExist) {
		return nil // another writer's (`sync`, `unpin`), or gone meanwhile
	}
	aside, err := statefile.SetAside(path)
	if err != nil {
		return err
	}
	a.stateUnreadable = nil
	logrus.Warnf("%v: kept aside as %s; the state is written again from what the agent knows", unreadable, aside)
	a.event(true, ReasonStateFileUnreadable, "%v: kept aside as %s; nothing was unpinned, the state is rebuilt from containerd", unreadable, aside)
	return nil
}

// retainedFromPins are the archives that our pins in listed name and that are neither in the
// images dir (present) nor known to the state, each with the references pinned for it and their
// targets. Once the state is lost, that is all that is left of what the agent retained after an
// archive left the images dir; a pin set for an archive that left while no agent ran, or whose
// release was lost, looks the same. The agent cannot tell them apart, so it keeps both.
func retainedFromPins(listed imagelist.Records, present []string, known *statefile.State) map[string]*statefile.Archive {
	out := map[string]*statefile.Archive{}
	inDir := make(map[string]bool, len(present))
	for _, name := range present {
		inDir[name] = true
	}
	for img := range listed.Images() {
		src, ours := pinning.OwnPin(img.Labels)
		if !ours || imagelist.IsImageID(img.Name) || !pinning.IsArchiveSource(src) || inDir[src] || known.Archives[src] != nil {
			continue
		}
		if rec := known.Retained[src]; rec != nil && rec.Refs[img.Name] != "" {
			continue
		}
		rec := out[src]
		if rec == nil {
			rec = &statefile.Archive{Refs: map[string]digest.Digest{}}
			out[src] = rec
		}
		rec.Refs[img.Name] = img.Target.Digest
	}
	return out
}

// retainWithPins adds retained to what s retains.
func retainWithPins(s *statefile.State, retained map[string]*statefile.Archive) {
	for name, rec := range retained {
		if old := s.Retained[name]; old != nil {
			maps.Copy(old.Refs, rec.Refs)
			continue
		}
		s.Retained[name] = rec
	}
}

// rebuildRetained, at the first sync after the state was lost, reads back from the pins in
// listed what was retained, and says so.
func (a *Agent) rebuildRetained(listed imagelist.Records) {
	retained := retainedFromPins(listed, a.present, a.state)
	a.stateLost = false
	if len(retained) == 0 {
		return
	}
	retainWithPins(a.state, retained)
	a.replan()
	n := 0
	for _, rec := range retained {
		n += len(rec.Refs)
	}
	names := slices.Sorted(maps.Keys(retained))
	logrus.Warnf("state rebuilt from containerd: %d reference(s) pinned for %d archive(s) no longer in the images dir (%s) stay pinned, retained, until `k3s-pinning unpin`", n, len(names), firstFew(names))
	a.event(true, ReasonStateRebuilt, "the state was lost: %d reference(s) pinned for %d archive(s) no longer in %s (%s) are kept, retained, until `k3s-pinning unpin`", n, len(names), a.cfg.ImagesDir, firstFew(names))
}
