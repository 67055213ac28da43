package cluster

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/sirupsen/logrus"
	appsv1 "k8s.io/api/apps/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/tools/cache"

	"github.com/k3s-pinning/k3s-pinning/pkg/agent/images"
)

// WorkloadsClusterRole is the ClusterRole of deploy/k3s-pinning-workloads.yaml: list and watch on
// the kinds below, nothing else, granted by a RoleBinding in each namespace in scope.
const WorkloadsClusterRole = "k3s-pinning-workloads"

// workloadKind is a kind --pinned-workload-images reads: the access it needs and what its
// informer lists (an object of the kind, and its pod spec).
type workloadKind struct {
	kind, group, resource string
	example               runtime.Object
	spec                  func(any) *corev1.PodSpec
}

// workloadKinds are every kind with a pod template, and Pods.
var workloadKinds = []workloadKind{
	{"Deployment", "apps", "deployments", &appsv1.Deployment{}, func(o any) *corev1.PodSpec { return &o.(*appsv1.Deployment).Spec.Template.Spec }},
	{"StatefulSet", "apps", "statefulsets", &appsv1.StatefulSet{}, func(o any) *corev1.PodSpec { return &o.(*appsv1.StatefulSet).Spec.Template.Spec }},
	{"DaemonSet", "apps", "daemonsets", &appsv1.DaemonSet{}, func(o any) *corev1.PodSpec { return &o.(*appsv1.DaemonSet).Spec.Template.Spec }},
	{"ReplicaSet", "apps", "replicasets", &appsv1.ReplicaSet{}, func(o any) *corev1.PodSpec { return &o.(*appsv1.ReplicaSet).Spec.Template.Spec }},
	{"Job", "batch", "jobs", &batchv1.Job{}, func(o any) *corev1.PodSpec { return &o.(*batchv1.Job).Spec.Template.Spec }},
	{"CronJob", "batch", "cronjobs", &batchv1.CronJob{}, func(o any) *corev1.PodSpec { return &o.(*batchv1.CronJob).Spec.JobTemplate.Spec.Template.Spec }},
	{"Pod", "", "pods", &corev1.Pod{}, func(o any) *corev1.PodSpec { return &o.(*corev1.Pod).Spec }},
}

// CheckWorkloadScope checks what the agent checks not (images.PolicyValues): the selector's
// syntax, naming its flag.
func CheckWorkloadScope(scope images.WorkloadScope) error {
	if _, err := labels.Parse(scope.Selector); err != nil {
		return fmt.Errorf("--%s %q: %w", images.FlagWorkloadSelector, scope.Selector, err)
	}
	return nil
}

// ReasonWorkloadAccessDenied is the Event of credentials that may not read the workloads.
const ReasonWorkloadAccessDenied = "WorkloadAccessDenied"

const (
	// accessRetry is the wait before the access is asked again: a binding applied after the
	// denial takes effect within it, and a node never granted asks one cheap question each time.
	accessRetry = 30 * time.Second
	settle      = time.Second // a rollout changes several objects at once: one update for them
)

