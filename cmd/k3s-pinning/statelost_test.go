package main_test

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/k3s-pinning/k3s-pinning/pkg/agent/images"
	"github.com/k3s-pinning/k3s-pinning/pkg/agent/statefile"
	"github.com/k3s-pinning/k3s-pinning/pkg/containerdtest"
	"github.com/k3s-pinning/k3s-pinning/pkg/imagetest"
)

// TestCorruptStateFileKeepsRetainedImages is the check from outside of the issue "Trust": with
// --retain-removed-archive-images, an archive removed (its images stay pinned), `run` stopped,
// `{not json` written into the state file, and `run` started again: the retained images stay
// pinned, retained, the damaged file is kept aside, and doctor names it until it is removed.
func TestCorruptStateFileKeepsRetainedImages(t *testing.T) {
	d := containerdtest.New(t, containerdtest.Options{})
	imagesDir := t.TempDir()
	img, _ := imagetest.Image(32<<10, imagetest.Amd64)
	apps := filepath.Join(imagesDir, "apps.tar")
	if err := imagetest.WriteDocker(apps, map[string]v1.Image{"acc.example/app:1.0": img}); err != nil {
		t.Fatal(err)
	}
	state := filepath.Join(t.TempDir(), "state.json")
	common := []string{"--containerd-address", d.Address, "--images-dir", imagesDir, "--state-file", state}
	runArgs := append([]string{"--retain-removed-archive-images"}, common...)
	// awaitRetained waits for the state file to retain apps.tar's tag, pinned as status shows it.
	awaitRetained := func(p *agentProcess, what string) {
		t.Helper()
		p.awaitState(t, state, what+": apps.tar retained in the state file", func(s *statefile.State) bool {
			return s.Retained["apps.tar"] != nil && s.Retained["apps.tar"].Refs["acc.example/app:1.0"] != ""
		})
		out, _, code := run(t, append([]string{"status", "-o", "json"}, common...)...)
		var doc struct {
			Images []images.RefStatus `json:"images"`
		}
		if err := json.Unmarshal([]byte(out), &doc); err != nil || code != 0 {
			t.Fatalf("%s: status -o json exit %d: %v\n%s", what, code, err, out)
		}
		var n int
		for _, r := range doc.Images {
			if strings.HasPrefix(r.Ref, "acc.example/app") {
				n++
				if !r.Pinned || !r.Wanted || !r.Retained || r.Source != "apps.tar" {
					t.Errorf("%s: %+v, want pinned, wanted, retained for apps.tar", what, r)
				}
			}
		}
		if n != 2 {
			t.Errorf("%s: status lists %d reference(s) of acc.example/app, want the tag and its digest reference", what, n)
		}
	}

	first := startRun(t, runArgs...)
	first.awaitState(t, state, "apps.tar loaded", func(s *statefile.State) bool { return s.Archives["apps.tar"] != nil })
	if err := os.Remove(apps); err != nil {
		t.Fatal(err)
	}
	awaitRetained(first, "after apps.tar was removed")
	first.stop(t)

	if err := os.WriteFile(state, []byte("{not json"), 0o600); err != nil {
		t.Fatal(err)
	}
	second := startRun(t, runArgs...)
	awaitRetained(second, "after a restart on a corrupt state file")
	second.stop(t)
	if log := second.stderr.String(); strings.Contains(log, "unpinned acc.example/app") {
		t.Errorf("the restart unpinned a retained image:\n%s", log)
	}
	aside := statefile.SetAsideFiles(state)
	if len(aside) != 1 {
		t.Fatalf("kept aside: %v, want the corrupt file", aside)
	}
	if b, _ := os.ReadFile(aside[0]); string(b) != "{not json" {
		t.Errorf("%s holds %q, want the corrupt file's bytes", aside[0], b)
	}
	out, _, code := run(t, append([]string{"doctor"}, common...)...)
	if code != 1 || !strings.Contains(out, aside[0]) {
		t.Errorf("doctor: exit %d, want 1 naming %s:\n%s", code, aside[0], out)
	}
	if err := os.Remove(aside[0]); err != nil {
		t.Fatal(err)
	}
	if out, _, code := run(t, append([]string{"doctor"}, common...)...); code != 0 {
		t.Errorf("doctor with the kept-aside file removed: exit %d, want 0:\n%s", code, out)
	}
}
