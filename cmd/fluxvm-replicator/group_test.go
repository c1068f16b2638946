package main

import (
	"slices"
	"testing"
)

// TestParseGroup: -group is NAME=URL, at least two, names unique.
func TestParseGroup(t *testing.T) {
	got, err := parseGroup("e1=http://10.0.0.1:7788/, e2=https://10.0.0.2:7788")
	want := []groupMember{{"e1", "http://10.0.0.1:7788"}, {"e2", "https://10.0.0.2:7788"}}
	if err != nil || !slices.Equal(got, want) {
		t.Fatalf("parseGroup = %v, %v; want %v", got, err, want)
	}
	for _, bad := range []string{"", "e1=http://a", "e1=http://a,e1=http://b", "e1=http://a,e2", "=http://a,e2=http://b", "e1=a,e2=http://b"} {
		if got, err := parseGroup(bad); err == nil {
			t.Errorf("parseGroup(%q) = %v, want an error", bad, got)
		}
	}
	for _, args := range [][]string{
		{"-group", "e1=http://a,e2=http://b", "-active", "http://a"},
		{"-active", "http://a"},
		{},
	} {
		if err := run(args); err == nil {
			t.Errorf("run(%q): no error", args)
		}
	}
}
