//go:build !linux

package fluxvm

import "fmt"

// installFQ: without rtnetlink there is no qdisc to manage.
func installFQ(name string) (managedFQ, error) {
	return managedFQ{name: name}, fmt.Errorf("interface %s: no qdiscs on this system: %w", name, ErrNoFQ)
}

func removeFQ(m managedFQ) error { return nil }

// rootQdiscKind is unknown on this system.
func rootQdiscKind(name string) (string, error) { return "", nil }
