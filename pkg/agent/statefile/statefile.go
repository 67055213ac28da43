// Package statefile is the agent's state file: what each archive of the images dir provided
// (Archive), what the agent retains, and what the running agent is doing (RunStatus), written
// atomically under a lock its writers share (Save, WithLock), read back by Load. It is a cache of
// what containerd holds: losing it costs a re-index, never a pin. It talks to nothing but the
// file system.
package statefile

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/k3s-pinning/k3s-pinning/internal/fault"
	"github.com/k3s-pinning/k3s-pinning/internal/filelock"
	"github.com/k3s-pinning/k3s-pinning/pkg/airgap"
)

// DefaultPath is outside the images dir: k3s must not try to load it as an archive.
const DefaultPath = "/var/lib/rancher/k3s/agent/k3s-pinning/state.json"

const stateVersion = 1

// State is what the agent knows between restarts: per archive, its identity and what it provided,
// and the agent's own view for `status` and `doctor`. Losing it costs a re-index, never a pin:
// pins live in containerd.
type State struct {
	Version  int                 `json:"version"`
	Archives map[string]*Archive `json:"archives"` // by file name
	// Retained are archives removed from the images dir whose references stay pinned
	// (--retain-removed-archive-images), by file name, as last loaded, until `unpin`.
	Retained map[string]*Archive `json:"retained,omitempty"`
	Agent    RunStatus           `json:"agent"`
}

// Archive is one archive as last loaded.
type Archive struct {
	Size    int64     `json:"size"`
	ModTime time.Time `json:"modTime"`
	// Digest is the sha256 of the archive's content (its tar stream, or the list's text), computed
	// only when a recorded archive's size or mtime change: empty after a first load (nothing to
	// compare with then), an archive touched since then is read and checked in containerd once.
	Digest digest.Digest         `json:"digest"`
	Format airgap.Format         `json:"format"`
	Images []airgap.IndexedImage `json:"images"`
	// Refs are every reference loaded from the archive (tags, repo@digest, retags) and the digest
	// each pointed at: what a restore must bring back, and what is unpinned when the archive goes.
	Refs map[string]digest.Digest `json:"refs"`
	// Incomplete: a reference failed in the last load (containerd going away mid-update), so the
	// record may hold a digest the archive no longer has; the next sync loads the archive from the
	// file again, not from this record.
	Incomplete bool `json:"incomplete,omitempty"`
}

// RunStatus is what the running agent is doing (the last reconcile, restores, fetches, errors),
// written with the state so that `status` and `doctor`, run as other processes, can show it.
type RunStatus struct {
	LastReconcile   time.Time         `json:"lastReconcile"`
	RestoresDone    int               `json:"restoresDone"`
	RestoresFailed  int               `json:"restoresFailed"`
	RestoresPending []string          `json:"restoresPending"` // references waiting to be restored
	WaitingForDisk  []string          `json:"waitingForDisk"`  // pending because the disk is full
	ArchiveErrors   map[string]string `json:"archiveErrors"`   // file -> error
	StateError      string            `json:"stateError,omitempty"`
	// Fetches (--fetch-missing-images): done and failed attempts, the references waiting for
	// one, and the last error of each that failed.
	FetchesDone    int               `json:"fetchesDone,omitempty"`
	FetchesFailed  int               `json:"fetchesFailed,omitempty"`
	FetchesPending []string          `json:"fetchesPending,omitempty"`
	FetchErrors    map[string]string `json:"fetchErrors,omitempty"` // reference -> error
}

// New is an empty state of this version.
func New() *State {
	return &State{Version: stateVersion, Archives: map[string]*Archive{}, Retained: map[string]*Archive{}}
}

// Load reads path. A missing file (the error is fs.ErrNotExist), an unreadable one (damaged,
// truncated, or written by a newer version) is an empty state and an error: the state is a cache
// of what containerd holds, which the next sync rebuilds.
func Load(path string) (*State, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return New(), fmt.Errorf("state %s: %w", path, err)
	}
	s := New()
	if err := json.Unmarshal(data, s); err != nil || s.Version != stateVersion {
		if err == nil {
			err = fmt.Errorf("version %d, want %d", s.Version, stateVersion)
		}
		return New(), fmt.Errorf("state %s unreadable, re-indexing: %w", path, err)
	}
	if s.Archives == nil {
		s.Archives = map[string]*Archive{}
	}
	if s.Retained == nil {
		s.Retained = map[string]*Archive{}
	}
	return s, nil
}

// Save writes the state atomically (temp file, fsync, rename) with mode 0600, in a dir of mode
// 0700: it names every archive and image of the node. On a full or read-only disk it fails and
// leaves the previous file whole; the caller keeps the state in memory. Writers (the daemon, a
// `sync` beside it) take turns on a lock file; holding it, a writer removes the temporary files
// that a writer killed mid-write left, since no live writer can own one.
func (s *State) Save(path string) error {
	return WithLock(path, func() error { return s.WriteLocked(path) })
}

// WithLock calls f holding the lock of the state file at path, the writers' turn: a writer
// that reads the file, changes it and writes it back does all three in one turn, so that no other
// writer's save falls between its read and its write and is lost.
func WithLock(path string, f func() error) error {
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("state dir %s: %w", dir, err)
	}
	unlock, err := lockDir(dir)
	if err != nil {
		return fmt.Errorf("state %s: %w", path, err)
	}
	defer unlock()
	return f()
}