// WatchWorkloads follows the pod templates of the Deployments, StatefulSets, DaemonSets,
// ReplicaSets, Jobs and CronJobs, and the Pods, of the namespaces in scope whose labels match its
// selector, and calls update with every image they name (and the workloads naming each) each
// time that changes, until ctx ends. It never reads a namespace outside the scope: the
// credentials need list and watch there only. A workload scaled to zero keeps its template, so
// its image is kept too. It first asks the API server whether its credentials may list and
// watch each kind in each namespace; while they may not, it says what is missing (once for each
// change) and asks again every 30 s, one question at a time (the first permission still
// missing): the node-local protection goes on meanwhile, and update is not called, so nothing is
// released on a guess. A scope that does not parse is reported the same way, and never watched.
func (n *Node) WatchWorkloads(ctx context.Context, scope images.WorkloadScope, update func(images.WorkloadImages)) {
	selector, err := labels.Parse(scope.Selector)
	if err != nil {
		err = CheckWorkloadScope(scope) // the same error, naming the flag
	} else if len(scope.Namespaces) == 0 {
		err = fmt.Errorf("no --%s: no workload is read cluster-wide", images.FlagWorkloadNamespaces)
	}
	if err != nil {
		logrus.Errorf("k3s-pinning: --%s: %v; the images dir and the policy are kept", images.FlagPinnedWorkloadImages, err)
		n.Event(images.Event{Warning: true, Reason: ReasonWorkloadAccessDenied, Message: fmt.Sprintf("--%s: %v", images.FlagPinnedWorkloadImages, err)})
		return
	}
	said := ""
	var missing []access
	for {
		var err error
		if len(missing) > 0 {
			// Still denied the first one: nothing changed, and one question was enough.
			var allowed bool
			if allowed, err = n.allowed(ctx, missing[0]); err == nil && allowed {
				missing = nil
			}
		}
		if err == nil && len(missing) == 0 {
			missing, err = n.missingAccess(ctx, scope.Namespaces)
			if err == nil && len(missing) == 0 {
				break
			}
		}
		var msg string
		if err != nil {
			msg = fmt.Sprintf("cannot check its access: %v", err)
		} else {
			msg = fmt.Sprintf("its credentials may not %s; bind the ClusterRole %s to them with a RoleBinding in each namespace in scope (deploy/k3s-pinning-workloads.yaml)", describeMissing(missing), WorkloadsClusterRole)
		}
		if msg != said {
			logrus.Errorf("k3s-pinning: --pinned-workload-images: %s; asking again every %s, the images dir and the policy are kept meanwhile", msg, accessRetry)
			// Only a denial is an Event: a check that fails (a k3s server's first seconds, before
			// its RBAC is bootstrapped, refuses even this question) is logged and asked again.
			if err == nil {
				n.Event(images.Event{Warning: true, Reason: ReasonWorkloadAccessDenied, Message: "--pinned-workload-images: " + msg})
			}
			said = msg
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(accessRetry):
		}
	}
	if said != "" {
		logrus.Infof("k3s-pinning: --pinned-workload-images: access granted; following the cluster's workloads")
	}

	changed := make(chan struct{}, 1)
	poke := func() {
		select {
		case changed <- struct{}{}:
		default:
		}
	}
	handler := cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { poke() },
		UpdateFunc: func(any, any) { poke() },
		DeleteFunc: func(any) { poke() },
	}
	var listers []func(yield func(owner string, spec *corev1.PodSpec))
	var synced []cache.InformerSynced
	var running sync.WaitGroup
	defer running.Wait() // the informers stop with ctx
	onlySelected := func(o *metav1.ListOptions) { o.LabelSelector = selector.String() }
	for _, ns := range scope.Namespaces {
		for _, k := range workloadKinds {
			lw := cache.NewFilteredListWatchFromClient(n.client.forGroup(k.group), k.resource, ns, onlySelected)
			inf := cache.NewSharedIndexInformer(lw, k.example, 0, cache.Indexers{})
			if err := inf.SetTransform(trimToPodSpec); err != nil {
				logrus.Errorf("k3s-pinning: --pinned-workload-images: %v", err)
			}
			if _, err := inf.AddEventHandler(handler); err != nil {
				logrus.Errorf("k3s-pinning: --pinned-workload-images: %v", err)
			}
			running.Add(1)
			go func() {
				defer running.Done()
				inf.Run(ctx.Done())
			}()
			synced = append(synced, inf.HasSynced)
			kind, spec := k.kind, k.spec
			listers = append(listers, func(yield func(string, *corev1.PodSpec)) {
				for _, obj := range inf.GetStore().List() {
					m, ok := obj.(metav1.Object)
					if s := spec(obj); s != nil && ok {
						yield(kind+" "+m.GetNamespace()+"/"+m.GetName(), s)
					}
				}
			})
		}
	}
	if !cache.WaitForCacheSync(ctx.Done(), synced...) && ctx.Err() == nil {
		logrus.Errorf("k3s-pinning: --pinned-workload-images: the workloads' caches did not sync")
	}
	var last images.WorkloadImages
	for {
		named := images.WorkloadImages{}
		for _, list := range listers {
			list(func(owner string, spec *corev1.PodSpec) {
				for _, ref := range specImages(*spec) {
					named[ref] = append(named[ref], owner)
				}
			})
		}
		for ref := range named {
			slices.Sort(named[ref])
		}
		if last == nil || !maps.EqualFunc(named, last, slices.Equal) {
			logrus.Infof("k3s-pinning: the workloads in scope (%s) reference %d image(s)", strings.Join(scope.Namespaces, ", "), len(named))
			update(named)
			last = named
		}
		select {
		case <-ctx.Done():
			return
		case <-changed:
		}
		select { // let a burst of changes settle
		case <-ctx.Done():
			return
		case <-time.After(settle):
		}
	}
}

