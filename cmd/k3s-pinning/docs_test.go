package main_test

import (
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"

	"github.com/k3s-pinning/k3s-pinning/internal/docs"
)

// helpFlags are the flags `k3s-pinning CMD --help` lists, for every command `k3s-pinning --help`
// lists (help and version aside).
func helpFlags(t *testing.T) []string {
	t.Helper()
	help := func(args ...string) string {
		out, err := exec.Command(binary, append(args, "--help")...).CombinedOutput()
		if err != nil {
			t.Fatalf("k3s-pinning %s --help: %v\n%s", strings.Join(args, " "), err, out)
		}
		return string(out)
	}
	_, commands, ok := strings.Cut(help(), "COMMANDS:\n")
	if !ok {
		t.Fatal("k3s-pinning --help lists no COMMANDS")
	}
	commands, _, _ = strings.Cut(commands, "\n\n")
	option := regexp.MustCompile(`(?m)^\s+--([a-z0-9][a-z0-9-]*)`)
	seen := map[string]bool{"help": true, "version": true}
	var flags []string
	for _, line := range strings.Split(commands, "\n") {
		name := strings.TrimSuffix(strings.Fields(line + " x")[0], ",")
		if name == "help" || name == "x" {
			continue
		}
		for _, m := range option.FindAllStringSubmatch(help(name), -1) {
			if !seen[m[1]] {
				seen[m[1]] = true
				flags = append(flags, m[1])
			}
		}
	}
	if len(flags) < 10 {
		t.Fatalf("read %d flags from the commands' help (%q): the help's format changed?", len(flags), flags)
	}
	return flags
}

// Every flag of the command is in a table of docs/operators.md.
func TestDocsNameEveryFlag(t *testing.T) {
	data, err := os.ReadFile("../../docs/operators.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, missing := range docs.MissingFlags(string(data), helpFlags(t)) {
		t.Errorf("docs/operators.md: no table names %s, which `k3s-pinning --help` lists", missing)
	}
}
