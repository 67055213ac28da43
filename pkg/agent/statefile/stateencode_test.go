package statefile

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/k3s-pinning/k3s-pinning/pkg/airgap"
)

// TestStateIsWrittenAsMarshalIndentWritesIt: the state is written one archive at a time (its
// whole document at once was a first sync's highest memory); the file is the one
// json.MarshalIndent made, byte for byte, for states with and without retained archives, empty
// and nil maps, and names JSON escapes. halfway comes after the archives, before the rest.
func TestStateIsWrittenAsMarshalIndentWritesIt(t *testing.T) {
	archive := func(n int) *Archive {
		as := &Archive{Size: int64(1000 + n), ModTime: time.Date(2026, 12, 6, 15, 0, n, 7, time.UTC), Digest: digest.FromString(string(rune('a' + n))), Format: airgap.DockerArchive, Refs: map[string]digest.Digest{}}
		for i := range n {
			ref := "registry.example/app" + string(rune('a'+i)) + ":1.0"
			as.Images = append(as.Images, airgap.IndexedImage{Ref: ref, Digest: digest.FromString(ref), ImageID: digest.FromString(ref + "id")})
			as.Refs[ref] = digest.FromString(ref)
		}
		return as
	}
	states := map[string]*State{
		"new":       New(),
		"nil maps":  {Version: stateVersion},
		"no images": {Version: stateVersion, Archives: map[string]*Archive{"empty.tar": {Format: airgap.DockerArchive}}},
		"archives and retained": {Version: stateVersion,
			Archives: map[string]*Archive{"b.tar": archive(3), "a.tar.zst": archive(2), `odd "<&>" name.tar`: archive(1)},
			Retained: map[string]*Archive{"gone.tar": archive(2)},
			Agent:    RunStatus{LastReconcile: time.Date(2026, 12, 6, 15, 1, 0, 0, time.UTC), RestoresDone: 2, RestoresPending: []string{"registry.example/appa:1.0"}, ArchiveErrors: map[string]string{"bad.tar": "truncated"}}},
	}
	// encode writes State's fields by name: one added to State must be added there too.
	var fields []string
	for i, st := 0, reflect.TypeFor[State](); i < st.NumField(); i++ {
		fields = append(fields, st.Field(i).Name)
	}
	if want := []string{"Version", "Archives", "Retained", "Agent"}; !slices.Equal(fields, want) {
		t.Fatalf("State's fields are %v; encode writes %v: write the new ones in encode", fields, want)
	}
	for name, s := range states {
		t.Run(name, func(t *testing.T) {
			want, err := json.MarshalIndent(s, "", "  ")
			if err != nil {
				t.Fatal(err)
			}
			var got bytes.Buffer
			var atHalfway int
			if err := s.encode(&got, func() { atHalfway = got.Len() }); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got.Bytes(), want) {
				t.Fatalf("encode wrote\n%s\nMarshalIndent\n%s", got.Bytes(), want)
			}
			if archivesEnd := bytes.Index(want, []byte(`  "agent"`)); atHalfway == 0 || atHalfway >= archivesEnd {
				t.Errorf("halfway after %d bytes: want after the archives, before the agent's view at %d", atHalfway, archivesEnd)
			}
			path := filepath.Join(t.TempDir(), "state.json")
			if err := s.Save(path); err != nil {
				t.Fatal(err)
			}
			if onFile, err := os.ReadFile(path); err != nil || !bytes.Equal(onFile, want) {
				t.Fatalf("Save wrote %d bytes (%v), want the %d of MarshalIndent", len(onFile), err, len(want))
			}
		})
	}
}
