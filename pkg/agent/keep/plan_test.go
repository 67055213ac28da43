package keep

import (
	"fmt"
	"strings"
	"testing"
	"unsafe"

	"github.com/containerd/containerd/v2/core/images"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/k3s-pinning/k3s-pinning/pkg/agent/imagelist"
	"github.com/k3s-pinning/k3s-pinning/pkg/agent/statefile"
	"github.com/k3s-pinning/k3s-pinning/pkg/airgap"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

func testDigest(s string) digest.Digest { return digest.FromString(s) }

func index(name string, format airgap.Format, imgs ...airgap.IndexedImage) *airgap.Index {
	return &airgap.Index{Archive: airgap.Archive{Path: "/images/" + name}, Format: format, Images: imgs}
}

func recorded(format airgap.Format, refs map[string]digest.Digest, imgs ...airgap.IndexedImage) *statefile.Archive {
	return &statefile.Archive{Format: format, Refs: refs, Images: imgs}
}

func image(name string, labels map[string]string) images.Image {
	return images.Image{Name: name, Labels: labels, Target: ocispec.Descriptor{Digest: testDigest(name)}}
}

// TestPlan is the keep-decision's rules, one row each, with no daemon: what wants each image
// (its source), or that nothing does.
func TestPlan(t *testing.T) {
	appA := airgap.IndexedImage{Ref: "docker.io/library/app:1", ImageID: testDigest("config-a")}
	appB := airgap.IndexedImage{Ref: "docker.io/library/app:1", ImageID: testDigest("config-b")}
	oci := airgap.IndexedImage{Ref: "acc.example/oci:1", Digest: testDigest("oci-manifest"), ImageID: testDigest("oci-config")}
	manifestA := testDigest("manifest-a")
	type ask struct {
		img    images.Image
		source string // "" = not wanted
	}
	for _, c := range []struct {
		name      string
		in        Input
		patterns  []string
		selectors []string
		asks      []ask
	}{
		{name: "an archive provides its tags, and the digest reference its index knows",
			in: Input{Present: []string{"oci.tar"}, Read: map[string]*airgap.Index{"oci.tar": index("oci.tar", airgap.OCIArchive, oci)}},
			asks: []ask{
				{image("acc.example/oci:1", nil), "oci.tar"},
				{image("acc.example/oci@"+oci.Digest.String(), nil), "oci.tar"},
				{image("acc.example/other:1", nil), ""},
			}},
		{name: "a docker archive's digest reference, known from its recorded load",
			in: Input{Present: []string{"a.tar"}, Read: map[string]*airgap.Index{"a.tar": index("a.tar", airgap.DockerArchive, appA)},
				Recorded: map[string]*statefile.Archive{"a.tar": recorded(airgap.DockerArchive, map[string]digest.Digest{appA.Ref: manifestA, "docker.io/library/app@" + manifestA.String(): manifestA}, appA)}},
			asks: []ask{{image("docker.io/library/app@"+manifestA.String(), nil), "a.tar"}}},
		{name: "two archives provide a reference: the first by name is its source, whatever was loaded before",
			in: Input{Present: []string{"b.tar", "a.tar"},
				Read: map[string]*airgap.Index{"a.tar": index("a.tar", airgap.DockerArchive, appA), "b.tar": index("b.tar", airgap.DockerArchive, appB)},
				// b.tar loaded app:1 before a.tar arrived
				Recorded: map[string]*statefile.Archive{"b.tar": recorded(airgap.DockerArchive, map[string]digest.Digest{appB.Ref: testDigest("manifest-b")}, appB)}},
			asks: []ask{{image(appA.Ref, nil), "a.tar"}}},
		{name: "an archive that cannot be read now keeps what it recorded",
			in: Input{Present: []string{"damaged.tar"},
				Recorded: map[string]*statefile.Archive{"damaged.tar": recorded(airgap.DockerArchive, map[string]digest.Digest{appA.Ref: manifestA}, appA)}},
			asks: []ask{{image(appA.Ref, nil), "damaged.tar"}}},
		{name: "an archive that left wants nothing, even with its record and our pin",
			in:   Input{Recorded: map[string]*statefile.Archive{"gone.tar": recorded(airgap.DockerArchive, map[string]digest.Digest{appA.Ref: manifestA}, appA)}},
			asks: []ask{{image(appA.Ref, pinning.PinLabels("gone.tar")), ""}}},
		{name: "our pin: a reference of an archive still present whose load is not recorded yet, or a manual pin, stays wanted",
			in: Input{Present: []string{"a.tar"}, Read: map[string]*airgap.Index{"a.tar": index("a.tar", airgap.DockerArchive, appA)}},
			asks: []ask{
				{image("acc.example/retag:1", pinning.PinLabels("a.tar")), "a.tar"},
				{image("acc.example/hand:1", pinning.PinLabels(pinning.SourceManual)), pinning.SourceManual},
				{image("acc.example/old:1", pinning.PinLabels(pinning.SourcePolicy)), ""},
			}},
		{name: "an archive whose load is recorded wants what it provides, not what it pinned before (issue 23)",
			in: Input{Present: []string{"a.tar"}, Read: map[string]*airgap.Index{"a.tar": index("a.tar", airgap.DockerArchive, appA)},
				Recorded: map[string]*statefile.Archive{"a.tar": recorded(airgap.DockerArchive, map[string]digest.Digest{appA.Ref: manifestA, "docker.io/library/app@" + manifestA.String(): manifestA}, appA)}},
			asks: []ask{
				{image("docker.io/library/app@"+manifestA.String(), pinning.PinLabels("a.tar")), "a.tar"},
				{image("docker.io/library/app@"+testDigest("previous-manifest").String(), pinning.PinLabels("a.tar")), ""},
			}},
		{name: "someone else's pin is not a reason of ours",
			asks: []ask{{image("acc.example/theirs:1", map[string]string{pinning.LabelPinned: pinning.PinnedValue}), ""}}},
		{name: "the policy: patterns and label selectors",
			patterns: []string{"registry.local/*", "nginx"}, selectors: []string{"team=infra"},
			asks: []ask{
				{image("registry.local/tool:2", nil), pinning.SourcePolicy},
				{image("docker.io/library/nginx:1.27", nil), pinning.SourcePolicy},
				{image("acc.example/x:1", map[string]string{"team": "infra"}), pinning.SourcePolicy},
				{image("acc.example/x:1", map[string]string{"team": "web"}), ""},
			}},
		{name: "an archive wins over the policy",
			in:       Input{Present: []string{"a.tar"}, Read: map[string]*airgap.Index{"a.tar": index("a.tar", airgap.DockerArchive, appA)}},
			patterns: []string{"app"},
			asks:     []ask{{image(appA.Ref, nil), "a.tar"}}},
		{name: "--airgap-extra-registry names are provided too",
			in: Input{Present: []string{"oci.tar"}, Read: map[string]*airgap.Index{"oci.tar": index("oci.tar", airgap.OCIArchive, oci)}, ExtraRegistries: []string{"mirror.local:5000"}},
			asks: []ask{
				{image("mirror.local:5000/oci:1", nil), "oci.tar"},
				{image("mirror.local:5000/oci@"+oci.Digest.String(), nil), "oci.tar"},
			}},
	} {
		t.Run(c.name, func(t *testing.T) {
			policy, err := pinning.NewPolicy(c.patterns, c.selectors)
			if err != nil {
				t.Fatal(err)
			}
			c.in.Policy = policy
			plan := New(c.in)
			for _, a := range c.asks {
				source, wanted := plan.Source(a.img)
				if source != a.source || wanted != (a.source != "") {
					t.Errorf("Source(%s %v) = %q, %t; want %q", a.img.Name, a.img.Labels, source, wanted, a.source)
				}
			}
		})
	}
}

// TestPlanOwnershipAgreesWithSource: the archive that loads a contested reference is the one the
// plan names as its source, the other's claim (and the digest reference it would have made) is
// wanted by nothing, and it is reported as a conflict.
func TestPlanOwnershipAgreesWithSource(t *testing.T) {
	appA := airgap.IndexedImage{Ref: "docker.io/library/app:1", ImageID: testDigest("config-a")}
	appB := airgap.IndexedImage{Ref: "docker.io/library/app:1", Digest: testDigest("manifest-b"), ImageID: testDigest("config-b")}
	plan := New(Input{Present: []string{"a.tar", "b.tar"},
		Read: map[string]*airgap.Index{"a.tar": index("a.tar", airgap.DockerArchive, appA), "b.tar": index("b.tar", airgap.OCIArchive, appB)}})
	if src, _ := plan.Source(image(appA.Ref, nil)); src != "a.tar" {
		t.Errorf("source %q, want a.tar", src)
	}
	if src, wanted := plan.Source(image("docker.io/library/app@"+appB.Digest.String(), nil)); wanted {
		t.Errorf("b.tar's overruled digest reference wanted by %q", src)
	}
	if got := plan.owners.loadable(index("b.tar", airgap.OCIArchive, appB)); len(got.Images) != 0 {
		t.Errorf("b.tar may load %v, want nothing (a.tar provides app:1)", got.Images)
	}
	if cs := plan.Conflicts(); len(cs) != 1 || cs[0].Owner != "a.tar" || cs[0].Shadowed != "b.tar" {
		t.Errorf("conflicts %v, want app:1 owned by a.tar over b.tar", cs)
	}
}

// TestPlanHeir: a pin a source gives up passes to what else wants the image.
func TestPlanHeir(t *testing.T) {
	app := airgap.IndexedImage{Ref: "docker.io/library/app:1", ImageID: testDigest("config")}
	policy, _ := pinning.NewPolicy([]string{"registry.local/*"}, nil)
	plan := New(Input{Present: []string{"b.tar"}, Read: map[string]*airgap.Index{"b.tar": index("b.tar", airgap.DockerArchive, app)}, Policy: policy})
	for _, c := range []struct {
		img        images.Image
		from, heir string
	}{
		{image(app.Ref, pinning.PinLabels("a.tar")), "a.tar", "b.tar"},
		{image("registry.local/tool:1", pinning.PinLabels("a.tar")), "a.tar", pinning.SourcePolicy},
		{image("acc.example/only-a:1", pinning.PinLabels("a.tar")), "a.tar", ""},
		{image("acc.example/hand:1", pinning.PinLabels(pinning.SourceManual)), pinning.SourceManual, ""},
	} {
		if got := plan.Heir(c.img, c.from); got != c.heir {
			t.Errorf("Heir(%s, %s) = %q, want %q", c.img.Name, c.from, got, c.heir)
		}
	}
}

// TestKeeperIsThePlan: the kubelet's filter keeps what the plan wants, by every name the CRI
// lists an image under (tag, repo@digest, the sha256 image ID record), and nothing else: not a
// name an archive whose load is recorded pinned once and no longer provides (issue 23's stale
// digest reference), nor its image ID record; a zero Keeper keeps nothing rather than panicking.
func TestKeeperIsThePlan(t *testing.T) {
	if (&Keeper{}).Keep("sha256:x", []string{"a:1"}, nil) {
		t.Error("a zero Keeper keeps an image")
	}
	app := airgap.IndexedImage{Ref: "docker.io/library/app:1", ImageID: testDigest("config")}
	manifest := testDigest("manifest")
	policy, _ := pinning.NewPolicy([]string{"registry.local/*"}, nil)
	plan := New(Input{Present: []string{"a.tar"}, Read: map[string]*airgap.Index{"a.tar": index("a.tar", airgap.DockerArchive, app)},
		Recorded: map[string]*statefile.Archive{"a.tar": recorded(airgap.DockerArchive, map[string]digest.Digest{app.Ref: manifest}, app)}, Policy: policy})
	appImg := image(app.Ref, pinning.PinLabels("a.tar"))
	stale := image("acc.example/stale:1", pinning.PinLabels("a.tar"))
	idRecord := images.Image{Name: "sha256:" + testDigest("config").Encoded(), Target: appImg.Target}
	staleID := images.Image{Name: "sha256:" + testDigest("stale-config").Encoded(), Target: stale.Target}
	k := &Keeper{}
	k.Publish(plan, imagelist.Of([]images.Image{appImg, stale, idRecord, staleID, image("acc.example/other:1", nil)}))
	for _, c := range []struct {
		id          string
		tags, dgsts []string
		keep        bool
	}{
		{"sha256:1", []string{app.Ref}, nil, true},
		{"sha256:2", nil, []string{"docker.io/library/app@" + manifest.String()}, true},
		{"sha256:3", []string{"acc.example/stale:1"}, nil, false},
		{idRecord.Name, nil, nil, true},
		{staleID.Name, nil, nil, false},
		{"sha256:4", []string{"registry.local/tool:9"}, nil, true},
		{"sha256:5", []string{"acc.example/other:1"}, nil, false},
	} {
		if got := k.Keep(c.id, c.tags, c.dgsts); got != c.keep {
			t.Errorf("Keep(%s, %v, %v) = %t, want %t", c.id, c.tags, c.dgsts, got, c.keep)
		}
	}
}

// TestKeepSetHoldsThePlansNames: a name the plan wants and containerd lists is held once, as the
// plan has it, not as the list decoded it (a copy, garbage once the sync ends), whichever the
// keep-set met first; a listed name the plan does not know (the policy's) is the list's.
func TestKeepSetHoldsThePlansNames(t *testing.T) {
	app := airgap.IndexedImage{Ref: "docker.io/library/app:1", ImageID: testDigest("config")}
	manifest := testDigest("manifest")
	policy, _ := pinning.NewPolicy([]string{"registry.local/*"}, nil)
	plan := New(Input{Present: []string{"a.tar"}, Read: map[string]*airgap.Index{"a.tar": index("a.tar", airgap.DockerArchive, app)},
		Recorded: map[string]*statefile.Archive{"a.tar": recorded(airgap.DockerArchive, map[string]digest.Digest{app.Ref: manifest}, app)}, Policy: policy})
	target := ocispec.Descriptor{Digest: manifest}
	digestName := "docker.io/library/app@" + manifest.String()
	listed := []images.Image{ // as decoded from containerd's answer: strings of their own
		{Name: strings.Clone(app.Ref), Labels: pinning.PinLabels("a.tar"), Target: target},
		{Name: strings.Clone(digestName), Labels: pinning.PinLabels("a.tar"), Target: target},
		{Name: "registry.local/tool:9", Target: ocispec.Descriptor{Digest: testDigest("tool")}},
	}
	k := &Keeper{}
	k.Publish(plan, imagelist.Of(listed))
	held := map[string]*byte{}
	for name := range k.set.Load().names {
		held[name] = unsafe.StringData(name)
	}
	var planRef string
	for ref := range plan.refs {
		planRef = ref
	}
	for _, c := range []struct {
		name string
		want *byte
	}{
		{app.Ref, unsafe.StringData(planRef)},
		{digestName, unsafe.StringData(plan.digestRefs.Of(planRef, plan.digests[planRef]))},
		{"registry.local/tool:9", unsafe.StringData(listed[2].Name)},
	} {
		got, ok := held[c.name]
		switch {
		case !ok:
			t.Errorf("%s is not in the keep-set", c.name)
		case got != c.want:
			t.Errorf("%s is held as another copy than the one it should share", c.name)
		}
	}
	if len(held) != 4 { // and the policy's image by digest
		t.Errorf("keep-set holds %d names, want 4: %v", len(held), held)
	}
}

// BenchmarkKeep is one kubelet GC pass's worth of questions: 5,000 images, 1,000 of them wanted,
// with the CRI's three names each, and a --pinned-images glob to try on the others.
func BenchmarkKeep(b *testing.B) {
	policy, err := pinning.NewPolicy([]string{"registry.local/pinned/*"}, nil)
	if err != nil {
		b.Fatal(err)
	}
	type criImage struct {
		id          string
		tags, dgsts []string
	}
	var listed []criImage
	var wanted []airgap.IndexedImage
	for i := range 5000 {
		img := criImage{
			id:    fmt.Sprintf("sha256:%064x", i),
			tags:  []string{fmt.Sprintf("registry.local/app%d:1.0", i)},
			dgsts: []string{fmt.Sprintf("registry.local/app%d@sha256:%064x", i, i+1<<20)},
		}
		if i%5 == 0 {
			wanted = append(wanted, airgap.IndexedImage{Ref: img.tags[0]})
		}
		listed = append(listed, img)
	}
	k := &Keeper{}
	k.Publish(New(Input{Present: []string{"a.tar"}, Read: map[string]*airgap.Index{"a.tar": index("a.tar", airgap.DockerArchive, wanted...)}, Policy: policy}), nil)
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

// TestPlanFetchable: what can be fetched, by which digest, and what a retained archive provides.
// A retained archive's references are wanted (its name the source) and fetchable, but nothing
// restores from it; an archive back in the dir, or another providing the reference, comes first;
// the policy's and the workloads' references by digest are fetchable unless an archive present
// provides them; a tag is never fetchable by itself.
func TestPlanFetchable(t *testing.T) {
	kept, other := testDigest("kept-manifest"), testDigest("other-manifest")
	byDigest := "registry.local/team/app@" + testDigest("app").String()
	workload := "registry.local/team/job@" + testDigest("job").String()
	policy, err := pinning.NewPolicy([]string{byDigest, "registry.local/team/tagged:1"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	in := Input{
		Present:  []string{"present.tar"},
		Read:     map[string]*airgap.Index{"present.tar": index("present.tar", airgap.DockerArchive, airgap.IndexedImage{Ref: "registry.local/team/shared:1", Digest: other})},
		Recorded: map[string]*statefile.Archive{},
		Retained: map[string]*statefile.Archive{
			"kept.tar": recorded(airgap.OCIArchive, map[string]digest.Digest{"registry.local/team/kept:1": kept, "registry.local/team/kept@" + kept.String(): kept, "registry.local/team/shared:1": kept}),
		},
		Policy:    policy,
		Workloads: map[string]bool{workload: true, "registry.local/team/web:2": true},
	}
	p := New(in)
	for ref, want := range map[string]digest.Digest{
		"registry.local/team/kept:1":                kept,
		"registry.local/team/kept@" + kept.String(): kept,
		byDigest: testDigest("app"),
		workload: testDigest("job"),
	} {
		if d, ok := p.Fetchable(ref); !ok || d != want {
			t.Errorf("Fetchable(%s) = %s, %t; want %s", ref, d, ok, want)
		}
	}
	for _, ref := range []string{"registry.local/team/shared:1", "registry.local/team/tagged:1", "registry.local/team/web:2"} {
		if d, ok := p.Fetchable(ref); ok {
			t.Errorf("Fetchable(%s) = %s: an archive present provides it, or it is a tag", ref, d)
		}
	}
	if src, ok := p.Source(image("registry.local/team/kept:1", nil)); !ok || src != "kept.tar" || !p.Retained(src) {
		t.Errorf("Source(kept:1) = %q, %t (retained %t); want kept.tar, retained", src, ok, p.Retained(src))
	}
	if src, _ := p.Source(image("registry.local/team/shared:1", nil)); src != "present.tar" {
		t.Errorf("Source(shared:1) = %q: the archive present comes before the retained one", src)
	}
	if a := p.Archive("registry.local/team/kept:1"); a != "" {
		t.Errorf("Archive(kept:1) = %q: a retained archive is gone, nothing restores from it", a)
	}
	in.Present = append(in.Present, "kept.tar")
	in.Read["kept.tar"] = index("kept.tar", airgap.OCIArchive, airgap.IndexedImage{Ref: "registry.local/team/kept:1", Digest: kept})
	if p := New(in); p.Retained("kept.tar") || p.Archive("registry.local/team/kept:1") != "kept.tar" {
		t.Errorf("kept.tar back in the dir: retained %t, Archive %q", p.Retained("kept.tar"), p.Archive("registry.local/team/kept:1"))
	}
}
