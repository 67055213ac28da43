package cluster

import (
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/k3s-pinning/k3s-pinning/pkg/agent/images"
)

// TestCondition: what the node condition says for each kind of protection; a loss outranks a
// restore in progress, which outranks an archive that failed.
func TestCondition(t *testing.T) {
	now := time.Date(2026, 12, 3, 8, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		name         string
		p            images.Protection
		status       corev1.ConditionStatus
		reason       string
		messageNames []string
	}{
		{"protected", images.Protection{Wanted: 12}, corev1.ConditionTrue, ReasonProtected, []string{"all 12"}},
		{"restore pending", images.Protection{Wanted: 12, Missing: []string{"a:1"}}, corev1.ConditionFalse, ReasonImagesMissing, []string{"1 of 12", "a:1"}},
		{"lost", images.Protection{Wanted: 12, Missing: []string{"a:1", "h:1"}, Lost: []string{"h:1"}, FailedArchives: map[string]string{"x.tar": "bad"}},
			corev1.ConditionFalse, ReasonImagesLost, []string{"2 of 12", "1 lost", "h:1", "x.tar"}},
		{"archive failed", images.Protection{Wanted: 3, FailedArchives: map[string]string{"x.tar": "bad"}}, corev1.ConditionFalse, ReasonArchivesFailed, []string{"1 archive(s)", "x.tar"}},
		{"many missing", images.Protection{Wanted: 9, Missing: []string{"a", "b", "c", "d", "e"}}, corev1.ConditionFalse, ReasonImagesMissing, []string{"a, b, c and 2 more"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := Condition(tc.p, now)
			if c.Type != ConditionType || c.Status != tc.status || c.Reason != tc.reason {
				t.Errorf("condition %s %s %s, want %s %s %s", c.Type, c.Status, c.Reason, ConditionType, tc.status, tc.reason)
			}
			for _, want := range tc.messageNames {
				if !strings.Contains(c.Message, want) {
					t.Errorf("message %q does not say %q", c.Message, want)
				}
			}
			if !c.LastHeartbeatTime.Time.Equal(now) {
				t.Errorf("heartbeat %s, want %s", c.LastHeartbeatTime, now)
			}
		})
	}
}

// TestStalledCondition: the condition of the agent's last report stands while reconciles end;
// once none has ended for longer than the bound it is Unknown, ReconcileStalled, saying since when
// and keeping the last report.
func TestStalledCondition(t *testing.T) {
	now := time.Date(2026, 12, 7, 8, 0, 0, 0, time.UTC)
	reported := Condition(images.Protection{Wanted: 4}, now)
	if c := Stalled(reported, now.Add(-14*time.Minute), now, 15*time.Minute); c.Status != corev1.ConditionTrue || c.Reason != ReasonProtected {
		t.Errorf("14 min after a reconcile, bound 15: %s %s, want the report's", c.Status, c.Reason)
	}
	c := Stalled(reported, now.Add(-16*time.Minute), now, 15*time.Minute)
	if c.Status != corev1.ConditionUnknown || c.Reason != ReasonStalled {
		t.Errorf("16 min after a reconcile, bound 15: %s %s, want Unknown %s", c.Status, c.Reason, ReasonStalled)
	}
	for _, want := range []string{"16m0s", "2026-12-07T07:44:00Z", "may be stuck", reported.Message} {
		if !strings.Contains(c.Message, want) {
			t.Errorf("message %q does not say %q", c.Message, want)
		}
	}
}

// An Event the API server could not take now (k3s's agent load balancer answers 503 "apiserver
// not ready" while the server restarts) goes back to the recorder as an error it retries; one the
// server refused for what it is stays a rejection, which the recorder drops.
func TestEventsAreRetriedWhileTheServerIsAway(t *testing.T) {
	cases := []struct {
		err   error
		retry bool
	}{
		{apierrors.NewServiceUnavailable("apiserver not ready"), true},
		{apierrors.NewTooManyRequests("slow down", 1), true},
		{apierrors.NewInternalError(errors.New("etcd")), true},
		{apierrors.NewServerTimeout(schema.GroupResource{Resource: "events"}, "create", 1), true},
		{apierrors.NewAlreadyExists(schema.GroupResource{Resource: "events"}, "e"), false},
		{apierrors.NewForbidden(schema.GroupResource{Resource: "events"}, "e", errors.New("no")), false},
		{errors.New("connection refused"), true}, // already a transport error: unchanged
	}
	for _, c := range cases {
		sink := retryingSink{failingSink{c.err}}
		_, err := sink.Create(&corev1.Event{})
		var status apierrors.APIStatus
		if retried := !errors.As(err, &status); retried != c.retry {
			t.Errorf("%v: retried by the recorder %t, want %t (got %T %v)", c.err, retried, c.retry, err, err)
		}
	}
}

// failingSink answers every call with err.
type failingSink struct{ err error }

func (s failingSink) Create(*corev1.Event) (*corev1.Event, error)        { return nil, s.err }
func (s failingSink) Update(*corev1.Event) (*corev1.Event, error)        { return nil, s.err }
func (s failingSink) Patch(*corev1.Event, []byte) (*corev1.Event, error) { return nil, s.err }

// TestStallWatchedWhileRunning: WatchReconciles may come after Run started (a patched k3s starts
// Run before its agent exists): the heartbeat shortens to the stall's bound, read under the lock.
func TestStallWatchedWhileRunning(t *testing.T) {
	n := &Node{changed: make(chan struct{}, 1)}
	if got := n.beat(); got != heartbeat {
		t.Errorf("beat %s before WatchReconciles, want the heartbeat %s", got, heartbeat)
	}
	done := make(chan struct{})
	go func() { // as k3spinning.Start does, beside Run's loop reading the beat
		defer close(done)
		n.WatchReconciles(func() time.Time { return time.Time{} }, time.Second)
	}()
	for deadline := time.Now().Add(5 * time.Second); n.beat() != time.Second; {
		if time.Now().After(deadline) {
			t.Fatalf("beat %s after WatchReconciles(1s)", n.beat())
		}
		time.Sleep(time.Millisecond)
	}
	<-done
	select {
	case <-n.changed:
	default:
		t.Errorf("WatchReconciles did not wake Run to write the condition at the new beat")
	}
}

// TestDescribeMissing: the denial names each namespace once, the kinds missing the same verbs
// together, in the order the agent asked.
func TestDescribeMissing(t *testing.T) {
	var missing []access
	for _, ns := range []string{"tenant-a", "tenant-b"} {
		missing = append(missing, access{"list", "apps", "deployments", ns}, access{"watch", "apps", "deployments", ns})
	}
	missing = append(missing, access{"list", "", "pods", "tenant-a"}, access{"watch", "", "pods", "tenant-a"}, access{"watch", "", "pods", "tenant-b"})
	// as missingAccess returns them: namespace by namespace
	slices.SortStableFunc(missing, func(a, b access) int { return strings.Compare(a.namespace, b.namespace) })
	want := "list and watch deployments.apps, pods in tenant-a; list and watch deployments.apps in tenant-b; watch pods in tenant-b"
	if got := describeMissing(missing); got != want {
		t.Errorf("describeMissing:\n got %s\nwant %s", got, want)
	}
}
