// Package lab builds throwaway network topologies for end-to-end tests: a
// node namespace that runs the datapath and VM namespaces wired to it with
// veth pairs, dual-stack, all created by the test and removed with it.
//
// Addressing: VM i has 10.200.i.2/24 and fd00:200:i::2/64 on its "eth0";
// the node side of its veth, "vm<i>" in the node namespace, has .1 / ::1
// and is the VM's default gateway. The node forwards between VMs. Nothing
// is created, attached or sent in the root namespace.
//
// It needs Linux (network namespaces, veths, BPF); elsewhere the package is empty.
package lab
