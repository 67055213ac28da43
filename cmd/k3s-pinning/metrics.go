package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/sirupsen/logrus"
)

// health answers the orchestrator's probes from the agent's own clock, never waiting on the agent:
// ready once its first sync ended, alive while a reconcile ended (or the agent started) within
// stallAfter.
type health struct {
	started    time.Time
	reconciled func() time.Time
	stallAfter time.Duration
}

// alive reports whether the agent's loop is making progress, and says how it stands.
func (h health) alive(now time.Time) (bool, string) {
	last := h.reconciled()
	since := h.started
	if last.After(since) {
		since = last
	}
	if age := now.Sub(since); age > h.stallAfter {
		if last.IsZero() {
			return false, fmt.Sprintf("no reconcile has ended in the %s since the agent started (more than %s): it is stuck", age.Round(100*time.Millisecond), h.stallAfter)
		}
		return false, fmt.Sprintf("no reconcile has ended for %s (more than %s): the agent is stuck", age.Round(100*time.Millisecond), h.stallAfter)
	}
	if last.IsZero() {
		return true, "the first sync is under way"
	}
	return true, fmt.Sprintf("last reconcile ended %s ago", now.Sub(last).Round(time.Second))
}

// ready reports whether the first sync has ended.
func (h health) ready() (bool, string) {
	if h.reconciled().IsZero() {
		return false, "the first sync is under way"
	}
	return true, "the first sync has ended"
}

func probe(check func() (bool, string)) http.HandlerFunc {
	return func(w http.ResponseWriter, _ *http.Request) {
		ok, why := check()
		if !ok {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
		fmt.Fprintln(w, why)
	}
}

// serveHTTP serves /metrics from registry, and /healthz and /readyz from h, on addr until ctx
// ends. A bare port listens on 127.0.0.1 only: exposing it wider is a choice the operator makes
// by naming the address.
func serveHTTP(ctx context.Context, addr string, registry *prometheus.Registry, h health) error {
	if host, port, err := net.SplitHostPort(addr); err == nil && host == "" {
		addr = net.JoinHostPort("127.0.0.1", port)
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(registry, promhttp.HandlerOpts{}))
	mux.Handle("/healthz", probe(func() (bool, string) { return h.alive(time.Now()) }))
	mux.Handle("/readyz", probe(h.ready))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		<-ctx.Done() // the caller's errgroup ends ctx when serving fails too
		srv.Close()
	}()
	logrus.Infof("metrics on http://%s/metrics, probes on /healthz and /readyz", ln.Addr())
	if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}
