package docs

import (
	"crypto/sha256"
	"encoding/hex"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/k3s-pinning/k3s-pinning/pkg/k3spinning"
)

// root is the repository, two levels above this package.
const root = "../.."

// markdownFiles are the files the checks read: README.md and docs/*.md.
func markdownFiles(t *testing.T) []string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no docs/*.md under %s (%v)", root, err)
	}
	return append([]string{filepath.Join(root, "README.md")}, files...)
}

func read(t *testing.T, path string) string {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(data)
}

// brokenLinks are the relative links of file that do not resolve: a file or dir that is not
// there, or a fragment no heading of the target makes.
func brokenLinks(t *testing.T, file string) []string {
	t.Helper()
	var broken []string
	for _, l := range Links(read(t, file)) {
		if strings.Contains(l.Target, "://") || strings.HasPrefix(l.Target, "mailto:") {
			continue
		}
		path, fragment, _ := strings.Cut(l.Target, "#")
		target := file
		if path != "" {
			target = filepath.Join(filepath.Dir(file), path)
			if _, err := os.Stat(target); err != nil {
				broken = append(broken, l.where(file)+": no such file: "+path)
				continue
			}
		}
		if fragment != "" && strings.HasSuffix(target, ".md") && !Anchors(read(t, target))[fragment] {
			broken = append(broken, l.where(file)+": no heading in "+filepath.Base(target)+" makes #"+fragment)
		}
	}
	return broken
}

func (l Link) where(file string) string {
	rel, _ := filepath.Rel(root, file)
	return rel + ":" + strconv.Itoa(l.Line) + ": " + l.Target
}

func TestRelativeLinksResolve(t *testing.T) {
	for _, file := range markdownFiles(t) {
		for _, b := range brokenLinks(t, file) {
			t.Error(b)
		}
	}
}

// The check above must be able to fail: a copy of a doc with a link to a file that is not there,
// and one to a heading that is not there.
func TestBrokenLinksAreFound(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "docs")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(dir, "x.md")
	os.WriteFile(filepath.Join(dir, "y.md"), []byte("# Y\n## Has `code`: and --flags\n"), 0o644)
	os.WriteFile(file, []byte("# X\n[ok](y.md#has-code-and---flags) [gone](z.md) [nohead](y.md#nope)\n"+
		"```\n[in code](nothere.md)\n```\n`[span](nothere.md)` [self](#x)\n"), 0o644)
	broken := brokenLinks(t, file)
	if len(broken) != 2 || !strings.Contains(broken[0], "no such file: z.md") || !strings.Contains(broken[1], "#nope") {
		t.Fatalf("broken links: %q, want z.md and #nope only", broken)
	}
}

func TestPictureIsRenderedFromItsSource(t *testing.T) {
	sources, _ := filepath.Glob(filepath.Join(root, "docs", "*.dot"))
	if len(sources) == 0 {
		t.Fatal("no docs/*.dot: the design picture's source is missing")
	}
	for _, src := range sources {
		sum := sha256.Sum256([]byte(read(t, src)))
		svg := strings.TrimSuffix(src, ".dot") + ".svg"
		if !strings.Contains(read(t, svg), "sha256 "+hex.EncodeToString(sum[:])) {
			t.Errorf("%s was not rendered from the current %s: run make docs", filepath.Base(svg), filepath.Base(src))
		}
	}
}

// The k3s flags are in the README's table, each with its K3S_ variable.
func TestK3sFlagsAreInTheReadme(t *testing.T) {
	readme := read(t, filepath.Join(root, "README.md"))
	flags := k3spinning.Flags(&k3spinning.Settings{}, "K3S")
	var names []string
	for _, f := range flags {
		names = append(names, f.Names()[0])
	}
	for _, name := range MissingFlags(readme, names) {
		t.Errorf("README.md: no table names the k3s flag %s", name)
	}
	for _, f := range flags {
		for _, env := range f.(interface{ GetEnvVars() []string }).GetEnvVars() {
			if !strings.Contains(readme, "`"+env+"`") {
				t.Errorf("README.md: the k3s flag --%s's variable %s is not named", f.Names()[0], env)
			}
		}
	}
	if missing := MissingFlags("| `--pinned-images` |\n--pinned-image-labels outside a table\n", names); len(missing) != len(names)-1 {
		t.Errorf("a table naming one flag leaves %q missing, want the other %d", missing, len(names)-1)
	}
}
