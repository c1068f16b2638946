//go:build linux

package scenario

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/vishvananda/netns"

	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/internal/bpffs"
	"github.com/fluxvm/servicefabric/internal/daemonlog"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
	"github.com/fluxvm/servicefabric/internal/testutils/nsutil"
	"github.com/fluxvm/servicefabric/internal/testutils/restjson"
)

// daemonAPI is where the lab's fluxvmd listens, inside the node namespace
// (fluxvmd's default).
const daemonAPI = "127.0.0.1:7788"

// labDaemon is the real fluxvmd binary running in a lab's node namespace,
// with a pin root, catalog and advertisement snapshot of its own; the
// gates (RSS, RSSAffinity) measure it.
type labDaemon struct {
	cmd     *exec.Cmd
	out     *daemonlog.Output
	http    *http.Client
	token   string
	PinRoot string
	pinBase string
	tmp     string
	done    chan error
}

// startLabDaemon starts bin (fluxvmd) in l's node namespace at tier with
// the extra configuration lines conf, and waits until its API answers.
// Close stops it and removes its pins and files.
func startLabDaemon(ctx context.Context, bin string, l *lab.Lab, tier, conf string) (d *labDaemon, err error) {
	d = &labDaemon{out: daemonlog.New(), token: "fluxvm-lab-gate-" + nsutil.Suffix()}
	defer func() {
		if err != nil {
			err = errors.Join(err, d.Close())
			d = nil
		}
	}()
	if _, err := bpffs.Ensure(bpffs.DefaultRoot); err != nil {
		return d, err
	}
	d.pinBase = filepath.Join(bpffs.DefaultRoot, "fluxvm-lab-"+nsutil.Suffix())
	d.PinRoot = filepath.Join(d.pinBase, "service")
	if d.tmp, err = os.MkdirTemp("", "fluxvm-lab-gate-"); err != nil {
		return d, err
	}
	cfg := filepath.Join(d.tmp, "fluxvmd.toml")
	text := fmt.Sprintf("[sandbox.dataplane.service]\nmap_tier = %q\npin_root = %q\ncatalog_path = %q\nadvertisements_path = %q\n%s",
		tier, d.PinRoot, filepath.Join(d.tmp, "catalog.json"), filepath.Join(d.tmp, "service-advertisements.json"), conf)
	if err := os.WriteFile(cfg, []byte(text), 0o600); err != nil {
		return d, err
	}
	d.cmd = exec.Command(bin, "-config", cfg)
	d.cmd.Env = append(os.Environ(), "FLUXVM_ADMIN_TOKEN="+d.token)
	d.cmd.Stdout, d.cmd.Stderr = d.out, d.out
	// A process group of its own: a Ctrl-C reaches the lab, which stops
	// the daemon itself in order (SIGTERM, wait, remove the pins). If the
	// lab dies without that (SIGKILL), the kernel kills the daemon: its
	// parent-death signal.
	d.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	// The parent-death signal fires when the *thread* that started the
	// daemon exits, so the daemon is started from a thread of its own,
	// locked for good, that waits for it: it lives exactly as long as the
	// daemon (then the runtime discards it). The thread enters the node
	// namespace, so the daemon lives there but shares our mount namespace
	// and so the host's bpffs.
	started := make(chan error, 1)
	d.done = make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread ends with this goroutine
		if err := netns.Set(l.Node.Handle()); err != nil {
			started <- fmt.Errorf("enter netns %s: %w", l.Node.Name, err)
			return
		}
		if err := d.cmd.Start(); err != nil {
			started <- err
			return
		}
		started <- nil
		d.done <- d.cmd.Wait()
	}()
	if err := <-started; err != nil {
		d.cmd, d.done = nil, nil
		return d, fmt.Errorf("start %s: %w", bin, err)
	}
	d.http = &http.Client{Timeout: 5 * time.Minute, Transport: &http.Transport{DialContext: l.Node.DialContext}}
	select {
	case <-d.out.Serving():
	case err := <-d.done:
		d.done <- err
		return d, fmt.Errorf("fluxvmd exited (%v) before serving:\n%s", err, d.out.Tail(4000))
	case <-time.After(30 * time.Second):
		return d, fmt.Errorf("fluxvmd did not come up within 30s:\n%s", d.out.Tail(4000))
	case <-ctx.Done():
		return d, ctx.Err()
	}
	return d, nil
}

// request sends method path with body as JSON (nil: none) and decodes the
// answer into out (nil: discarded); a status of 300 or more is an error.
func (d *labDaemon) request(ctx context.Context, method, path string, body, out any) error {
	return restjson.Do(ctx, d.http, d.token, method, "http://"+daemonAPI+path, body, out)
}

// status is GET /v1/network/services/status.
func (d *labDaemon) status(ctx context.Context) (fluxvm.Status, error) {
	var st fluxvm.Status
	err := d.request(ctx, "GET", "/v1/network/services/status", nil, &st)
	return st, err
}

// procMemory is a process's resident memory from /proc/<pid>/status.
type procMemory struct {
	RSS, HWM uint64 // VmRSS and VmHWM (peak), bytes
}

// memory reads the daemon's VmRSS and VmHWM.
func (d *labDaemon) memory() (procMemory, error) {
	return readProcMemory(d.cmd.Process.Pid)
}

func readProcMemory(pid int) (procMemory, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return procMemory{}, err
	}
	defer f.Close()
	var m procMemory
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if !ok || (k != "VmRSS" && k != "VmHWM") {
			continue
		}
		kb, err := strconv.ParseUint(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
		if err != nil {
			return m, fmt.Errorf("/proc/%d/status %s: %w", pid, k, err)
		}
		if k == "VmRSS" {
			m.RSS = kb << 10
		} else {
			m.HWM = kb << 10
		}
	}
	if m.RSS == 0 {
		return m, fmt.Errorf("/proc/%d/status: no VmRSS", pid)
	}
	return m, sc.Err()
}

// Close stops the daemon (SIGTERM, 20 s, then SIGKILL) and removes its
// pins and files. A daemon that exited with an error is reported.
func (d *labDaemon) Close() error {
	var errs []error
	if d.cmd != nil && d.done != nil {
		d.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case err := <-d.done:
			if err != nil {
				errs = append(errs, fmt.Errorf("fluxvmd exited with %v:\n%s", err, d.out.Tail(4000)))
			}
		case <-time.After(20 * time.Second):
			d.cmd.Process.Kill()
			<-d.done
			errs = append(errs, fmt.Errorf("fluxvmd did not stop on SIGTERM within 20s"))
		}
		d.cmd = nil
	}
	if d.pinBase != "" {
		errs = append(errs, os.RemoveAll(d.pinBase))
		d.pinBase = ""
	}
	if d.tmp != "" {
		errs = append(errs, os.RemoveAll(d.tmp))
		d.tmp = ""
	}
	return errors.Join(errs...)
}

// MiB formats bytes in MiB.
func MiB(b uint64) string { return strconv.FormatFloat(float64(b)/(1<<20), 'f', 1, 64) }
