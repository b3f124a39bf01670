//go:build !unix

package httpx

// descriptorLimit: no limit this package can read on this system.
func descriptorLimit() int { return 0 }
