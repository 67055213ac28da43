package images

import (
	"context"
	"errors"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/sirupsen/logrus"
)

// metrics are the agent's Prometheus metrics, in their own registry.
var metrics = struct {
	registry                *prometheus.Registry
	wanted, pinned, missing prometheus.Gauge
	repins                  prometheus.Counter
	restores                *prometheus.CounterVec
	reconcile               prometheus.Histogram
}{
	registry:  prometheus.NewRegistry(),
	wanted:    prometheus.NewGauge(prometheus.GaugeOpts{Name: "k3s_pinning_wanted_references", Help: "References the images dir provides."}),
	pinned:    prometheus.NewGauge(prometheus.GaugeOpts{Name: "k3s_pinning_pinned_references", Help: "Wanted references present and pinned."}),
	missing:   prometheus.NewGauge(prometheus.GaugeOpts{Name: "k3s_pinning_missing_references", Help: "Wanted references not in containerd."}),
	repins:    prometheus.NewCounter(prometheus.CounterOpts{Name: "k3s_pinning_repins_total", Help: "Pins set again after they were removed."}),
	restores:  prometheus.NewCounterVec(prometheus.CounterOpts{Name: "k3s_pinning_restores_total", Help: "Restores of deleted images from their archive."}, []string{"result"}),
	reconcile: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "k3s_pinning_reconcile_seconds", Help: "Duration of full reconciles.", Buckets: prometheus.ExponentialBuckets(0.01, 4, 8)}),
}

func init() {
	metrics.registry.MustRegister(metrics.wanted, metrics.pinned, metrics.missing, metrics.repins, metrics.restores, metrics.reconcile)
}

// observeReferences sets the reference gauges from what a sync found: a reference loaded without
// error is present and pinned (by us or its owner); one with an error is missing.
func observeReferences(report *SyncReport) {
	var wanted, pinned float64
	for _, a := range report.Archives {
		for _, r := range a.Refs {
			wanted++
			if r.Err == nil {
				pinned++
			}
		}
	}
	metrics.wanted.Set(wanted)
	metrics.pinned.Set(pinned)
	metrics.missing.Set(wanted - pinned)
}

// ServeMetrics serves /metrics on addr until ctx ends. A bare port listens on 127.0.0.1 only:
// exposing it wider is a choice the operator makes by naming the address.
func ServeMetrics(ctx context.Context, addr string) error {
	if host, port, err := net.SplitHostPort(addr); err == nil && host == "" {
		addr = net.JoinHostPort("127.0.0.1", port)
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(metrics.registry, promhttp.HandlerOpts{}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		<-ctx.Done()
		srv.Close()
	}()
	logrus.Infof("metrics on http://%s/metrics", ln.Addr())
	if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}
