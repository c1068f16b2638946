package bpf

import (
	"bytes"
	"crypto/rand"
	"fmt"
	"io"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/internal/testutils/lab"
)

// TestRealSocketsThroughVIP sends real TCP streams and UDP datagrams from a
// client VM namespace through the VIP to a backend VM namespace, with the
// programs attached by TCX on the node side of both VM edges.
//
// Every veth verifies checksums in software on receive, and the node sides
// complete CHECKSUM_PARTIAL packets in software on transmit, so a wrong
// checksum from either rewrite path is a lost packet here. The client and
// backend run once with transmit offload on (the kernel hands the datapath
// CHECKSUM_PARTIAL packets, as a guest with offloads does) and once with it
// off (full checksums, CHECKSUM_NONE).
func TestRealSocketsThroughVIP(t *testing.T) {
	for _, offload := range []bool{true, false} {
		t.Run(fmt.Sprintf("guest_tx_offload=%v", offload), func(t *testing.T) {
			h := newHarness(t)
			node := lab.NewForTest(t)
			cli, srv := node.AddVMForTest(t, 1), node.AddVMForTest(t, 2)
			for _, vm := range []*lab.VM{cli, srv} {
				h.must(lab.SetChecksumOffload(node.Node, vm.NodeIf, false, false))
				h.must(lab.SetChecksumOffload(vm.NS, "eth0", offload, false))
				h.attachEdges(t, node, vm)
			}

			vip4 := netip.MustParseAddrPort("10.96.0.10:80")
			vip6 := netip.MustParseAddrPort("[fd00:96::10]:80")
			h.service(1, vip4, ipTCP)
			h.service(2, vip4, ipUDP)
			h.service(3, vip6, ipTCP)
			h.service(4, vip6, ipUDP)
			for sid, be := range map[uint32]netip.AddrPort{
				1: netip.AddrPortFrom(srv.Addr4, 8080), 2: netip.AddrPortFrom(srv.Addr4, 8080),
				3: netip.AddrPortFrom(srv.Addr6, 8080), 4: netip.AddrPortFrom(srv.Addr6, 8080),
			} {
				h.backend(sid*10, sid, be, BackendReady, 0)
				h.table(sid, h.fill(sid*10))
			}

			var ln net.Listener
			var pc net.PacketConn
			h.must(srv.NS.Do(func() (err error) {
				if ln, err = net.Listen("tcp", ":8080"); err != nil {
					return err
				}
				pc, err = net.ListenPacket("udp", ":8080")
				return err
			}))
			t.Cleanup(func() { ln.Close(); pc.Close() })
			go func() {
				for {
					c, err := ln.Accept()
					if err != nil {
						return
					}
					go func() { defer c.Close(); io.Copy(c, c) }()
				}
			}()
			go func() {
				buf := make([]byte, 2048)
				for {
					n, from, err := pc.ReadFrom(buf)
					if err != nil {
						return
					}
					pc.WriteTo(buf[:n], from)
				}
			}()

			for _, vip := range []netip.AddrPort{vip4, vip6} {
				t.Run("tcp_"+vip.String(), func(t *testing.T) {
					var c net.Conn
					h.must(cli.NS.Do(func() (err error) {
						c, err = net.DialTimeout("tcp", vip.String(), 3*time.Second)
						return err
					}))
					defer c.Close()
					c.SetDeadline(time.Now().Add(10 * time.Second))
					if got := c.RemoteAddr().(*net.TCPAddr).AddrPort(); netip.AddrPortFrom(got.Addr().Unmap(), got.Port()) != vip {
						t.Errorf("connected to %s, want the VIP %s", got, vip)
					}
					data := make([]byte, 512<<10)
					rand.Read(data)
					go c.Write(data)
					got := make([]byte, len(data))
					if _, err := io.ReadFull(c, got); err != nil {
						t.Fatalf("echo through the VIP: %v", err)
					}
					if !bytes.Equal(got, data) {
						t.Fatal("echo differs")
					}
				})
				t.Run("udp_"+vip.String(), func(t *testing.T) {
					var c net.Conn
					h.must(cli.NS.Do(func() (err error) {
						c, err = net.Dial("udp", vip.String())
						return err
					}))
					defer c.Close()
					for i := range 20 {
						msg := []byte(fmt.Sprintf("datagram %d", i))
						c.SetDeadline(time.Now().Add(2 * time.Second))
						if _, err := c.Write(msg); err != nil {
							t.Fatal(err)
						}
						buf := make([]byte, 64)
						n, err := c.Read(buf)
						if err != nil {
							t.Fatalf("datagram %d: %v", i, err)
						}
						if !bytes.Equal(buf[:n], msg) {
							t.Fatalf("datagram %d: got %q", i, buf[:n])
						}
					}
				})
			}
			for sid := uint32(1); sid <= 4; sid++ {
				st := h.stats(sid)
				if st.Packets == 0 || st.ReplyPackets == 0 || st.NewFlows == 0 {
					t.Errorf("service %d stats %+v: traffic did not pass the datapath", sid, st)
				}
			}
		})
	}
}
