// Package cluster shows an agent's protection through the Kubernetes API, for an operator of
// many air-gapped nodes who cannot open a shell on each: Events on the Node object, in the
// kubelet's style, and a condition on it that says whether every wanted image is present and
// pinned; NodeStatuses reads those conditions back for `k3s-pinning status --cluster`.
package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/sirupsen/logrus"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/record"

	"github.com/k3s-pinning/k3s-pinning/pkg/agent/images"
)

// ConditionType is the node condition the agent keeps current. A condition, not an annotation:
// it is what `kubectl describe node` shows beside the kubelet's own (DiskPressure) and what
// node-problem-detector uses for the same kind of report; the kubelet's status updates merge
// conditions by type and leave it alone.
const ConditionType corev1.NodeConditionType = "AirgapImagesProtected"

// The condition's reasons.
const (
	ReasonProtected      = "AllImagesPresentAndPinned"
	ReasonImagesMissing  = "ImagesMissing"
	ReasonImagesLost     = "ImagesLost"
	ReasonArchivesFailed = "ArchivesFailedToLoad"
	// ReasonStalled (status Unknown): no reconcile of the agent has ended for a while; what it
	// last reported may no longer be the node's.
	ReasonStalled = "ReconcileStalled"
)

// Component is the source of the agent's Events.
const Component = "k3s-pinning"

const (
	// heartbeat re-asserts the condition, so that a node whose agent stopped shows a stale one.
	heartbeat = 5 * time.Minute
	// Stale is how old a heartbeat may be before status --cluster stops trusting the condition.
	Stale              = 3 * heartbeat
	retryMin, retryMax = time.Second, 30 * time.Second
)

// DefaultKubeconfig is the kubeconfig k3s writes on a server.
const DefaultKubeconfig = "/etc/rancher/k3s/k3s.yaml"