// WriteLocked is Save's write, its caller holding the lock (WithLock): a writer that read the
// file, changed it and writes it back does all three in one turn.
func (s *State) WriteLocked(path string) error {
	dir := filepath.Dir(path)
	stale, _ := filepath.Glob(filepath.Join(dir, ".state-*.json"))
	for _, f := range stale {
		os.Remove(f)
	}
	tmp, err := os.CreateTemp(dir, ".state-*.json")
	if err != nil {
		return fmt.Errorf("state %s: %w", path, err)
	}
	defer os.Remove(tmp.Name())
	if err := tmp.Chmod(0o600); err != nil {
		tmp.Close()
		return err
	}
	if err := s.encode(tmp, func() {
		fault.Point("state-write") // a crash here leaves half a temp file, never half a state file
	}); err != nil {
		tmp.Close()
		return fmt.Errorf("state %s: %w", path, err)
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return fmt.Errorf("state %s: %w", path, err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("state %s: %w", path, err)
	}
	fault.Point("state-rename")
	if err := os.Rename(tmp.Name(), path); err != nil {
		return fmt.Errorf("state %s: %w", path, err)
	}
	if d, err := os.Open(dir); err == nil {
		d.Sync()
		d.Close()
	}
	return nil
}

// encode writes s to w as json.MarshalIndent(s, "", "  ") would, one archive at a time: the
// whole document at once was the highest point of a first sync's memory (twice the file's size
// in buffers). halfway is called once the archives are written.
func (s *State) encode(w io.Writer, halfway func()) error {
	bw := bufio.NewWriter(w)
	fmt.Fprintf(bw, "{\n  \"version\": %d,\n  \"archives\": ", s.Version)
	if err := encodeArchives(bw, s.Archives); err != nil {
		return err
	}
	if err := bw.Flush(); err != nil {
		return err
	}
	halfway()
	if len(s.Retained) > 0 {
		bw.WriteString(",\n  \"retained\": ")
		if err := encodeArchives(bw, s.Retained); err != nil {
			return err
		}
	}
	agent, err := json.MarshalIndent(s.Agent, "  ", "  ")
	if err != nil {
		return err
	}
	bw.WriteString(",\n  \"agent\": ")
	bw.Write(agent)
	bw.WriteString("\n}")
	return bw.Flush()
}

// encodeArchives writes m, an object at the state's second level, as MarshalIndent would.
func encodeArchives(bw *bufio.Writer, m map[string]*Archive) error {
	switch {
	case m == nil:
		bw.WriteString("null")
		return nil
	case len(m) == 0:
		bw.WriteString("{}")
		return nil
	}
	bw.WriteString("{\n")
	for i, name := range slices.Sorted(maps.Keys(m)) {
		key, err := json.Marshal(name)
		if err != nil {
			return err
		}
		value, err := json.MarshalIndent(m[name], "    ", "  ")
		if err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		bw.WriteString("    ")
		bw.Write(key)
		bw.WriteString(": ")
		bw.Write(value)
		if i < len(m)-1 {
			bw.WriteByte(',')
		}
		bw.WriteByte('\n')
	}
	bw.WriteString("  }")
	return nil
}

// setAsideSuffix, then the time, names a state file this version could not read, kept beside it.
const setAsideSuffix = ".unreadable-"

// SetAside moves the state file at path aside, under a name no other file has, rather than let a
// save replace it: what it held is the operator's to look at.
func SetAside(path string) (string, error) {
	aside := path + setAsideSuffix + time.Now().UTC().Format("20060102T150405.000000000Z")
	if err := os.Link(path, aside); err != nil {
		return "", fmt.Errorf("state %s: keeping it aside: %w", path, err)
	}
	if err := os.Remove(path); err != nil {
		return "", fmt.Errorf("state %s: keeping it aside: %w", path, err)
	}
	return aside, nil
}

// SetAsideFiles are the state files kept aside beside path because they could not be read,
// oldest first.
func SetAsideFiles(path string) []string {
	entries, err := os.ReadDir(filepath.Dir(path))
	if err != nil {
		return nil
	}
	var out []string
	prefix := filepath.Base(path) + setAsideSuffix
	for _, e := range entries { // in name order: the time in the name sorts them
		if strings.HasPrefix(e.Name(), prefix) {
			out = append(out, filepath.Join(filepath.Dir(path), e.Name()))
		}
	}
	return out
}

// lockDir takes the state writers' lock in dir; the kernel releases it if the holder dies.
func lockDir(dir string) (unlock func(), err error) {
	f, err := os.OpenFile(filepath.Join(dir, ".state.lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, err
	}
	if err := filelock.Lock(f); err != nil {
		f.Close()
		return nil, err
	}
	return func() { f.Close() }, nil
}

// unchanged reports whether ar is the archive recorded, by size and mtime (as k3s decides), and
// its last load completed, so that a restart does not read, hash or import it.
func (as *Archive) Unchanged(ar airgap.Archive) bool {
	return as != nil && !as.Incomplete && as.Size == ar.Size && as.ModTime.Equal(ar.ModTime)
}

// index is the recorded index of the archive, as airgap.Read would return it.
func (as *Archive) Index(ar airgap.Archive) *airgap.Index {
	return &airgap.Index{Archive: ar, Format: as.Format, Images: as.Images}
}
