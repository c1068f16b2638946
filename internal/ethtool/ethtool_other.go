//go:build !linux

package ethtool

import (
	"errors"
	"fmt"
)

// Features reports every feature of the interface by its kernel name.
func Features(ifname string) (map[string]Feature, error) {
	return nil, fmt.Errorf("ethtool: features of %s: %w", ifname, errors.ErrUnsupported)
}

// SetFeatures turns the named features on (true) or off (false).
func SetFeatures(ifname string, want map[string]bool) error {
	return fmt.Errorf("ethtool: set features of %s: %w", ifname, errors.ErrUnsupported)
}
