//go:build !linux

package edt

import "fmt"

// installFQ: without rtnetlink there is no qdisc to manage.
func installFQ(name string) (managedFQ, error) {
	return managedFQ{name: name}, fmt.Errorf("interface %s: no qdiscs on this system: %w", name, ErrNoFQ)
}

func removeFQ(m managedFQ) error { return nil }

func removeStrayFQ(keep map[string]bool) ([]string, error) { return nil, nil }

// qdiscsOf is unknown on this system.
func qdiscsOf(name string) ([]qdiscInfo, error) { return nil, nil }
