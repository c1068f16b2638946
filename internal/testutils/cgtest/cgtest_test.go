//go:build linux

package cgtest_test

import (
	"errors"
	"io/fs"
	"net/netip"
	"os"
	"reflect"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fluxvm/servicefabric/internal/cgroup2"
	"github.com/fluxvm/servicefabric/internal/testutils/cgtest"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

func TestMain(m *testing.M) { cgtest.Main(m) }

func TestCgroupLifecycle(t *testing.T) {
	testenv.CgroupV2Root(t) // skip here, not in the subtest
	var cg *cgtest.Cgroup
	var child *cgtest.Child
	t.Run("inside", func(t *testing.T) {
		cg = cgtest.New(t)
		if err := cgroup2.Check(cg.Path); err != nil {
			t.Fatal(err)
		}
		root, _ := cgroup2.Root()
		if !strings.HasPrefix(cg.Path, root+"/fluxvm-test-") {
			t.Errorf("cgroup %s is not fluxvm-test-* below the root %s", cg.Path, root)
		}
		if pids, err := cg.Procs(); err != nil || len(pids) != 0 {
			t.Fatalf("new cgroup holds %v (%v)", pids, err)
		}
		l := lab.NewForTest(t)
		vm := l.AddVMForTest(t, 1)
		child = cgtest.Start(t, cg, vm.NS.Handle())

		pids, err := cg.Procs()
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(pids, []int{child.Pid()}) {
			t.Errorf("cgroup.procs = %v; want only the child %d", pids, child.Pid())
		}
		info := child.Info()
		if info.Pid != child.Pid() || info.Cgroup != cg.Name {
			t.Errorf("child reports pid %d in cgroup %q; want %d in %q", info.Pid, info.Cgroup, child.Pid(), cg.Name)
		}
		var st unix.Stat_t
		if err := unix.Fstat(int(vm.NS.Handle()), &st); err != nil {
			t.Fatal(err)
		}
		if info.NetNS != st.Ino {
			t.Errorf("child is in netns inode %d; want the VM's %d", info.NetNS, st.Ino)
		}
		if again := child.Do(cgtest.Request{Op: cgtest.OpInfo}); !reflect.DeepEqual(again, info) {
			t.Errorf("info = %+v; at start %+v", again, info)
		}
		// The test process itself stays where it was.
		self, err := os.ReadFile("/proc/self/cgroup")
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(string(self), cg.Name) {
			t.Errorf("the test process is in the test cgroup: %s", self)
		}
	})
	if cg == nil || child == nil {
		t.Fatal("subtest did not get as far as starting the child")
	}
	if _, err := os.Stat(cg.Path); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("cgroup %s still there after cleanup (%v)", cg.Path, err)
	}
	if !child.Exited() {
		t.Errorf("child %d still running after cleanup", child.Pid())
	}
}

// TestCleanupKillsLeftovers puts a process the test does not stop into the
// cgroup: the cleanup must kill it and still remove the cgroup.
func TestCleanupKillsLeftovers(t *testing.T) {
	testenv.CgroupV2Root(t)
	var cg *cgtest.Cgroup
	exited := make(chan error, 1)
	t.Run("leave a sleeper", func(t *testing.T) {
		cg = cgtest.New(t)
		sub := cg.Path + "/sub"
		if err := os.Mkdir(sub, 0o755); err != nil {
			t.Fatal(err)
		}
		dir, err := os.Open(sub)
		if err != nil {
			t.Fatal(err)
		}
		defer dir.Close()
		cmd := execSleep()
		cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(dir.Fd()), Pdeathsig: syscall.SIGKILL}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		go func() { exited <- cmd.Wait() }()
		if busy, err := cg.Populated(); err != nil || !busy {
			t.Fatalf("Populated = %v, %v with a sleeper in a sub-cgroup", busy, err)
		}
	})
	select {
	case err := <-exited:
		if err == nil {
			t.Errorf("sleeper exited cleanly; want killed")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("sleeper still running after the cgroup's cleanup")
	}
	if _, err := os.Stat(cg.Path); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("cgroup %s still there after cleanup (%v)", cg.Path, err)
	}
}