// Config is a client configuration from a kubeconfig file; with path "", the pod's service
// account when running in a pod (the DaemonSet).
func Config(path string) (*rest.Config, error) {
	if path == "" {
		cfg, err := rest.InClusterConfig()
		if err != nil {
			return nil, fmt.Errorf("no kubeconfig given and not in a pod: %w", err)
		}
		return cfg, nil
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", path)
	if err != nil {
		return nil, fmt.Errorf("kubeconfig %s: %w", path, err)
	}
	cfg.UserAgent = Component
	return cfg, nil
}

// ForKubeconfig is a Node for node with the credentials of a kubeconfig file (path "":
// the pod's service account). A patched k3s passes its agent's kubelet kubeconfig: a node may
// create Events and patch its own Node's status (the Node authorizer), and nothing more is asked.
func ForKubeconfig(path, node string) (*Node, error) {
	if node == "" {
		return nil, fmt.Errorf("no node name")
	}
	cfg, err := Config(path)
	if err != nil {
		return nil, err
	}
	client, err := NewClient(cfg)
	if err != nil {
		return nil, fmt.Errorf("kubeconfig %s: %w", path, err)
	}
	return NewNode(client, node), nil
}

// NodeName is the node's name as k3s picks it when --node-name is not given: the host name, in
// lower case.
func NodeName() (string, error) {
	h, err := os.Hostname()
	return strings.ToLower(h), err
}

// Node is an images.Reporter that reports on one Node: its Events through client-go's
// event recorder (deduplicated, and rate-limited per reason so that a flapping disk cannot flood
// the API server), and its protection as the node condition ConditionType, kept current by Run.
type Node struct {
	client   *Client
	node     string
	recorder record.EventRecorder
	stop     func()

	mu      sync.Mutex
	latest  *images.Protection
	changed chan struct{}
	// stall, when set (WatchReconciles), says how to see the agent stuck.
	stall *stallWatch
}

// stallWatch makes the condition Unknown once no reconcile has ended (reconciled) for after,
// counted from started at the earliest.
type stallWatch struct {
	reconciled func() time.Time
	started    time.Time
	after      time.Duration
}

// WatchReconciles makes the condition say when the agent is stuck: Unknown, ReasonStalled, once no
// reconcile has ended (reconciled, read at each heartbeat) for stallAfter. It may be called while
// Run runs (a patched k3s starts Run before its agent exists; images.ReconcileWatcher).
func (r *Node) WatchReconciles(reconciled func() time.Time, stallAfter time.Duration) {
	r.mu.Lock()
	r.stall = &stallWatch{reconciled: reconciled, started: time.Now(), after: stallAfter}
	r.mu.Unlock()
	select { // the heartbeat shortens to the stall's bound
	case r.changed <- struct{}{}:
	default:
	}
}

// beat is how often the condition is written again: a stall is seen within one beat of it.
func (r *Node) beat() time.Duration {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.stall != nil && r.stall.after < heartbeat {
		return r.stall.after
	}
	return heartbeat
}

// NewNode reports on node through client. Run it to have the condition written.
func NewNode(client *Client, node string) *Node {
	// The correlator aggregates events that differ only in their message and counts repeats of
	// the same one in a single Event; its spam filter lets 25 through per node and reason, then
	// one each 5 minutes (client-go's defaults, the kubelet's too, set here on purpose).
	b := record.NewBroadcasterWithCorrelatorOptions(record.CorrelatorOptions{BurstSize: 25, QPS: 1.0 / 300})
	b.StartRecordingToSink(retryingSink{eventSink{client.core}})
	return &Node{
		client:   client,
		node:     node,
		recorder: b.NewRecorder(scheme, corev1.EventSource{Component: Component, Host: node}),
		stop:     b.Shutdown,
		changed:  make(chan struct{}, 1),
	}
}

// retryingSink is the recorder's sink of Events, but an answer saying that the API server is not
// there (yet) comes back as a transport error, which client-go's recorder retries (12 tries about
// 10 s apart), not as the rejection it drops at once. Seen in make cluster-e2e: while a server was
// stopped, its agents' API answered "apiserver not ready" (k3s's agent load balancer), and an
// ImageRestored Event of that time never reached the cluster, though the condition did.
type retryingSink struct{ record.EventSink }

func (s retryingSink) Create(e *corev1.Event) (*corev1.Event, error) {
	out, err := s.EventSink.Create(e)
	return out, unavailableAsTransient(err)
}

func (s retryingSink) Update(e *corev1.Event) (*corev1.Event, error) {
	out, err := s.EventSink.Update(e)
	return out, unavailableAsTransient(err)
}

func (s retryingSink) Patch(e *corev1.Event, data []byte) (*corev1.Event, error) {
	out, err := s.EventSink.Patch(e, data)
	return out, unavailableAsTransient(err)
}

// unavailableAsTransient is err, but a status that says the server could not answer now (503,
// 429, a server timeout, a 5xx) as a plain error.
func unavailableAsTransient(err error) error {
	var status apierrors.APIStatus
	if err == nil || !errors.As(err, &status) {
		return err
	}
	if code := status.Status().Code; code >= 500 || code == 429 || apierrors.IsServerTimeout(err) {
		return fmt.Errorf("the API server is not available (will retry): %s", err.Error())
	}
	return err
}

// nodeRef is the Node as the kubelet refers to it in its events (its UID is the name).
func (r *Node) nodeRef() *corev1.ObjectReference {
	return &corev1.ObjectReference{Kind: "Node", Name: r.node, UID: types.UID(r.node)}
}

// Event records e on the Node; it never blocks.
func (r *Node) Event(e images.Event) {
	typ := corev1.EventTypeNormal
	if e.Warning {
		typ = corev1.EventTypeWarning
	}
	r.recorder.Event(r.nodeRef(), typ, e.Reason, e.Message)
}

// Protection records p for Run to write; it never blocks.
func (r *Node) Protection(p images.Protection) {
	r.mu.Lock()
	r.latest = &p
	r.mu.Unlock()
	select {
	case r.changed <- struct{}{}:
	default:
	}
}

// Run writes the condition each time the protection changes and every heartbeat, retrying with
// backoff while the API server or the Node is not there yet (a k3s agent starts before its node
// registers), until ctx ends; then it flushes nothing more and stops the event recorder.
func (r *Node) Run(ctx context.Context) {
	defer r.stop()
	lastErr := ""
	wait := retryMin
	timer := time.NewTimer(r.beat())
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-r.changed:
		case <-timer.C:
		}
		r.mu.Lock()
		p := r.latest
		r.mu.Unlock()
		beat := r.beat()
		if p == nil {
			timer.Reset(beat)
			continue
		}
		err := r.writeCondition(ctx, *p)
		switch {
		case err == nil:
			if lastErr != "" {
				logrus.Infof("k3s-pinning: node %s: condition %s written again", r.node, ConditionType)
			}
			lastErr, wait = "", retryMin
			timer.Reset(beat)
		case ctx.Err() != nil:
			return
		default:
			if err.Error() != lastErr {
				logrus.Errorf("k3s-pinning: node %s: writing condition %s (retrying; node-local protection goes on): %v", r.node, ConditionType, err)
				lastErr = err.Error()
			}
			timer.Reset(wait)
			wait = min(2*wait, retryMax)
		}
	}
}

