package images

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"maps"
	"reflect"
	"slices"
	"strings"

	imagesapi "github.com/containerd/containerd/api/services/images/v1"
	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/containerd/v2/pkg/oci"
	"github.com/containerd/containerd/v2/pkg/protobuf"
	"github.com/containerd/errdefs/pkg/errgrpc"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

// streamedImages is containerd's image store on a daemon (Services) whose List decodes
// containerd's answer one image at a time. containerd's Images.List has no pages: its answer holds
// every image record of the namespace (30,000 at 10,000 references: each tag, its repo@digest and
// the CRI's sha256:<image ID>), and the client decodes all of it at once, every record with a
// labels map of its own, while gRPC still holds the message: a heap profile of a sync at 10,000
// references had that answer as 67 of the 80 MiB in use at its peak. Decoded one record at a time,
// the records that carry the same labels share one map, and those with the same target one
// descriptor: what a listed image's labels hold is shared, to be read and never written.
type streamedImages struct {
	images.Store
	conn *grpc.ClientConn
}

// List is images.Store's List.
func (s streamedImages) List(ctx context.Context, filters ...string) ([]images.Image, error) {
	var reply imageList
	err := s.conn.Invoke(ctx, "/containerd.services.images.v1.Images/List", &imagesapi.ListImagesRequest{Filters: filters}, &reply, grpc.ForceCodecV2(imageListCodec{}))
	if err != nil {
		return nil, errgrpc.ToNative(err)
	}
	return reply.images, nil
}

// imageList is Images.List's answer as streamedImages decodes it.
type imageList struct {
	images []images.Image
	labels map[string]map[string]string // each distinct set of labels, by labelsKey
	// targets are, by digest, the index in images of the last image decoded with that digest:
	// the one whose target the next with the same shares. An index, not the descriptor, and no
	// key but the digest: keyed by digest and annotations, this map was 5.4 MB of a first sync's
	// 47 MB at its peak (10,000 targets, 30,000 records).
	targets map[digest.Digest]int
}

// imageListCodec is gRPC's proto codec for the request, and imageList's decoder for the answer.
type imageListCodec struct{}

func (imageListCodec) Name() string { return "proto" } // the content-subtype containerd serves

func (imageListCodec) Marshal(v any) (mem.BufferSlice, error) {
	m, ok := v.(proto.Message)
	if !ok {
		return nil, fmt.Errorf("image list: cannot marshal %T", v)
	}
	b, err := proto.Marshal(m)
	if err != nil {
		return nil, err
	}
	return mem.BufferSlice{mem.SliceBuffer(b)}, nil
}

func (imageListCodec) Unmarshal(data mem.BufferSlice, v any) error {
	reply, ok := v.(*imageList)
	if !ok {
		return fmt.Errorf("image list: cannot unmarshal into %T", v)
	}
	// Readers over gRPC's own buffers: the answer is not copied whole again. The first counts
	// the images, so that their slice is made once, not grown by doubling (at 30,000 records, 3
	// MiB copied and the old array live beside the new at the list's peak).
	count := data.Reader()
	n, err := countImages(count)
	count.Close()
	if err != nil {
		return fmt.Errorf("image list: %w", err)
	}
	r := data.Reader()
	defer r.Close()
	if n > 0 { // none is nil, as containerd's client answers
		reply.images = make([]images.Image, 0, n)
	}
	if err := reply.decode(r); err != nil {
		return fmt.Errorf("image list: %w", err)
	}
	return nil
}

// countImages is the number of images of a ListImagesResponse.
func countImages(r bufferReader) (int, error) {
	n := 0
	err := eachField(r, func(num protowire.Number, typ protowire.Type, size uint64) error {
		if num == 1 && typ == protowire.BytesType {
			n++
		}
		_, err := io.CopyN(io.Discard, r, int64(size))
		return err
	})
	return n, err
}

