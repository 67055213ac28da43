package airgap_test

import (
	"archive/tar"
	"bufio"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/klauspost/compress/zstd"

	"github.com/k3s-pinning/k3s-pinning/pkg/airgap"
)

// writeLongNames writes a tarball of n empty entries, each with a name of nameLen bytes (a PAX
// header carries it), compressed by the file's ending (.tar or .tar.zst).
func writeLongNames(t *testing.T, path string, n, nameLen int) {
	t.Helper()
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var w io.WriteCloser = nopCloser{f}
	if strings.HasSuffix(path, ".zst") {
		if w, err = zstd.NewWriter(f, zstd.WithEncoderLevel(zstd.SpeedFastest)); err != nil {
			t.Fatal(err)
		}
	}
	tw := tar.NewWriter(w)
	for i := range n {
		name := fmt.Sprintf("%08d", i) + strings.Repeat("n", nameLen-8)
		if err := tw.WriteHeader(&tar.Header{Name: name, Typeflag: tar.TypeReg, Mode: 0o644, Format: tar.FormatPAX}); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
}

type nopCloser struct{ io.Writer }

func (nopCloser) Close() error { return nil }

// TestLongEntryNamesAreRefusedWithinBounds (issue "Trust", item 8): an archive of 300 empty entries
// with names of a million bytes (15 KB as .tar.zst), or of many entries with names of an image
// tool's length, is refused with the file named, and indexing it costs the process under 64 MiB
// over its idle resident size (measured in a child process: its peak, VmHWM, against its
// resident size before the read).
func TestLongEntryNamesAreRefusedWithinBounds(t *testing.T) {
	dir := t.TempDir()
	for _, c := range []struct {
		file    string
		n, name int
		want    string
	}{
		{"long-names.tar.zst", 300, 1_000_000, "name of 1000000 bytes"},
		{"long-names.tar", 300, 1_000_000, "name of 1000000 bytes"},
		{"many-names.tar.zst", 5_000, 4_000, "MiB of entry names"},
		{"many-entries.tar.zst", 250_000, 20, "entries"},
	} {
		t.Run(c.file, func(t *testing.T) {
			path := filepath.Join(dir, c.file)
			writeLongNames(t, path, c.n, c.name)
			fi, _ := os.Stat(path)
			cmd := exec.Command(os.Args[0])
			cmd.Env = append(os.Environ(), "AIRGAP_BOUNDS_CHILD="+path)
			out, err := cmd.CombinedOutput()
			if err != nil {
				t.Fatalf("child: %v\n%s", err, out)
			}
			var idle, peak int64
			var readErr string
			sc := bufio.NewScanner(strings.NewReader(string(out)))
			for sc.Scan() {
				line := strings.TrimSpace(sc.Text())
				if v, ok := strings.CutPrefix(line, "idle-kib "); ok {
					idle, _ = strconv.ParseInt(v, 10, 64)
				}
				if v, ok := strings.CutPrefix(line, "peak-kib "); ok {
					peak, _ = strconv.ParseInt(v, 10, 64)
				}
				if v, ok := strings.CutPrefix(line, "error "); ok {
					readErr = v
				}
			}
			if idle == 0 || peak == 0 {
				t.Fatalf("the child reported no memory:\n%s", out)
			}
			t.Logf("%s (%d bytes): %s; resident %d KiB idle, %d KiB at its peak", c.file, fi.Size(), readErr, idle, peak)
			if !strings.Contains(readErr, path) || !strings.Contains(readErr, c.want) {
				t.Errorf("error %q, want it to name %s and say %q", readErr, path, c.want)
			}
			if peak-idle > 64<<10 {
				t.Errorf("indexing took the process from %d to %d KiB resident: over 64 MiB", idle, peak)
			}
		})
	}
}

// TestMain runs the test binary as TestLongEntryNamesAreRefusedWithinBounds's child when
// AIRGAP_BOUNDS_CHILD names an archive: the child reads it and prints its resident size before
// the read and its peak after. A child of its own, so that the peak is the read's alone.
func TestMain(m *testing.M) {
	if path := os.Getenv("AIRGAP_BOUNDS_CHILD"); path != "" {
		if err := indexChild(path); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func indexChild(path string) error {
	a, err := airgap.At(path)
	if err != nil {
		return err
	}
	idle, err := procStatus("VmRSS")
	if err != nil {
		return err
	}
	fmt.Printf("idle-kib %d\n", idle)
	_, _, readErr := airgap.ReadFile(a)
	peak, err := procStatus("VmHWM")
	if err != nil {
		return err
	}
	fmt.Printf("peak-kib %d\nerror %v\n", peak, readErr)
	return nil
}

// procStatus is a field of /proc/self/status, in KiB.
func procStatus(field string) (int64, error) {
	data, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, field+":"); ok {
			return strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
		}
	}
	return 0, fmt.Errorf("no %s in /proc/self/status", field)
}