// Condition is the node condition that says p.
func Condition(p images.Protection, now time.Time) corev1.NodeCondition {
	c := corev1.NodeCondition{Type: ConditionType, Status: corev1.ConditionTrue, Reason: ReasonProtected, Message: p.Summary(),
		LastHeartbeatTime: metav1.NewTime(now), LastTransitionTime: metav1.NewTime(now)}
	switch {
	case len(p.Lost) > 0:
		c.Status, c.Reason = corev1.ConditionFalse, ReasonImagesLost
	case len(p.Missing) > 0:
		c.Status, c.Reason = corev1.ConditionFalse, ReasonImagesMissing
	case len(p.FailedArchives) > 0:
		c.Status, c.Reason = corev1.ConditionFalse, ReasonArchivesFailed
	}
	return c
}

// Stalled is c, the condition of the agent's last report, once no reconcile has ended since last
// for more than stallAfter: Unknown, ReasonStalled, the last report kept in the message.
func Stalled(c corev1.NodeCondition, last, now time.Time, stallAfter time.Duration) corev1.NodeCondition {
	if stallAfter <= 0 || now.Sub(last) <= stallAfter {
		return c
	}
	c.Status, c.Reason = corev1.ConditionUnknown, ReasonStalled
	c.Message = fmt.Sprintf("no reconcile of k3s-pinning has ended for %s (since %s): it may be stuck; its last report: %s",
		now.Sub(last).Round(time.Second), last.UTC().Format(time.RFC3339), c.Message)
	return c
}

// writeCondition patches the Node's status with the condition for p. The transition time stays
// the one the Node shows while the status does not change.
func (r *Node) writeCondition(ctx context.Context, p images.Protection) error {
	node, err := r.client.getNode(ctx, r.node)
	if err != nil {
		return err
	}
	now := time.Now()
	c := Condition(p, now)
	r.mu.Lock()
	stall := r.stall
	r.mu.Unlock()
	if stall != nil {
		last := stall.reconciled()
		if last.Before(stall.started) {
			last = stall.started
		}
		c = Stalled(c, last, now, stall.after)
	}
	if i := slices.IndexFunc(node.Status.Conditions, func(o corev1.NodeCondition) bool { return o.Type == ConditionType }); i >= 0 {
		if old := node.Status.Conditions[i]; old.Status == c.Status {
			c.LastTransitionTime = old.LastTransitionTime
		}
	}
	// A strategic merge patch merges conditions by type: the kubelet's own are left alone.
	patch, err := json.Marshal(map[string]any{"status": map[string]any{"conditions": []corev1.NodeCondition{c}}})
	if err != nil {
		return err
	}
	return r.client.patchNodeStatus(ctx, r.node, patch)
}

// NodeStatus is one node as status --cluster shows it.
type NodeStatus struct {
	Node      string    `json:"node"`
	Protected bool      `json:"protected"`
	Status    string    `json:"status"` // True, False, Unknown (no condition, or a stale one)
	Reason    string    `json:"reason"`
	Message   string    `json:"message"`
	Since     time.Time `json:"since,omitzero"`
	Heartbeat time.Time `json:"heartbeat,omitzero"`
}

// NodeStatuses lists every node with its condition. A node with no condition (no k3s-pinning
// on it), or with a heartbeat older than Stale (its agent stopped), is not protected.
func NodeStatuses(ctx context.Context, client *Client, now time.Time) ([]NodeStatus, error) {
	nodes, err := client.listNodes(ctx)
	if err != nil {
		return nil, fmt.Errorf("list nodes: %w", err)
	}
	var out []NodeStatus
	for _, n := range nodes.Items {
		s := NodeStatus{Node: n.Name, Status: string(corev1.ConditionUnknown), Reason: "NoReport", Message: "no " + string(ConditionType) + " condition: k3s-pinning does not run on this node"}
		for _, c := range n.Status.Conditions {
			if c.Type != ConditionType {
				continue
			}
			s.Status, s.Reason, s.Message, s.Since, s.Heartbeat = string(c.Status), c.Reason, c.Message, c.LastTransitionTime.Time, c.LastHeartbeatTime.Time
			s.Protected = c.Status == corev1.ConditionTrue
			if age := now.Sub(c.LastHeartbeatTime.Time); age > Stale {
				s.Protected, s.Status, s.Reason = false, string(corev1.ConditionUnknown), "Stale"
				s.Message = fmt.Sprintf("last report %s ago (k3s-pinning stopped?): %s", age.Round(time.Second), c.Message)
			}
		}
		out = append(out, s)
	}
	slices.SortFunc(out, func(a, b NodeStatus) int { return strings.Compare(a.Node, b.Node) })
	return out, nil
}
