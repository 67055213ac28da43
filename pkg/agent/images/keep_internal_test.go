package images

import (
	"fmt"
	"testing"

	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// BenchmarkKeep is one kubelet GC pass's worth of questions: 5,000 images, 1,000 of them wanted,
// with the CRI's three names each, and a --pinned-images glob to try on the others.
func BenchmarkKeep(b *testing.B) {
	policy, err := pinning.NewPolicy([]string{"registry.local/pinned/*"}, nil)
	if err != nil {
		b.Fatal(err)
	}
	k := &Keeper{policy: policy}
	set := &keepSet{names: map[string]bool{}, ids: map[string]bool{}}
	type criImage struct {
		id          string
		tags, dgsts []string
	}
	var listed []criImage
	for i := range 5000 {
		img := criImage{
			id:    fmt.Sprintf("sha256:%064x", i),
			tags:  []string{fmt.Sprintf("registry.local/app%d:1.0", i)},
			dgsts: []string{fmt.Sprintf("registry.local/app%d@sha256:%064x", i, i+1<<20)},
		}
		if i%5 == 0 {
			set.names[img.tags[0]], set.names[img.dgsts[0]], set.ids[img.id] = true, true, true
		}
		listed = append(listed, img)
	}
	k.set.Store(set)
	b.ResetTimer()
	for b.Loop() {
		kept := 0
		for _, img := range listed {
			if k.Keep(img.id, img.tags, img.dgsts) {
				kept++
			}
		}
		if kept != 1000 {
			b.Fatalf("kept %d of 5000, want 1000", kept)
		}
	}
}