// TestSockets has a child in VM 1's namespace talk to a server in VM 2's
// (the lab node routes between them) and checks what the child reports
// against what the server saw.
func TestSockets(t *testing.T) {
	cg := cgtest.New(t)
	l := lab.NewForTest(t)
	client := l.AddVMForTest(t, 1)
	server := l.AddVMForTest(t, 2)
	const port = 8080
	srv, err := server.Serve(port)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	child := cgtest.Start(t, cg, client.NS.Handle())

	mapped := func(a netip.Addr) netip.Addr { return netip.AddrFrom16(a.As16()) }
	for _, tc := range []struct {
		name     string
		dst, src netip.Addr // as the child's socket reports them
	}{
		{"ipv4", server.Addr4, client.Addr4},
		{"ipv6", server.Addr6, client.Addr6},
		{"ipv4-mapped", mapped(server.Addr4), mapped(client.Addr4)},
	} {
		dst := netip.AddrPortFrom(tc.dst, port).String()
		t.Run(tc.name+"/tcp", func(t *testing.T) {
			r := child.Do(cgtest.Request{Op: cgtest.OpTCP, Addr: dst, Send: "ping", Read: len("vm2\nping")})
			if err := r.Error(); err != nil {
				t.Fatal(err)
			}
			if r.Peer != dst || r.Data != "vm2\nping" {
				t.Errorf("peer %q data %q; want %q and the server's echo", r.Peer, r.Data, dst)
			}
			checkLocal(t, r.Local, tc.src, srv)
		})
		t.Run(tc.name+"/udp", func(t *testing.T) {
			r := child.UDP(dst, "q1")
			if err := r.Error(); err != nil {
				t.Fatal(err)
			}
			if r.From != dst || r.Peer != "" || r.Data != "vm2\nq1" {
				t.Errorf("from %q peer %q data %q; want the reply from %s, no peer", r.From, r.Peer, r.Data, dst)
			}
			// An unconnected socket stays bound to the wildcard address:
			// the port is what the server saw.
			ap, err := netip.ParseAddrPort(r.Local)
			if err != nil || !ap.Addr().IsUnspecified() || ap.Addr().Is4() != tc.src.Is4() {
				t.Errorf("local address %q (%v); want the wildcard of the socket's family", r.Local, err)
			}
			if seen := netip.AddrPortFrom(tc.src.Unmap(), ap.Port()); !slices.Contains(srv.Peers(), seen) {
				t.Errorf("server never saw %s (saw %v)", seen, srv.Peers())
			}
		})
		t.Run(tc.name+"/udp-connected", func(t *testing.T) {
			r := child.UDPConnected(dst, "c1")
			if err := r.Error(); err != nil {
				t.Fatal(err)
			}
			defer child.Close(r.Sock)
			if r.Sock == 0 || r.Peer != dst || r.From != dst || r.Data != "vm2\nc1" {
				t.Errorf("%+v; want a kept socket connected to %s and its reply", r, dst)
			}
			checkLocal(t, r.Local, tc.src, srv)
			again := child.Send(r.Sock, "c2")
			if err := again.Error(); err != nil {
				t.Fatal(err)
			}
			if again.Local != r.Local || again.Peer != dst || again.Data != "vm2\nc2" {
				t.Errorf("second exchange %+v; want the same socket %s -> %s", again, r.Local, dst)
			}
			pn := child.Do(cgtest.Request{Op: cgtest.OpGetpeername, Sock: r.Sock})
			if pn.Peer != dst || pn.Local != r.Local {
				t.Errorf("getpeername %+v; want %s", pn, dst)
			}
		})
	}

	t.Run("unconnected getpeername", func(t *testing.T) {
		r := child.Do(cgtest.Request{Op: cgtest.OpUDP, Addr: netip.AddrPortFrom(server.Addr4, port).String(), NoRecv: true, Keep: true})
		if err := r.Error(); err != nil {
			t.Fatal(err)
		}
		defer child.Close(r.Sock)
		pn := child.Do(cgtest.Request{Op: cgtest.OpGetpeername, Sock: r.Sock})
		if pn.Stage != "getpeername" || pn.Errno != "ENOTCONN" {
			t.Errorf("getpeername on an unconnected socket: %+v; want ENOTCONN", pn)
		}
	})
	t.Run("connect loop", func(t *testing.T) {
		v4, v6 := netip.AddrPortFrom(server.Addr4, port), netip.AddrPortFrom(server.Addr6, port)
		before := len(srv.Peers())
		r := child.Do(cgtest.Request{Op: cgtest.OpConnectLoop, Addrs: []string{v4.String(), v6.String()}, Count: 10})
		if err := r.Error(); err != nil {
			t.Fatal(err)
		}
		if len(r.ElapsedNS) != 2 || len(r.MedianNS) != 2 || r.MedianNS[0] <= 0 || r.MedianNS[1] <= 0 ||
			r.ElapsedNS[0] < 5*r.MedianNS[0]/2 || r.ElapsedNS[1] < 5*r.MedianNS[1]/2 {
			t.Errorf("%+v; want the time of 5 connections to each address", r)
		}
		// The server accepts in the background: wait for all ten.
		deadline := time.Now().Add(5 * time.Second)
		for len(srv.Peers()) < before+10 && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
		}
		if n := len(srv.Peers()) - before; n != 10 {
			t.Errorf("server saw %d connections; want 10", n)
		}
		for _, bad := range []cgtest.Request{
			{Op: cgtest.OpConnectLoop, Addrs: []string{v4.String()}},
			{Op: cgtest.OpConnectLoop, Count: 1},
			{Op: cgtest.OpConnectLoop, Addrs: []string{netip.AddrPortFrom(server.Addr4, port+1).String()}, Count: 1},
		} {
			if r := child.Do(bad); r.Error() == nil {
				t.Errorf("%+v: no error", bad)
			}
		}
	})
	t.Run("errors", func(t *testing.T) {
		r := child.TCP(netip.AddrPortFrom(server.Addr4, port+1).String(), "x")
		if r.Stage != "connect" || r.Errno != "ECONNREFUSED" {
			t.Errorf("TCP to a closed port: %+v; want connect ECONNREFUSED", r)
		}
		r = child.Do(cgtest.Request{Op: cgtest.OpSend, Sock: 999})
		if r.Stage != "sock" {
			t.Errorf("unknown socket: %+v", r)
		}
		r = child.Do(cgtest.Request{Op: "bogus"})
		if r.Stage != "op" {
			t.Errorf("unknown op: %+v", r)
		}
		// The child keeps serving after errors.
		if r := child.UDP(netip.AddrPortFrom(server.Addr4, port).String(), "still"); r.Data != "vm2\nstill" {
			t.Errorf("after errors: %+v", r)
		}
	})
}

