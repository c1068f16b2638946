// Package ha hands a north-south edge's flow state to a standby edge, so
// that connections survive a failover: full snapshots of a service's flows
// and sequenced deltas between them (ha.Journal), fenced by the lease
// epoch the control plane gives the active edge. A snapshot alone also
// moves a service's flows to another node once (a planned move), from a
// source that holds no lease and keeps no journal: its header then
// carries epoch 0 and no journal cursor, older than any lease: a target
// holding one refuses it (Target.Accept, as package fluxvm sets it).
// Every snapshot also names the seeds of the edge that wrote it
// (Header.Seeds, format 2): an edge of other seeds would send the same new
// flow to other backends, and refuses it before anything else
// (Target.Seeds, ErrSeeds). Deltas carry no seeds: they only continue a
// cursor a snapshot set, and an edge's seeds change only when it restarts,
// which resets its cursors.
//
// What travels is a service's flows as any node can apply them (Flow):
// the conntrack entry (fluxvm_fct4/6) and its reverse-NAT half
// (fluxvm_nat4/6), with every node-local id replaced by what names it on
// every node (the frontend by VIP, port and protocol; the backend by
// address and port) and every time by an age (each node's monotonic clock
// is its own). Only these maps are replicated; flows handed to an L7 proxy
// are not (the proxy's own connection state stays on its node). The
// datapath's mutation queue and the journals carry the north-south kinds
// (SNAT, DSR): east-west flows belong to the node's own VMs, which no
// standby edge serves. A snapshot carries them too, for a node that
// reloads its own flows; a snapshot-diff never deletes them.
//
// Replicator does the control plane's part for one active and one
// standby: deltas after the standby's cursor, acks, and a snapshot when
// the deltas cannot continue it.
//
// The format is versioned and self-describing (Snapshot), streamed in
// checksummed chunks so that exporting or importing a million flows runs
// in bounded memory and a truncated or corrupted stream is refused at the
// chunk it breaks in.
package ha
