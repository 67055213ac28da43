// Package imagelist reads containerd's image store as the agent keeps it between the steps of a
// sync: Records, one list sorted by name, each Record the name, the labels and the target of an
// image record. Store lists containerd's answer one record at a time, sharing equal labels and
// targets between records, where containerd's client decodes the whole answer at once, a labels
// map per record; on a large store that was most of a sync's memory. It imports nothing of
// k3s-pinning.
package imagelist

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"iter"
	"maps"
	"reflect"
	"slices"
	"strings"
	"time"

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

// Store is containerd's image store on a daemon whose List decodes containerd's answer one
// image at a time. containerd's Images.List has no pages: its answer holds every image record of
// the namespace (three per reference: each tag, its repo@digest and the CRI's
// sha256:<image ID>), and the client decodes all of it at once, every record with a labels map of
// its own, while gRPC still holds the message. Decoded one record at a time, the records that
// carry the same labels share one map, and those with the same target one descriptor: what a
// listed image's labels hold is shared, to be read and never written.
type Store struct {
	images.Store
	conn *grpc.ClientConn
}

// NewStore is store, listed through conn (the connection of the client store is of).
func NewStore(store images.Store, conn *grpc.ClientConn) Store {
	return Store{Store: store, conn: conn}
}

// List is images.Store's List: containerd's client's answer, record for record.
func (s Store) List(ctx context.Context, filters ...string) ([]images.Image, error) {
	reply := imageList{full: true}
	if err := s.list(ctx, &reply, filters); err != nil {
		return nil, err
	}
	var all []images.Image
	if len(reply.records) > 0 { // none is nil, as containerd's client answers
		all = make([]images.Image, len(reply.records))
	}
	for i, r := range reply.records {
		all[i] = r.Image()
		all[i].CreatedAt, all[i].UpdatedAt = reply.created[i], reply.updated[i]
	}
	return all, nil
}

// records is the store's list as the agent keeps it (Records).
func (s Store) records(ctx context.Context) (Records, error) {
	var reply imageList
	if err := s.list(ctx, &reply, nil); err != nil {
		return nil, err
	}
	return reply.records.Sorted(), nil
}

func (s Store) list(ctx context.Context, reply *imageList, filters []string) error {
	err := s.conn.Invoke(ctx, "/containerd.services.images.v1.Images/List", &imagesapi.ListImagesRequest{Filters: filters}, reply, grpc.ForceCodecV2(imageListCodec{}))
	return errgrpc.ToNative(err)
}

// List lists store as Records: a Store's decoded record by record, any other store's list made
// into records.
func List(ctx context.Context, store images.Store) (Records, error) {
	if s, ok := store.(Store); ok {
		return s.records(ctx)
	}
	all, err := store.List(ctx)
	if err != nil {
		return nil, err
	}
	return Of(all), nil
}

// Record is an image record as the agent keeps a list of the store: what it reads of one, a
// sixth of an images.Image (no target inline, no times), and the target without its annotations:
// containerd's import annotates each image's with its name, a map per image. A sync holds three
// records per reference from its start to its end.
type Record struct {
	Name   string
	Labels map[string]string // shared by the records with the same labels: read, never written
	// Target is the record's media type, digest, size and platform, shared by the records with
	// the same: what the agent reads a manifest by and compares. A reference the agent makes
	// from a listed one takes the target whole from the store (importer.Load).
	Target *ocispec.Descriptor
}

// Image is r as containerd's client gives a record, without its times (and, for a record of
// List, without its target's annotations).
func (r Record) Image() images.Image {
	return images.Image{Name: r.Name, Labels: r.Labels, Target: *r.Target}
}

// Records is a list of the store, sorted by name: a name is found by a binary search, not a
// map beside the list, which would cost as much again as the names.
type Records []Record

// Of is all as records (each target the one of all's image).
func Of(all []images.Image) Records {
	records := make(Records, len(all))
	for i := range all {
		records[i] = Record{Name: all[i].Name, Labels: all[i].Labels, Target: &all[i].Target}
	}
	return records.Sorted()
}

