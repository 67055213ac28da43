package containerdtest

import (
	"bytes"
	"context"
	"fmt"
	"time"

	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/containerd/v2/core/leases"
	"github.com/containerd/errdefs"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sync/errgroup"
)

// Load is what a load left in one namespace of containerd: every blob, with its labels and
// bytes, and every image record. Written again onto a fresh containerd (Write), it is the floor
// of any load that leaves the same through containerd's API: each blob's ingest opened and
// committed with its labels, each record created with its labels, and nothing else; no archive
// read, nothing hashed on the client's side (containerd hashes what it is sent, as it must), no
// lookup of what is there. The bench sets an importer's time against it.
type Load struct {
	Blobs  []Blob
	Images []images.Image
}

// Blob is one blob of a Load.
type Blob struct {
	Desc   ocispec.Descriptor // digest and size
	Labels map[string]string
	Data   []byte
}

// Bytes is the size of every blob of l.
func (l *Load) Bytes() int64 {
	var n int64
	for _, b := range l.Blobs {
		n += b.Desc.Size
	}
	return n
}

// ReadLoad reads every blob (bytes and labels) and image record of ctx's namespace.
func ReadLoad(ctx context.Context, cs content.Store, is images.Store) (*Load, error) {
	var l Load
	if err := cs.Walk(ctx, func(info content.Info) error {
		l.Blobs = append(l.Blobs, Blob{Desc: ocispec.Descriptor{Digest: info.Digest, Size: info.Size}, Labels: info.Labels})
		return nil
	}); err != nil {
		return nil, err
	}
	for i := range l.Blobs {
		data, err := content.ReadBlob(ctx, cs, l.Blobs[i].Desc)
		if err != nil {
			return nil, fmt.Errorf("blob %s: %w", l.Blobs[i].Desc.Digest, err)
		}
		l.Blobs[i].Data = data
	}
	imgs, err := is.List(ctx)
	if err != nil {
		return nil, err
	}
	for _, img := range imgs {
		l.Images = append(l.Images, images.Image{Name: img.Name, Labels: img.Labels, Target: img.Target})
	}
	return &l, nil
}

// Write writes l into ctx's namespace, inFlight writes at a time, under one lease (as a load's,
// so that containerd's GC takes no blob before the records that hold it): every blob, then every
// record; then it removes the lease. It fails on a blob or record that is already there: the
// floor is of a cold load.
func (l *Load) Write(ctx context.Context, cs content.Store, is images.Store, lm leases.Manager, inFlight int) error {
	lease, err := lm.Create(ctx, leases.WithRandomID(), leases.WithExpiration(time.Hour))
	if err != nil {
		return err
	}
	defer lm.Delete(context.WithoutCancel(ctx), lease)
	ctx = leases.WithLease(ctx, lease.ID)
	var g errgroup.Group
	g.SetLimit(inFlight)
	for _, b := range l.Blobs {
		g.Go(func() error {
			err := content.WriteBlob(ctx, cs, "load-"+b.Desc.Digest.String(), bytes.NewReader(b.Data), b.Desc, content.WithLabels(b.Labels))
			if err != nil {
				return fmt.Errorf("blob %s: %w", b.Desc.Digest, err)
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return err
	}
	for _, img := range l.Images {
		g.Go(func() error {
			if _, err := is.Create(ctx, img); err != nil {
				if errdefs.IsAlreadyExists(err) {
					return fmt.Errorf("image %s: already there: the floor is of a cold load", img.Name)
				}
				return fmt.Errorf("image %s: %w", img.Name, err)
			}
			return nil
		})
	}
	return g.Wait()
}
