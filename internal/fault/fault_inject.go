//go:build faultinject

package fault

import (
	"fmt"
	"os"
)

// Point stops the process at the point K3S_PINNING_FAULT names: it says so on stderr and blocks,
// for the test to SIGKILL it exactly there.
func Point(name string) {
	if os.Getenv("K3S_PINNING_FAULT") != name {
		return
	}
	fmt.Fprintf(os.Stderr, "FAULT POINT %s REACHED\n", name)
	select {}
}
