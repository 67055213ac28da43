// Package airgap reads the k3s air-gap images dir: which files k3s would load (Scan), and what
// each provides (Read), without importing anything. It is pure: no containerd client, no logging;
// every problem is an error naming the file (ArchiveError).
package airgap

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/rancher/wharfie/pkg/tarfile"
)

// Archive is one file in the images dir that k3s would load: an image tarball or a .txt list.
type Archive struct {
	Path    string
	Size    int64
	ModTime time.Time
}

// Name is the file name, which is how pins record their source.
func (a Archive) Name() string { return filepath.Base(a.Path) }

// IsList reports whether the archive is a .txt list of references to pull rather than a tarball.
func (a Archive) IsList() bool { return hasSuffixFold(a.Path, ".txt") }

// ArchiveError is a problem with one file of the images dir. It never stops the other files.
type ArchiveError struct {
	Path string
	Line int // 1-based line of a .txt list, 0 when the error is about the whole file
	Err  error
}

func (e *ArchiveError) Error() string {
	if e.Line > 0 {
		return fmt.Sprintf("%s:%d: %v", e.Path, e.Line, e.Err)
	}
	return fmt.Sprintf("%s: %v", e.Path, e.Err)
}

func (e *ArchiveError) Unwrap() error { return e.Err }

// SupportedExtensions are the file endings k3s loads from the images dir.
var SupportedExtensions = append([]string{".txt"}, tarfile.SupportedExtensions...)

// Scan lists the archives in dir, sorted by name. Sub-directories and hidden files (k3s keeps its
// .cache.json there) are passed over; any other file with an ending k3s does not load is
// reported as an ArchiveError, and the rest are still returned. A missing dir holds no archives.
func Scan(dir string) ([]Archive, []error) {
	entries, err := os.ReadDir(dir)
	if os.IsNotExist(err) {
		return nil, nil
	}
	if err != nil {
		return nil, []error{&ArchiveError{Path: dir, Err: fmt.Errorf("%w: %w", ErrDirUnreadable, err)}}
	}
	var (
		archives []Archive
		errs     []error
	)
	for _, e := range entries {
		name := e.Name()
		path := filepath.Join(dir, name)
		if strings.HasPrefix(name, ".") {
			continue
		}
		ar, err := At(path)
		if errors.Is(err, errIsDir) {
			continue
		}
		if err != nil {
			errs = append(errs, err)
			continue
		}
		archives = append(archives, ar)
	}
	sort.Slice(archives, func(i, j int) bool { return archives[i].Path < archives[j].Path })
	return archives, errs
}

var (
	errIsDir = errors.New("is a directory")
	// ErrDirUnreadable is an images dir that exists but cannot be listed (permissions, I/O error):
	// not an empty dir, so nothing left it.
	ErrDirUnreadable = errors.New("images dir unreadable")
)

// At is the archive at path. Symlinks are followed wherever they point, as k3s does when it
// opens them (archives are often links to read-only media); the link's name is the archive's
// name. Only regular files are archives.
func At(path string) (Archive, error) {
	info, err := os.Stat(path)
	if err != nil {
		return Archive{}, &ArchiveError{Path: path, Err: err}
	}
	if info.IsDir() {
		return Archive{}, errIsDir
	}
	if !info.Mode().IsRegular() {
		// A FIFO or device (or a symlink to one) would block or never end when read.
		return Archive{}, &ArchiveError{Path: path, Err: fmt.Errorf("not a regular file (%s)", info.Mode().Type())}
	}
	if !supported(path) {
		return Archive{}, &ArchiveError{Path: path, Err: fmt.Errorf("unsupported file type; k3s loads %s",
			strings.Join(SupportedExtensions, " "))}
	}
	return Archive{Path: path, Size: info.Size(), ModTime: info.ModTime()}, nil
}

func supported(name string) bool {
	for _, ext := range SupportedExtensions {
		if hasSuffixFold(name, ext) {
			return true
		}
	}
	return false
}

func hasSuffixFold(s, suffix string) bool {
	return len(s) >= len(suffix) && strings.EqualFold(s[len(s)-len(suffix):], suffix)
}
