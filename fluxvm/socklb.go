package fluxvm

import (
	"fmt"

	"github.com/fluxvm/servicefabric/fluxvm/internal/socklb"
)

// Socket load balancing (cgroup_connect) is package
// fluxvm/internal/socklb: with Options.SocketLB.CgroupConnect, Open
// attaches the socket hooks of the datapath to one cgroup v2 directory
// (links pinned under the pin root, kept across restarts) and removes ours
// from any other; without it, Open removes those an earlier start left;
// Cleanup removes them too. Its worker terminates connected UDP sockets
// whose backend can no longer serve them: after changes that can leave a
// backend unable to serve (the apply path calls staleSockets) and every
// DefaultSocketDestroyInterval. It never takes d.mu, so applies never wait
// for it.

// DefaultSocketDestroyInterval is how often, besides after backend
// changes, the socket LB worker terminates connected UDP sockets whose
// backend can no longer serve them: a drain deadline passes with no change
// of the catalog.
const DefaultSocketDestroyInterval = socklb.DefaultDestroyInterval

// SocketLBStatus is the state of socket load balancing (cgroup_connect).
type SocketLBStatus = socklb.Status

// SocketDestroyStatus reports the worker that terminates connected UDP
// sockets of socket load balancing whose backend is removed, Unhealthy or
// past its drain deadline (bpf.Datapath.DestroyStaleUDPSockets).
type SocketDestroyStatus = socklb.DestroyStatus

// SocketLBCgroup returns the cgroup v2 directory socket load balancing
// attaches to on this host, as Open resolves it: cgroup_path, or the root
// of the cgroup v2 hierarchy found from the mount table; "" when
// cgroup_connect is false. Like Open, it fails with an error wrapping
// cgroup2.ErrNoCgroupV2 on a host without cgroup v2, and one wrapping
// cgroup2.ErrNotCgroupV2 (bpf.ErrNotCgroupV2) when the directory is not a
// cgroup v2 one. It changes nothing (fluxvmd check-config uses it).
func (c *Config) SocketLBCgroup() (string, error) {
	path, err := Options{SocketLB: SocketLBOptions{CgroupConnect: c.CgroupConnect, CgroupPath: c.CgroupPath}}.socketLBCgroup()
	if err != nil {
		return "", fmt.Errorf("fluxvm: config: %w", err)
	}
	return path, nil
}

// socketLBCgroup, for options that passed Validate, returns with
// CgroupConnect the cgroup v2 directory to attach to (socklb.CgroupDir:
// CgroupPath, or the root of the hierarchy).
func (o Options) socketLBCgroup() (string, error) {
	if !o.SocketLB.CgroupConnect {
		return "", nil
	}
	return socklb.CgroupDir(o.SocketLB.CgroupPath)
}

// initSocketLB makes the socket LB component on the cgroup v2 directory
// path and attaches its hooks (socklb.LB.Attach); the hooks it attached
// itself go on undo, for a failed Open. Its worker starts with Start, once
// nothing can fail. d not yet shared.
func (d *Dataplane) initSocketLB(path string, undo *undoStack) error {
	s, err := socklb.New(socklb.Config{Enabled: d.opts.SocketLB.CgroupConnect, CgroupPath: path, DestroyInterval: d.opts.sockDestroyEvery},
		socklb.Deps{Datapath: d.dp, InNamespace: d.opts.InNamespace, Destroy: d.opts.sockDestroy, Log: d.log})
	if err != nil {
		return fmt.Errorf("fluxvm: open: %w", err)
	}
	d.sock = s
	u, err := s.Attach()
	if err != nil {
		return fmt.Errorf("fluxvm: open: %w", err)
	}
	if u != nil {
		undo.push(u)
	}
	return nil
}

// staleSockets asks the destroy worker for a run, without waiting: a
// backend was removed or can no longer serve. d.mu held (the worker's
// lock comes after it).
func (d *Dataplane) staleSockets() { d.sock.Request() }
