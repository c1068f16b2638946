package bpf

import (
	"errors"
	"math"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
)

var tcxProbe = sync.OnceValue(func() bool {
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Type: ebpf.SchedCLS, License: "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 0), asm.Return()},
	})
	if err != nil {
		return false
	}
	defer prog.Close()
	// An interface that cannot exist: the kernel refuses it with ENODEV
	// where it has TCX links, and the library says ErrNotSupported where
	// it has none.
	l, err := link.AttachTCX(link.TCXOptions{Interface: math.MaxInt32, Program: prog, Attach: ebpf.AttachTCXIngress})
	if err == nil {
		l.Close()
		return true
	}
	return !errors.Is(err, ebpf.ErrNotSupported)
})

// HaveTCX reports whether the kernel attaches TC programs by TCX links
// (Linux 6.6): the attach mode an empty Options.AttachMode picks, and
// the one whose hooks GrowFlowMaps and CompactFlowMaps can switch to new
// programs. Probed once per process.
func HaveTCX() bool { return tcxProbe() }
