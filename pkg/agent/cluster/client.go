package cluster

import (
	"context"
	"fmt"

	appsv1 "k8s.io/api/apps/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/apimachinery/pkg/types"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	"k8s.io/client-go/rest"
)

// scheme holds the four API groups the cluster view reads and writes, and nothing else. Not
// client-go's clientset: its typed clients, listers and informers register every API group of
// Kubernetes at start: with them the binary is half as large again, and an idle `k3s-pinning run`
// holds the pages they touch (internal/depcheck keeps them out).
var scheme = func() *runtime.Scheme {
	s := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{corev1.AddToScheme, appsv1.AddToScheme, batchv1.AddToScheme, authorizationv1.AddToScheme} {
		utilruntime.Must(add(s))
	}
	return s
}()

// codecs encode and decode the scheme's objects, without conversion (as client-go's clientset).
var codecs = serializer.NewCodecFactory(scheme).WithoutConversion()

// Client is the cluster view's access to the API server: one REST client per API group version
// it uses (core/v1: Nodes, Events, Pods; apps/v1 and batch/v1: the workloads; authorization/v1:
// the access review).
type Client struct {
	core, apps, batch, authorization rest.Interface
}

// NewClient is a Client with cfg's server and credentials.
func NewClient(cfg *rest.Config) (*Client, error) {
	c := &Client{}
	for _, g := range []struct {
		client *rest.Interface
		gv     schema.GroupVersion
	}{
		{&c.core, corev1.SchemeGroupVersion}, {&c.apps, appsv1.SchemeGroupVersion},
		{&c.batch, batchv1.SchemeGroupVersion}, {&c.authorization, authorizationv1.SchemeGroupVersion},
	} {
		gcfg := rest.CopyConfig(cfg)
		gv := g.gv
		gcfg.GroupVersion = &gv
		gcfg.APIPath = "/apis"
		if gv.Group == "" {
			gcfg.APIPath = "/api"
		}
		gcfg.NegotiatedSerializer = codecs
		if gcfg.UserAgent == "" {
			gcfg.UserAgent = rest.DefaultKubernetesUserAgent()
		}
		rc, err := rest.RESTClientFor(gcfg)
		if err != nil {
			return nil, fmt.Errorf("%s client: %w", gv, err)
		}
		*g.client = rc
	}
	return c, nil
}

// forGroup is the REST client of the API group group.
func (c *Client) forGroup(group string) rest.Interface {
	switch group {
	case appsv1.GroupName:
		return c.apps
	case batchv1.GroupName:
		return c.batch
	case authorizationv1.GroupName:
		return c.authorization
	}
	return c.core
}

func (c *Client) getNode(ctx context.Context, name string) (*corev1.Node, error) {
	node := &corev1.Node{}
	return node, c.core.Get().Resource("nodes").Name(name).Do(ctx).Into(node)
}

// patchNodeStatus applies a strategic merge patch to the status of the Node name.
func (c *Client) patchNodeStatus(ctx context.Context, name string, patch []byte) error {
	return c.core.Patch(types.StrategicMergePatchType).Resource("nodes").Name(name).SubResource("status").Body(patch).Do(ctx).Error()
}

func (c *Client) listNodes(ctx context.Context) (*corev1.NodeList, error) {
	nodes := &corev1.NodeList{}
	return nodes, c.core.Get().Resource("nodes").Do(ctx).Into(nodes)
}

func (c *Client) reviewAccess(ctx context.Context, review *authorizationv1.SelfSubjectAccessReview) (*authorizationv1.SelfSubjectAccessReview, error) {
	got := &authorizationv1.SelfSubjectAccessReview{}
	return got, c.authorization.Post().Resource("selfsubjectaccessreviews").Body(review).Do(ctx).Into(got)
}

// eventSink is the event recorder's sink (record.EventSink): Events of the event's own
// namespace, as client-go's EventSinkImpl writes them.
type eventSink struct{ core rest.Interface }

func (s eventSink) Create(e *corev1.Event) (*corev1.Event, error) {
	out := &corev1.Event{}
	return out, s.core.Post().Namespace(e.Namespace).Resource("events").Body(e).Do(context.TODO()).Into(out)
}

func (s eventSink) Update(e *corev1.Event) (*corev1.Event, error) {
	out := &corev1.Event{}
	return out, s.core.Put().Namespace(e.Namespace).Resource("events").Name(e.Name).Body(e).Do(context.TODO()).Into(out)
}

func (s eventSink) Patch(e *corev1.Event, data []byte) (*corev1.Event, error) {
	out := &corev1.Event{}
	return out, s.core.Patch(types.StrategicMergePatchType).Namespace(e.Namespace).Resource("events").Name(e.Name).Body(data).Do(context.TODO()).Into(out)
}
