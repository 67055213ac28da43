package images

import "errors"

// fsUsage is not measured on Windows: k3spinning.Start refuses to run there.
func fsUsage(string) (DiskUsage, error) { return DiskUsage{}, errors.ErrUnsupported }
