package images

import (
	"context"
	"errors"
	"fmt"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/sirupsen/logrus"

	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// Config is what the agent protects: the images dir, the policy beyond it, and k3s's retag
// registries.
type Config struct {
	ImagesDir       string
	Policy          *pinning.Policy
	ExtraRegistries []string
}

// Agent keeps the images of the images dir, and those the policy names, present and pinned.
type Agent struct {
	client   *containerd.Client
	cfg      Config
	importer *Importer
	pinner   *pinning.Pinner
}

// NewAgent returns an Agent on client. The containerd namespace comes from each call's context.
func NewAgent(client *containerd.Client, cfg Config) *Agent {
	return &Agent{
		client:   client,
		cfg:      cfg,
		importer: NewImporter(client, cfg.ExtraRegistries),
		pinner:   pinning.NewPinner(client.ImageService()),
	}
}

// ArchiveReport is what Sync did with one archive.
type ArchiveReport struct {
	Archive  Archive
	Format   Format
	Imported bool // content was imported (tarball) or pulled (list)
	Refs     []RefResult
	Err      error
}

// SyncReport is what Sync did.
type SyncReport struct {
	Archives     []ArchiveReport
	ScanErrors   []error  // files of the images dir that are not archives k3s loads
	PolicyPinned []string // hand-imported references pinned because the policy wants them
	PolicyErr    error
}

// Err joins every error of the report; nil means every archive was processed in full.
func (r *SyncReport) Err() error {
	errs := append([]error{}, r.ScanErrors...)
	for _, a := range r.Archives {
		errs = append(errs, a.Err)
		for _, ref := range a.Refs {
			if ref.Err != nil && !errors.Is(a.Err, ref.Err) {
				errs = append(errs, ref.Err)
			}
		}
	}
	return errors.Join(append(errs, r.PolicyErr)...)
}

// Sync imports what the images dir holds and containerd lacks, pins every reference the images
// dir provides, then pins what the policy wants. One bad archive never stops the others, and no
// pin is ever removed.
func (a *Agent) Sync(ctx context.Context) *SyncReport {
	report := &SyncReport{}
	archives, scanErrs := Scan(a.cfg.ImagesDir)
	report.ScanErrors = scanErrs
	for _, err := range scanErrs {
		logrus.Errorf("images dir: %v", err)
	}
	for _, ar := range archives {
		report.Archives = append(report.Archives, a.syncArchive(ctx, ar))
	}
	report.PolicyPinned, report.PolicyErr = a.pinner.PinPolicy(ctx, a.cfg.Policy)
	for _, ref := range report.PolicyPinned {
		logrus.Infof("pinned %s: --pinned-images/--pinned-image-labels want it", ref)
	}
	if report.PolicyErr != nil {
		logrus.Errorf("policy: %v", report.PolicyErr)
	}
	return report
}

func (a *Agent) syncArchive(ctx context.Context, ar Archive) ArchiveReport {
	rep := ArchiveReport{Archive: ar}
	idx, err := ReadIndex(ar)
	if idx == nil {
		rep.Err = err
		logrus.Errorf("%v", err)
		return rep
	}
	rep.Format = idx.Format
	refs, imported, loadErr := a.importer.Load(ctx, idx)
	rep.Refs, rep.Imported, rep.Err = refs, imported, errors.Join(err, loadErr)
	for _, r := range refs {
		switch {
		case r.Err != nil:
			logrus.Errorf("%s: %v", ar.Name(), r.Err)
		case r.Result == pinning.Pinned:
			logrus.Infof("pinned %s (%s) from %s", r.Ref, r.Digest, ar.Name())
		case r.Result == pinning.PinnedByOther:
			logrus.Infof("%s from %s was already pinned by another owner; left theirs", r.Ref, ar.Name())
		}
	}
	if rep.Err != nil {
		logrus.Errorf("%s: %v", ar.Name(), rep.Err)
	}
	return rep
}

// PinManual pins ref by hand (`k3s-pinning pin`), recorded as SourceManual.
func (a *Agent) PinManual(ctx context.Context, ref string) (pinning.PinResult, error) {
	name, err := a.existingName(ctx, ref)
	if err != nil {
		return 0, err
	}
	return a.pinner.Pin(ctx, name, pinning.SourceManual)
}

// UnpinManual removes our pin from ref (`k3s-pinning unpin`). It never removes a pin we did not
// set. wantedBy names what still wants ref kept, so the caller can say that sync will pin it again.
func (a *Agent) UnpinManual(ctx context.Context, ref string) (wantedBy string, err error) {
	name, err := a.existingName(ctx, ref)
	if err != nil {
		return "", err
	}
	img, err := a.client.ImageService().Get(ctx, name)
	if err != nil {
		return "", err
	}
	if err := a.pinner.Unpin(ctx, name); err != nil {
		return "", err
	}
	snap, err := a.Inspect(ctx)
	if err != nil {
		return "", nil
	}
	if src, ok := snap.wanted.source(img); ok && src != pinning.SourceManual {
		return src, nil
	}
	return "", nil
}

// existingName resolves ref as given or in its normalized form (nginx:1 is docker.io/library/nginx:1).
func (a *Agent) existingName(ctx context.Context, ref string) (string, error) {
	store := a.client.ImageService()
	if _, err := store.Get(ctx, ref); err == nil {
		return ref, nil
	}
	if n := normalize(ref); n != ref {
		if _, err := store.Get(ctx, n); err == nil {
			return n, nil
		}
	}
	return "", fmt.Errorf("image %s: not found in containerd", ref)
}
