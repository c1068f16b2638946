// Package duration holds the Duration type that package fluxvm exports
// (fluxvm.Duration) and its components' status types use: a
// time.Duration written as a Go duration string ("30s", "6h", "1m30s")
// in TOML and JSON. It is here, below the facade, so that a component can
// report one without importing package fluxvm.
package duration

import (
	"fmt"
	"time"
)

// Duration is a time.Duration written in TOML as a Go duration string
// ("30s", "6h", "1m30s"). A bare number is rejected: it would be
// ambiguous about its unit.
type Duration struct{ time.Duration }

// UnmarshalText parses a Go duration string.
func (d *Duration) UnmarshalText(b []byte) error {
	v, err := time.ParseDuration(string(b))
	if err != nil {
		return fmt.Errorf("%q is not a duration; write a string such as \"30s\", \"6h\" or \"1m30s\"", b)
	}
	d.Duration = v
	return nil
}

// MarshalText formats d as a Go duration string.
func (d Duration) MarshalText() ([]byte, error) { return []byte(d.Duration.String()), nil }
