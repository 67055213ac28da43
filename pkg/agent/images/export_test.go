package images

import "time"

// SetWriterStalled sets how long the import waits on another writer that writes nothing, until
// the test ends.
func SetWriterStalled(t interface{ Cleanup(func()) }, d time.Duration) {
	old := writerStalled
	writerStalled = d
	t.Cleanup(func() { writerStalled = old })
}
