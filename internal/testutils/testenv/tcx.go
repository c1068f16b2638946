package testenv

import (
	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
)

// TCXProgramNames names the programs attached to TCX hook at of the
// interface ifindex in the calling thread's network namespace (call it
// inside InNetNS or NetNS.Do), first to last.
func TCXProgramNames(ifindex int, at ebpf.AttachType) ([]string, error) {
	res, err := link.QueryPrograms(link.QueryOptions{Target: ifindex, Attach: at})
	if err != nil {
		return nil, err
	}
	var names []string
	for _, p := range res.Programs {
		prog, err := ebpf.NewProgramFromID(p.ID)
		if err != nil {
			return nil, err
		}
		info, err := prog.Info()
		prog.Close()
		if err != nil {
			return nil, err
		}
		names = append(names, info.Name)
	}
	return names, nil
}
