// Package depcheck checks, in a package's tests, what the package depends on (as
// go-containerregistry's internal/depcheck): a package meant to stay small must not grow a
// dependency on a client, a CLI or a metrics library by accident.
package depcheck

import (
	"os/exec"
	"strings"
	"testing"
)

// Forbid fails t when the package pkg depends on any of forbidden, directly or through another
// package (test files not counted). directOnly are forbidden as direct imports only: a library
// the package uses may log, the package itself does not.
func Forbid(t *testing.T, pkg string, forbidden, directOnly []string) {
	t.Helper()
	deps := goList(t, "-deps", "-f", "{{.ImportPath}}", pkg)
	for _, f := range forbidden {
		for _, d := range deps {
			if d == f || strings.HasPrefix(d, f+"/") {
				t.Errorf("%s depends on %s (through %s): it must not", pkg, f, d)
			}
		}
	}
	imports := goList(t, "-f", `{{join .Imports "\n"}}`, pkg)
	for _, f := range directOnly {
		for _, d := range imports {
			if d == f {
				t.Errorf("%s imports %s: it must not", pkg, f)
			}
		}
	}
}

func goList(t *testing.T, args ...string) []string {
	t.Helper()
	out, err := exec.Command("go", append([]string{"list"}, args...)...).Output()
	if err != nil {
		t.Fatalf("go list %v: %v", args, err)
	}
	return strings.Fields(string(out))
}
