//go:build !faultinject

package images

// faultPoint marks a moment a crash test kills the agent at (see fault_inject.go). In every
// normal build it is nothing.
func faultPoint(string) {}