// TestConnectedUDPBackendGone keeps a connected UDP socket across the
// removal of the server behind it: the next exchange reports the ICMP
// port unreachable as ECONNREFUSED on receive.
func TestConnectedUDPBackendGone(t *testing.T) {
	cg := cgtest.New(t)
	l := lab.NewForTest(t)
	client := l.AddVMForTest(t, 1)
	server := l.AddVMForTest(t, 2)
	child := cgtest.Start(t, cg, client.NS.Handle())
	for _, dst := range []netip.Addr{server.Addr4, server.Addr6} {
		t.Run(dst.String(), func(t *testing.T) {
			srv, err := server.Serve(9090)
			if err != nil {
				t.Fatal(err)
			}
			addr := netip.AddrPortFrom(dst, 9090).String()
			r := child.UDPConnected(addr, "one")
			if err := r.Error(); err != nil || r.Data != "vm2\none" {
				srv.Close()
				t.Fatalf("first exchange: %+v (%v)", r, err)
			}
			defer child.Close(r.Sock)
			srv.Close()
			gone := child.Do(cgtest.Request{Op: cgtest.OpSend, Sock: r.Sock, Send: "two", TimeoutMS: 1000})
			if gone.Stage != "recv" || gone.Errno != "ECONNREFUSED" || gone.Peer != addr {
				t.Errorf("after the server closed: %+v; want recv ECONNREFUSED on the socket still connected to %s", gone, addr)
			}
		})
	}
}

// checkLocal checks the child's local address: its IP is want and the
// server saw it (unmapped) as a client.
func checkLocal(t *testing.T, local string, want netip.Addr, srv *lab.Server) {
	t.Helper()
	ap, err := netip.ParseAddrPort(local)
	if err != nil {
		t.Fatalf("local address %q: %v", local, err)
	}
	if ap.Addr() != want {
		t.Errorf("local address %s; want IP %s", ap, want)
	}
	seen := netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
	if !slices.Contains(srv.Peers(), seen) {
		t.Errorf("server never saw %s (saw %v)", seen, srv.Peers())
	}
}