// eachField calls f with each top-level field of the message r holds (number, wire type, size
// of what follows: 0 for a varint, which eachField has read), f reading or skipping the value.
func eachField(r bufferReader, f func(num protowire.Number, typ protowire.Type, size uint64) error) error {
	for r.Remaining() > 0 {
		tag, err := binary.ReadUvarint(r)
		if err != nil {
			return err
		}
		num, typ := protowire.DecodeTag(tag)
		var n uint64
		switch typ {
		case protowire.VarintType:
			_, err = binary.ReadUvarint(r)
		case protowire.Fixed32Type:
			n = 4
		case protowire.Fixed64Type:
			n = 8
		case protowire.BytesType:
			n, err = binary.ReadUvarint(r)
		default:
			return fmt.Errorf("field %d: wire type %d", num, typ)
		}
		if err != nil {
			return err
		}
		if n > uint64(r.Remaining()) {
			return fmt.Errorf("field %d of %d bytes, %d left: %w", num, n, r.Remaining(), io.ErrUnexpectedEOF)
		}
		if err := f(num, typ, n); err != nil {
			return err
		}
	}
	return nil
}

// bufferReader is what decode reads: gRPC's mem.Reader (an interface in some gRPC releases, a
// struct in others).
type bufferReader interface {
	io.Reader
	io.ByteReader
	Remaining() int
}

// decode reads a ListImagesResponse (field 1: the repeated images), one image at a time.
func (l *imageList) decode(r bufferReader) error {
	l.labels, l.targets = map[string]map[string]string{}, map[digest.Digest]int{}
	var msg []byte
	return eachField(r, func(num protowire.Number, typ protowire.Type, n uint64) error {
		if num != 1 || typ != protowire.BytesType {
			_, err := io.CopyN(io.Discard, r, int64(n))
			return err
		}
		msg = slices.Grow(msg[:0], int(n))[:n]
		if _, err := io.ReadFull(r, msg); err != nil {
			return err
		}
		var pb imagesapi.Image // its strings are copies: msg is read into again
		if err := proto.Unmarshal(msg, &pb); err != nil {
			return err
		}
		l.images = append(l.images, l.image(&pb))
		return nil
	})
}

// image is containerd's client's imageFromProto, its labels and target shared with the images
// decoded before it that have the same. containerd lists by name: the records of one image
// (name:tag, name@digest) mostly come one after the other, and the last image's labels are
// compared before a key is made for them.
func (l *imageList) image(pb *imagesapi.Image) images.Image {
	img := images.Image{
		Name:      pb.Name,
		Target:    oci.DescriptorFromProto(pb.Target),
		CreatedAt: protobuf.FromTimestamp(pb.CreatedAt),
		UpdatedAt: protobuf.FromTimestamp(pb.UpdatedAt),
	}
	if len(pb.Labels) > 0 {
		if n := len(l.images); n > 0 && l.images[n-1].Labels != nil && maps.Equal(l.images[n-1].Labels, pb.Labels) {
			img.Labels = l.images[n-1].Labels
		} else if key := labelsKey(pb.Labels); l.labels[key] != nil {
			img.Labels = l.labels[key]
		} else {
			img.Labels, l.labels[key] = pb.Labels, pb.Labels
		}
	}
	if i, ok := l.targets[img.Target.Digest]; ok && sameDescriptor(l.images[i].Target, img.Target) {
		img.Target = l.images[i].Target
	} else {
		l.targets[img.Target.Digest] = len(l.images) // where img is appended
	}
	return img
}

// sameDescriptor says whether a and b are equal, field by field.
func sameDescriptor(a, b ocispec.Descriptor) bool {
	return a.MediaType == b.MediaType && a.Digest == b.Digest && a.Size == b.Size && a.ArtifactType == b.ArtifactType &&
		slices.Equal(a.URLs, b.URLs) && maps.Equal(a.Annotations, b.Annotations) && bytes.Equal(a.Data, b.Data) &&
		reflect.DeepEqual(a.Platform, b.Platform)
}

// labelsKey is one string for a set of labels: equal sets, equal keys.
func labelsKey(labels map[string]string) string {
	var b strings.Builder
	for _, k := range slices.Sorted(maps.Keys(labels)) {
		b.WriteString(k)
		b.WriteByte(0)
		b.WriteString(labels[k])
		b.WriteByte(0)
	}
	return b.String()
}
