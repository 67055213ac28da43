package images

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/containerd/containerd/v2/core/images"

	"github.com/k3s-pinning/k3s-pinning/pkg/agent/imagelist"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// Reporter is told what an operator of many nodes needs without a shell on each: every notable
// happening, and the node's protection each time it changes. The cluster package reports them on
// the Node object (Events and a condition). It is called with the agent's lock held: it must
// not block.
type Reporter interface {
	Event(Event)
	Protection(Protection)
}

// ReconcileWatcher is a Reporter that can also say when the agent is stuck: told how to read when
// the agent's last reconcile ended, it reports the agent stalled once none has for stallAfter.
// k3spinning.Start tells a Reporter that implements it (pkg/agent/cluster's Node does).
type ReconcileWatcher interface {
	WatchReconciles(reconciled func() time.Time, stallAfter time.Duration)
}

// WorkloadWatcher follows the images the workloads in scope reference and calls update with all
// of them each time they change, until ctx ends.
type WorkloadWatcher func(ctx context.Context, scope WorkloadScope, update func(WorkloadImages))

// WorkloadScope is whose workloads count for --pinned-workload-images: those of these namespaces
// whose objects match the label selector (Kubernetes syntax; "": every one of them).
type WorkloadScope struct {
	Namespaces []string
	Selector   string
}

// WorkloadImages are the images the workloads in scope name: each reference as a pod spec writes
// it, with the workloads that name it ("Deployment tenant-a/web").
type WorkloadImages map[string][]string

// Event is one notable happening, named in the kubelet's style.
type Event struct {
	Warning bool
	Reason  string
	Message string
}

// The reasons of the agent's events.
const (
	ReasonImageRestored      = "ImageRestored"      // a deleted image is back from its archive
	ReasonImageRestoreFailed = "ImageRestoreFailed" // it could not be yet (retried with backoff)
	ReasonImageLost          = "ImageLost"          // a wanted image was deleted and nothing can restore it
	ReasonImageFetched       = "ImageFetched"       // a missing wanted image was fetched by digest (a peer, a mirror)
	ReasonImageFetchFailed   = "ImageFetchFailed"   // it could not be yet (retried with backoff)
	ReasonArchiveLoadFailed  = "ArchiveLoadFailed"  // a file of the images dir failed to load
	ReasonMisspelledPinLabel = "MisspelledPinLabel" // a label that looks like the pin, which the CRI ignores
	ReasonPinsAdopted        = "PinsAdopted"        // stock k3s's pins taken over at start
	// ReasonStateFileUnreadable: the state file could not be read (damaged, truncated, a newer
	// version's); it is kept aside, nothing was unpinned.
	ReasonStateFileUnreadable = "StateFileUnreadable"
	// ReasonStateRebuilt: the state was lost, and what was retained is read back from the pins.
	ReasonStateRebuilt = "StateRebuilt"
	// ReasonWorkloadImageRefused: a workload's image is not kept: a limit (named in the
	// message, with the workload) holds it back.
	ReasonWorkloadImageRefused = "WorkloadImageRefused"
)

// Protection is the node as the agent last saw it: every wanted reference present and pinned,
// or what is not.
type Protection struct {
	Wanted int `json:"wanted"` // references wanted as of the last sync, present or not
	// Missing are wanted references containerd does not hold: waiting for a restore, or lost.
	Missing []string `json:"missing,omitempty"`
	// Lost are those among Missing that nothing on the node can restore.
	Lost []string `json:"lost,omitempty"`
	// FailedArchives are the files of the images dir that did not load, with why.
	FailedArchives map[string]string `json:"failedArchives,omitempty"`
}

// Protected reports that every wanted reference is present and every archive loaded.
func (p Protection) Protected() bool { return len(p.Missing) == 0 && len(p.FailedArchives) == 0 }

// Summary is one line for people: the condition's message.
func (p Protection) Summary() string {
	if p.Protected() {
		return fmt.Sprintf("all %d wanted image references present and pinned", p.Wanted)
	}
	var parts []string
	if n := len(p.Missing); n > 0 {
		parts = append(parts, fmt.Sprintf("%d of %d wanted image references missing (%s)", n, p.Wanted, firstFew(p.Missing)))
	}
	if n := len(p.Lost); n > 0 {
		parts = append(parts, fmt.Sprintf("%d lost with no archive to restore from (%s)", n, firstFew(p.Lost)))
	}
	if n := len(p.FailedArchives); n > 0 {
		parts = append(parts, fmt.Sprintf("%d archive(s) failed to load (%s)", n, firstFew(slices.Sorted(maps.Keys(p.FailedArchives)))))
	}
	return strings.Join(parts, "; ")
}

