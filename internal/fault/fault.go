//go:build !faultinject

// Package fault marks the moments a crash test kills the agent at (Point). In every normal build
// a Point is nothing; built with -tags faultinject (crash tests only), it stops the process there.
package fault

// Point marks a moment a crash test kills the agent at.
func Point(string) {}
