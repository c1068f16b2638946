package edt

import (
	"slices"
	"testing"
)

// TestFQInForce checks the mode detection on lists of qdiscs as the
// kernel reports them: fq holds the packets when the root is fq, or when
// the root is mq and every class of it has fq.
func TestFQInForce(t *testing.T) {
	root := uint32(handleRoot)
	h := func(maj, min uint32) uint32 { return maj<<16 | min }
	clsact := qdiscInfo{kind: "clsact", handle: h(0xffff, 0), parent: 0xfffffff1}
	for _, c := range []struct {
		name  string
		qs    []qdiscInfo
		root  string
		fq    bool
		other []string
	}{
		{name: "none"},
		{name: "noqueue", qs: []qdiscInfo{{kind: "noqueue", parent: root}, clsact}, root: "noqueue"},
		{name: "root fq", qs: []qdiscInfo{{kind: "fq", handle: h(0xf1d0, 0), parent: root}, clsact}, root: "fq", fq: true},
		{name: "default mq, default children", root: "mq", other: []string{"pfifo_fast"}, qs: []qdiscInfo{
			{kind: "mq", parent: root}, {kind: "pfifo_fast", parent: h(0, 1)}, {kind: "pfifo_fast", parent: h(0, 2)}, clsact}},
		{name: "default mq, default_qdisc=fq", root: "mq", fq: true, qs: []qdiscInfo{
			{kind: "mq", parent: root}, {kind: "fq", parent: h(0, 1)}, {kind: "fq", parent: h(0, 2)}, clsact}},
		{name: "our mq, fq children", root: "mq", fq: true, qs: []qdiscInfo{
			{kind: "mq", handle: h(0xf1d0, 0), parent: root}, {kind: "fq", handle: h(0x8001, 0), parent: h(0xf1d0, 1)},
			{kind: "fq", handle: h(0x8002, 0), parent: h(0xf1d0, 2)}, clsact}},
		{name: "mq, one class not fq", root: "mq", other: []string{"fq_codel"}, qs: []qdiscInfo{
			{kind: "mq", handle: h(1, 0), parent: root}, {kind: "fq", handle: h(0x8001, 0), parent: h(1, 1)},
			{kind: "fq_codel", parent: h(1, 2)}, {kind: "fq", parent: h(1, 3)}}},
		{name: "mq, no children listed", root: "mq", qs: []qdiscInfo{{kind: "mq", parent: root}, clsact}},
		{name: "fq below something else", root: "htb", qs: []qdiscInfo{
			{kind: "htb", handle: h(1, 0), parent: root}, {kind: "fq", handle: h(10, 0), parent: h(1, 10)}}},
	} {
		r, fq, other := fqInForce(c.qs)
		if r != c.root || fq != c.fq || !slices.Equal(other, c.other) {
			t.Errorf("%s: root %q fq %v other %v, want %q %v %v", c.name, r, fq, other, c.root, c.fq, c.other)
		}
	}
}