// access is one permission WatchWorkloads needs: a verb on a kind in a namespace.
type access struct{ verb, group, resource, namespace string }

// kind is the resource as kubectl names it: deployments.apps, pods.
func (a access) kind() string {
	if a.group == "" {
		return a.resource
	}
	return a.resource + "." + a.group
}

// describeMissing says what missing lacks, a namespace at a time, the kinds missing the same verbs
// together: "list and watch deployments.apps, pods in tenant-a; watch pods in tenant-b".
func describeMissing(missing []access) string {
	var namespaces []string
	verbs := map[string]map[string][]string{} // namespace -> kind -> verbs
	var kinds []string
	for _, m := range missing {
		if verbs[m.namespace] == nil {
			verbs[m.namespace] = map[string][]string{}
			namespaces = append(namespaces, m.namespace)
		}
		if !slices.Contains(kinds, m.kind()) {
			kinds = append(kinds, m.kind())
		}
		verbs[m.namespace][m.kind()] = append(verbs[m.namespace][m.kind()], m.verb)
	}
	var parts []string
	for _, ns := range namespaces {
		var order []string
		byVerbs := map[string][]string{}
		for _, k := range kinds { // in workloadKinds' order
			if v := verbs[ns][k]; v != nil {
				key := strings.Join(v, " and ")
				if byVerbs[key] == nil {
					order = append(order, key)
				}
				byVerbs[key] = append(byVerbs[key], k)
			}
		}
		for _, key := range order {
			parts = append(parts, key+" "+strings.Join(byVerbs[key], ", ")+" in "+ns)
		}
	}
	return strings.Join(parts, "; ")
}

// missingAccess asks the API server (SelfSubjectAccessReview) whether the credentials may list
// and watch each workload kind in each namespace, and returns those they may not.
func (n *Node) missingAccess(ctx context.Context, namespaces []string) ([]access, error) {
	var missing []access
	for _, ns := range namespaces {
		for _, k := range workloadKinds {
			for _, verb := range []string{"list", "watch"} {
				a := access{verb, k.group, k.resource, ns}
				ok, err := n.allowed(ctx, a)
				if err != nil {
					return nil, err
				}
				if !ok {
					missing = append(missing, a)
				}
			}
		}
	}
	return missing, nil
}

func (n *Node) allowed(ctx context.Context, a access) (bool, error) {
	review := &authorizationv1.SelfSubjectAccessReview{Spec: authorizationv1.SelfSubjectAccessReviewSpec{
		ResourceAttributes: &authorizationv1.ResourceAttributes{Verb: a.verb, Group: a.group, Resource: a.resource, Namespace: a.namespace},
	}}
	got, err := n.client.reviewAccess(ctx, review)
	if err != nil {
		return false, err
	}
	return got.Status.Allowed, nil
}

// specImages are the images a pod spec names.
func specImages(s corev1.PodSpec) []string {
	set := map[string]bool{}
	for _, c := range s.InitContainers {
		set[c.Image] = true
	}
	for _, c := range s.Containers {
		set[c.Image] = true
	}
	for _, c := range s.EphemeralContainers {
		set[c.Image] = true
	}
	delete(set, "")
	return slices.Collect(maps.Keys(set))
}

// trimToPodSpec drops what the informers' caches need not keep (managed fields, annotations,
// status): on a large cluster every node's agent holds every workload.
func trimToPodSpec(obj any) (any, error) {
	if m, ok := obj.(metav1.Object); ok {
		m.SetManagedFields(nil)
		m.SetAnnotations(nil)
	}
	switch o := obj.(type) {
	case *corev1.Pod:
		o.Status = corev1.PodStatus{}
	case *appsv1.Deployment:
		o.Status = appsv1.DeploymentStatus{}
	case *appsv1.ReplicaSet:
		o.Status = appsv1.ReplicaSetStatus{}
	}
	return obj, nil
}
