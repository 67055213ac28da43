package images

import "errors"

// fsUsage is not measured on Windows: StartK3s refuses to run there.
func fsUsage(string) (DiskUsage, error) { return DiskUsage{}, errors.ErrUnsupported }
