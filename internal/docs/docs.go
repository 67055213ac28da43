// Package docs reads the project's Markdown (README.md and docs/) for the checks that keep it
// true: every relative link resolves, and the flag tables name every flag the commands take.
package docs

import (
	"regexp"
	"strconv"
	"strings"
	"unicode"
)

// Link is a Markdown link or image target, where it was found.
type Link struct {
	Line   int
	Target string // as written: a path, a path#fragment, or #fragment
}

var linkPattern = regexp.MustCompile(`!?\[[^\]]*\]\(([^)\s]+)\)`)

// Links are the links of a Markdown text outside code: fenced blocks and `code spans` are skipped,
// as a renderer does.
func Links(markdown string) []Link {
	var out []Link
	fenced := false
	for i, line := range strings.Split(markdown, "\n") {
		if strings.HasPrefix(strings.TrimSpace(line), "```") {
			fenced = !fenced
			continue
		}
		if fenced {
			continue
		}
		for _, m := range linkPattern.FindAllStringSubmatch(withoutCodeSpans(line), -1) {
			out = append(out, Link{Line: i + 1, Target: m[1]})
		}
	}
	return out
}

func withoutCodeSpans(line string) string {
	parts := strings.Split(line, "`")
	for i := 1; i < len(parts); i += 2 {
		parts[i] = ""
	}
	return strings.Join(parts, "`")
}

// Anchors are the fragments a Markdown text's headings can be linked by, as GitHub makes them:
// lower case, punctuation but '-' and '_' dropped, spaces to '-', a repeated one numbered.
func Anchors(markdown string) map[string]bool {
	out := map[string]bool{}
	seen := map[string]int{}
	fenced := false
	for _, line := range strings.Split(markdown, "\n") {
		if strings.HasPrefix(strings.TrimSpace(line), "```") {
			fenced = !fenced
			continue
		}
		if fenced || !strings.HasPrefix(line, "#") {
			continue
		}
		text := strings.TrimSpace(strings.TrimLeft(line, "#"))
		var b strings.Builder
		for _, r := range strings.ToLower(text) {
			switch {
			case r == ' ':
				b.WriteRune('-')
			case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r):
				b.WriteRune(r)
			}
		}
		anchor := b.String()
		if n := seen[anchor]; n > 0 {
			out[anchor+"-"+strconv.Itoa(n)] = true
		} else {
			out[anchor] = true
		}
		seen[anchor]++
	}
	return out
}

var (
	codeSpan = regexp.MustCompile("`[^`]+`")
	flagName = regexp.MustCompile(`(?:^|[\s\[(])(--[a-z0-9][a-z0-9-]*)`)
)

// TableFlags are the flags that the rows of a Markdown text's tables name in code spans
// (`--name`, `status --cluster [--kubeconfig F]`).
func TableFlags(markdown string) map[string]bool {
	out := map[string]bool{}
	for _, line := range strings.Split(markdown, "\n") {
		if !strings.HasPrefix(strings.TrimSpace(line), "|") {
			continue
		}
		for _, span := range codeSpan.FindAllString(line, -1) {
			for _, m := range flagName.FindAllStringSubmatch(strings.Trim(span, "`"), -1) {
				out[m[1]] = true
			}
		}
	}
	return out
}

// MissingFlags are those of names (long flag names, without dashes) that no table row of markdown
// names.
func MissingFlags(markdown string, names []string) []string {
	named := TableFlags(markdown)
	var missing []string
	for _, name := range names {
		if !named["--"+name] {
			missing = append(missing, "--"+name)
		}
	}
	return missing
}
