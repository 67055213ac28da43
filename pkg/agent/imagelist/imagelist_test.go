package imagelist_test

import (
	"context"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
	"unsafe"

	containerdimages "github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"google.golang.org/grpc"

	"github.com/k3s-pinning/k3s-pinning/pkg/agent/imagelist"
	"github.com/k3s-pinning/k3s-pinning/pkg/containerdtest"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// TestImageListIsContainerdsOwn: the agent's image list (decoded one record at a time, equal
// labels and targets shared) answers what containerd's client answers, record for record, with
// and without filters; and the records with the same labels share one map, those with the same
// target one descriptor's strings: at 10,000 references the list was most of a sync's memory.
func TestImageListIsContainerdsOwn(t *testing.T) {
	client, err := containerdtest.New(t, containerdtest.Options{}).Client()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.Close() })
	ctx, cancel := context.WithTimeout(namespaces.WithNamespace(context.Background(), pinning.DefaultNamespace), 5*time.Minute)
	t.Cleanup(cancel)
	store := client.ImageService()
	target := func(i int, annotated bool) ocispec.Descriptor {
		d := ocispec.Descriptor{MediaType: ocispec.MediaTypeImageManifest, Digest: digest.FromString(fmt.Sprint("target", i)), Size: int64(100 + i)}
		if annotated {
			d.Annotations = map[string]string{"org.opencontainers.image.ref.name": fmt.Sprint(i)}
		}
		return d
	}
	for i := range 60 {
		var labels map[string]string
		switch i % 4 {
		case 0: // pinned by an archive of ten images
			labels = pinning.PinLabels(fmt.Sprintf("a%d.tar", i/10))
		case 1:
			labels = map[string]string{"io.cri-containerd.image": "managed", "team": fmt.Sprint(i)}
		case 2: // none
		case 3:
			labels = map[string]string{"io.cri-containerd.image": "managed"}
		}
		for _, name := range []string{fmt.Sprintf("list.example/app%d:1.0", i), fmt.Sprintf("list.example/app%d@%s", i, target(i/2, i%3 == 0).Digest)} {
			if _, err := store.Create(ctx, containerdimages.Image{Name: name, Labels: labels, Target: target(i/2, i%3 == 0)}); err != nil {
				t.Fatal(err)
			}
		}
	}
	ours := imagelist.NewStore(store, client.Conn().(*grpc.ClientConn))
	byName := func(a, b containerdimages.Image) int { return strings.Compare(a.Name, b.Name) }
	for _, filters := range [][]string{nil, {`name~="app1"`}, {`labels."io.cri-containerd.image"==managed`, `name~="@"`}, {`name==nothing.example/none:1`}} {
		want, err := store.List(ctx, filters...)
		if err != nil {
			t.Fatal(err)
		}
		got, err := ours.List(ctx, filters...)
		if err != nil {
			t.Fatalf("list %q: %v", filters, err)
		}
		slices.SortFunc(want, byName)
		slices.SortFunc(got, byName)
		if !reflect.DeepEqual(got, want) {
			t.Errorf("list %q: %d records, containerd's client %d; differ:\n got  %+v\n want %+v", filters, len(got), len(want), got, want)
		}
		if len(filters) == 0 && len(got) != 120 {
			t.Errorf("list: %d records, want 120", len(got))
		}
	}

	// What a sync keeps: the same records in name order, without their times, each target
	// without its annotations.
	rs, err := imagelist.List(ctx, ours)
	if err != nil {
		t.Fatal(err)
	}
	records := slices.Collect(rs.Images())
	want, err := store.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	slices.SortFunc(want, byName)
	for i, img := range want {
		want[i] = containerdimages.Image{Name: img.Name, Labels: img.Labels,
			Target: ocispec.Descriptor{MediaType: img.Target.MediaType, Digest: img.Target.Digest, Size: img.Target.Size, Platform: img.Target.Platform}}
	}
	if !reflect.DeepEqual(records, want) {
		t.Errorf("the sync's records differ from containerd's client's list:\n got  %+v\n want %+v", records, want)
	}

	all, err := ours.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	maps, targets := map[string]uintptr{}, map[string]*byte{}
	for _, img := range all {
		key := fmt.Sprint(img.Target) // equal descriptors, annotations too
		if seen, ok := targets[key]; ok && seen != unsafe.StringData(string(img.Target.Digest)) {
			t.Errorf("%s: its target's digest is a string of its own, not shared", img.Name)
		}
		targets[key] = unsafe.StringData(string(img.Target.Digest))
		if img.Labels == nil {
			continue
		}
		key = fmt.Sprint(img.Labels) // fmt sorts map keys
		p := reflect.ValueOf(img.Labels).Pointer()
		if seen, ok := maps[key]; ok && seen != p {
			t.Errorf("%s: labels %v in a map of their own, not shared", img.Name, img.Labels)
		}
		maps[key] = p
	}
	if len(maps) >= 60 {
		t.Errorf("%d label maps for 120 records", len(maps))
	}
}
