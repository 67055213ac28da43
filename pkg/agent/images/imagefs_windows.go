package images

import "errors"

// fsUsage is not measured on Windows: StartK3s refuses to run there.
func fsUsage(string) (float64, error) { return 0, errors.ErrUnsupported }
