package images

import (
	"github.com/prometheus/client_golang/prometheus"
)

// agentMetrics are one agent's Prometheus metrics; the program registers them where it serves
// metrics (Agent.Metrics), so two agents in one process never share a counter.
type agentMetrics struct {
	wanted, pinned, missing prometheus.Gauge
	repins                  prometheus.Counter
	restores                *prometheus.CounterVec
	reconcile               prometheus.Histogram
}

func newMetrics() *agentMetrics {
	return &agentMetrics{
		wanted:    prometheus.NewGauge(prometheus.GaugeOpts{Name: "k3s_pinning_wanted_references", Help: "References the images dir provides."}),
		pinned:    prometheus.NewGauge(prometheus.GaugeOpts{Name: "k3s_pinning_pinned_references", Help: "Wanted references present and pinned."}),
		missing:   prometheus.NewGauge(prometheus.GaugeOpts{Name: "k3s_pinning_missing_references", Help: "Wanted references not in containerd."}),
		repins:    prometheus.NewCounter(prometheus.CounterOpts{Name: "k3s_pinning_repins_total", Help: "Pins set again after they were removed."}),
		restores:  prometheus.NewCounterVec(prometheus.CounterOpts{Name: "k3s_pinning_restores_total", Help: "Restores of deleted images from their archive."}, []string{"result"}),
		reconcile: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "k3s_pinning_reconcile_seconds", Help: "Duration of full reconciles.", Buckets: prometheus.ExponentialBuckets(0.01, 4, 8)}),
	}
}

func (m *agentMetrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{m.wanted, m.pinned, m.missing, m.repins, m.restores, m.reconcile}
}

// Describe and Collect make an agent's metrics one prometheus.Collector (Agent.Metrics).
func (m *agentMetrics) Describe(ch chan<- *prometheus.Desc) {
	for _, c := range m.collectors() {
		c.Describe(ch)
	}
}

func (m *agentMetrics) Collect(ch chan<- prometheus.Metric) {
	for _, c := range m.collectors() {
		c.Collect(ch)
	}
}

// observeReferences sets the reference gauges from what a sync found: a reference loaded without
// error is present and pinned (by us or its owner); one with an error is missing.
func (m *agentMetrics) observeReferences(report *SyncReport) {
	var wanted, pinned float64
	for _, a := range report.Archives {
		for _, r := range a.Refs {
			wanted++
			if r.Err == nil {
				pinned++
			}
		}
	}
	m.wanted.Set(wanted)
	m.pinned.Set(pinned)
	m.missing.Set(wanted - pinned)
}
