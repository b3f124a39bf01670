//go:build race

package lint

func init() { buildFlags = append(buildFlags, "-race") }
