package containerdtest_test

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/k3s-pinning/k3s-pinning/pkg/containerdtest"
)

// TestMatrixIsTheBuildDirs: make test-lines runs the agent's tests against each build/containerd-<line>
// directory, and the tests build the line Matrix names: the two lists are one.
func TestMatrixIsTheBuildDirs(t *testing.T) {
	dirs, err := filepath.Glob("../../build/containerd-*")
	if err != nil {
		t.Fatal(err)
	}
	var lines []string
	for _, d := range dirs {
		if fi, err := os.Stat(d); err == nil && fi.IsDir() {
			lines = append(lines, strings.TrimPrefix(filepath.Base(d), "containerd-"))
		}
	}
	slices.Sort(lines)
	want := slices.Sorted(slices.Values(containerdtest.Matrix))
	if len(lines) == 0 || !slices.Equal(lines, want) {
		t.Errorf("build/containerd-* dirs are lines %v, containerdtest.Matrix %v: want the same, and not empty", lines, want)
	}
}
