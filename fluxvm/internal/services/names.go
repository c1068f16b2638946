package services

import "sync"

// NameLocks serialise the changes of each service: applies and deletes
// of one name (and identity policy changes that touch it) run one at a
// time, in the order they took its lock, while changes of different
// services run concurrently. The zero value is ready to use.
type NameLocks struct {
	mu    sync.Mutex
	names map[string]*nameLock
}

// nameLock is the lock of one name, kept while anyone holds or waits
// for it.
type nameLock struct {
	mu   sync.Mutex
	refs int
}

// Lock takes the lock of service name and returns its unlock. The facade
// takes it before its own lock, never while holding it.
func (n *NameLocks) Lock(name string) (unlock func()) {
	n.mu.Lock()
	if n.names == nil {
		n.names = map[string]*nameLock{}
	}
	l := n.names[name]
	if l == nil {
		l = &nameLock{}
		n.names[name] = l
	}
	l.refs++
	n.mu.Unlock()
	l.mu.Lock()
	return func() {
		l.mu.Unlock()
		n.mu.Lock()
		if l.refs--; l.refs == 0 {
			delete(n.names, name)
		}
		n.mu.Unlock()
	}
}
