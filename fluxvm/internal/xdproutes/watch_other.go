//go:build !linux

package xdproutes

// hostSystem: without rtnetlink there is no watch, and the cache stays
// off.
func hostSystem() system { return system{idle: "no route watch on this system"} }

// Start does nothing here: there is no route watch on this system, and
// Status says so.
func (w *Watch) Start() {}