func byName(a, b Record) int { return strings.Compare(a.Name, b.Name) }

func named(r Record, name string) int { return strings.Compare(r.Name, name) }

// Sorted sorts rs by name (containerd lists in that order already: its bucket's keys) and
// returns it.
func (rs Records) Sorted() Records {
	if !slices.IsSortedFunc(rs, byName) {
		slices.SortFunc(rs, byName)
	}
	return rs
}

// Find is the record named name.
func (rs Records) Find(name string) (Record, bool) {
	i, ok := slices.BinarySearchFunc(rs, name, named)
	if !ok {
		return Record{}, false
	}
	return rs[i], true
}

// Insert adds r, which rs does not hold, in its place.
func (rs Records) Insert(r Record) Records {
	i, _ := slices.BinarySearchFunc(rs, r.Name, named)
	return slices.Insert(rs, i, r)
}

// Images are the records as containerd's client gives them, one at a time.
func (rs Records) Images() iter.Seq[images.Image] {
	return func(yield func(images.Image) bool) {
		for _, r := range rs {
			if !yield(r.Image()) {
				return
			}
		}
	}
}

// imageList is Images.List's answer as Store decodes it.
type imageList struct {
	records Records
	// full: the records' times (created, updated) and their targets whole are kept, for List.
	full             bool
	created, updated []time.Time
	labels           map[string]map[string]string // each distinct set of labels, by labelsKey
	// targets are the distinct targets by digest: the last decoded with that digest, which the
	// next with the same shares. No key but the digest: keyed by digest and annotations too, this
	// map was a tenth of a first sync's peak.
	targets map[digest.Digest]*ocispec.Descriptor
	// mediaTypes are the targets' media types, each string once.
	mediaTypes map[string]string
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
	if n > 0 {
		reply.records = make(Records, 0, n)
		if reply.full {
			reply.created, reply.updated = make([]time.Time, 0, n), make([]time.Time, 0, n)
		}
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
	l.labels, l.targets, l.mediaTypes = map[string]map[string]string{}, map[digest.Digest]*ocispec.Descriptor{}, map[string]string{}
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
		l.records = append(l.records, l.record(&pb))
		if l.full {
			l.created, l.updated = append(l.created, protobuf.FromTimestamp(pb.CreatedAt)), append(l.updated, protobuf.FromTimestamp(pb.UpdatedAt))
		}
		return nil
	})
}

// record is containerd's client's imageFromProto (its times kept aside, and its target's
// annotations only when full), its labels and target shared with the records decoded before it
// that have the same. containerd lists by name: the records of one image (name:tag, name@digest)
// mostly come one after the other, and the last record's labels are compared before a key is
// made for them.
func (l *imageList) record(pb *imagesapi.Image) Record {
	r := Record{Name: pb.Name}
	if len(pb.Labels) > 0 {
		if n := len(l.records); n > 0 && l.records[n-1].Labels != nil && maps.Equal(l.records[n-1].Labels, pb.Labels) {
			r.Labels = l.records[n-1].Labels
		} else if key := labelsKey(pb.Labels); l.labels[key] != nil {
			r.Labels = l.labels[key]
		} else {
			r.Labels, l.labels[key] = pb.Labels, pb.Labels
		}
	}
	target := oci.DescriptorFromProto(pb.Target)
	if !l.full {
		target = ocispec.Descriptor{MediaType: target.MediaType, Digest: target.Digest, Size: target.Size, Platform: target.Platform}
	}
	if t, ok := l.targets[target.Digest]; ok && sameDescriptor(*t, target) {
		r.Target = t
		return r
	}
	if mt, ok := l.mediaTypes[target.MediaType]; ok {
		target.MediaType = mt
	} else {
		l.mediaTypes[target.MediaType] = target.MediaType
	}
	r.Target = &target
	l.targets[target.Digest] = r.Target
	return r
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

// IsImageID says whether name is one of the sha256:<config digest> records the CRI creates beside
// each image: its ID, by which the kubelet lists an image once every name of it is gone.
func IsImageID(name string) bool { return strings.HasPrefix(name, "sha256:") }