func firstFew(s []string) string {
	const few = 3
	if len(s) <= few {
		return strings.Join(s, ", ")
	}
	return fmt.Sprintf("%s and %d more", strings.Join(s[:few], ", "), len(s)-few)
}

func (p Protection) equal(o Protection) bool {
	return p.Wanted == o.Wanted && slices.Equal(p.Missing, o.Missing) && slices.Equal(p.Lost, o.Lost) && maps.Equal(p.FailedArchives, o.FailedArchives)
}

// tracker is what the agent knows of absent references between syncs, and what it reported.
type tracker struct {
	wanted     int             // references wanted as of the last list, present or not
	missing    map[string]bool // wanted references containerd does not hold
	lost       map[string]bool // among missing: nothing can restore them
	misspelled map[string]string
	reported   *Protection
}

func (a *Agent) event(warning bool, reason, format string, args ...any) {
	if a.cfg.Reporter != nil {
		a.cfg.Reporter.Event(Event{Warning: warning, Reason: reason, Message: fmt.Sprintf(format, args...)})
	}
}

// trackListed resets what is missing from a list of the whole store, after a sync has published
// its keep-set from it: wanted
// references it lacks are missing (lost ones stay lost until they come back), and each misspelled
// pin label is reported once.
func (a *Agent) trackListed(listed imagelist.Records) {
	misspelled := map[string]string{}
	for _, img := range listed {
		if m := pinning.MisspelledPin(img.Labels); m != "" {
			misspelled[img.Name] = m
			if a.track.misspelled[img.Name] != m {
				a.event(true, ReasonMisspelledPinLabel, "%s has label %q, which the CRI ignores: the pin label is %s=%s", img.Name, m, pinning.LabelPinned, pinning.PinnedValue)
			}
		}
	}
	a.track.misspelled = misspelled
	names := func(ref string) bool { _, ok := listed.Find(ref); return ok }
	missing := map[string]bool{}
	for ref := range a.plan.Provided() {
		if !names(ref) {
			missing[ref] = true
		}
	}
	if a.cfg.Fetch {
		for ref := range a.plan.Fetchables() { // wanted wherever they are: fetched when missing
			if !names(ref) {
				missing[ref] = true
			}
		}
	}
	for ref := range a.track.lost {
		_, wanted := a.plan.Source(images.Image{Name: ref})
		switch {
		case names(ref):
			delete(a.track.lost, ref) // back
		case !wanted:
			delete(a.track.lost, ref) // nothing wants it any more: not missing
		default:
			missing[ref] = true
		}
	}
	a.track.missing = missing
	// Wanted: what the list holds that the plan wants, and what it lacks. The keep-set just
	// published from this list has decided each name: a lookup, not the plan asked a third time
	// per image (PinWanted and publish asked it already).
	a.track.wanted = len(missing)
	for _, img := range listed {
		if !imagelist.IsImageID(img.Name) && a.keeper.Wanted(img.Name) {
			a.track.wanted++
		}
	}
}

// trackDeleted notes that a wanted reference was deleted. It is missing until it is back (a
// restore from its archive, a fetch, or the next sync's load); with nothing to bring it back
// (from ""), it is lost.
func (a *Agent) trackDeleted(name, from string) {
	a.track.missing[name] = true
	if from == "" && !a.track.lost[name] {
		a.track.lost[name] = true
		a.event(true, ReasonImageLost, "%s was deleted and nothing in the images dir provides it: import it again (k3s-pinning keeps it from then on)", name)
	}
}

// trackCreated notes that a reference is back (restored, or imported by hand).
func (a *Agent) trackCreated(name string) {
	delete(a.track.missing, name)
	delete(a.track.lost, name)
}

// protection is the node's protection now.
func (a *Agent) protection() Protection {
	p := Protection{
		Wanted:  a.track.wanted,
		Missing: slices.Sorted(maps.Keys(a.track.missing)),
		Lost:    slices.Sorted(maps.Keys(a.track.lost)),
	}
	if len(a.state.Agent.ArchiveErrors) > 0 {
		p.FailedArchives = maps.Clone(a.state.Agent.ArchiveErrors)
	}
	return p
}

// reportProtection tells the reporter the node's protection if it changed since it was last told.
func (a *Agent) reportProtection() {
	if a.cfg.Reporter == nil {
		return
	}
	p := a.protection()
	if a.track.reported != nil && a.track.reported.equal(p) {
		return
	}
	a.track.reported = &p
	a.cfg.Reporter.Protection(p)
}
