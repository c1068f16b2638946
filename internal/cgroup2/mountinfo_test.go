package cgroup2

import (
	"errors"
	"strings"
	"testing"
)

// thisHost is the cgroup part of the mount table of the machine the
// package was written on (Linux 6.18): cgroup v1 controllers on a tmpfs at
// /sys/fs/cgroup and the unified hierarchy at /sys/fs/cgroup/unified.
const thisHost = `21 26 0:20 / /proc rw,relatime - proc proc rw
22 26 0:21 / /sys rw,relatime - sysfs sysfs rw
26 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard,resv_strict,resuid=65534,resgid=65534
30 22 0:27 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
31 30 0:28 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
32 30 0:29 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
34 30 0:31 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 30 0:36 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
40 30 0:37 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
44 22 0:39 / /sys/fs/bpf rw,relatime - bpf bpffs rw,mode=700
45 26 254:0 /run/netns /run/netns rw,relatime shared:1 - ext4 /dev/vda rw,discard,resv_strict,resuid=65534,resgid=65534
`

// v1Only is thisHost without its cgroup2 line.
var v1Only = strings.Replace(thisHost, "40 30 0:37 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n", "", 1)

func TestFindRoot(t *testing.T) {
	tests := []struct {
		name    string
		info    string
		want    string
		wantErr error
		errHas  []string
	}{
		{name: "this host: hybrid v1 + unified", info: thisHost, want: "/sys/fs/cgroup/unified"},
		{
			name: "systemd unified with optional fields",
			info: "35 24 0:30 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot\n",
			want: "/sys/fs/cgroup",
		},
		{
			name: "several optional fields",
			info: "35 24 0:30 / /sys/fs/cgroup rw shared:9 master:2 propagate_from:1 unbindable - cgroup2 none rw\n",
			want: "/sys/fs/cgroup",
		},
		{
			name: "no optional fields and no super options",
			info: "35 24 0:30 / /cg rw - cgroup2 cgroup2\n",
			want: "/cg",
		},
		{
			name: "octal escapes in the mount point",
			info: `35 24 0:30 / /mnt/my\040cgroup\011tab\134back rw - cgroup2 cgroup2 rw` + "\n",
			want: "/mnt/my cgroup\ttab\\back",
		},
		{
			name: "a mount of a subtree is second choice to the whole hierarchy",
			info: "50 24 0:30 /kubepods /run/sub rw - cgroup2 cgroup2 rw\n51 24 0:30 / /run/whole rw - cgroup2 cgroup2 rw\n",
			want: "/run/whole",
		},
		{
			name: "only a subtree is mounted",
			info: `50 24 0:30 /kubepods/pod\0401 /run/sub rw - cgroup2 cgroup2 rw` + "\n",
			want: "/run/sub",
		},
		{
			name: "a device named cgroup2 on another filesystem does not count",
			info: "50 24 0:30 / /data rw - ext4 cgroup2 rw\n51 24 0:31 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
			want: "/sys/fs/cgroup",
		},
		{
			name:    "v1 only names the v1 mounts",
			info:    v1Only,
			wantErr: ErrNoCgroupV2,
			errHas:  []string{"cgroup v2 is required", "cgroup v1 only", "/sys/fs/cgroup/cpu,", "/sys/fs/cgroup/systemd"},
		},
		{
			name:    "no cgroups at all",
			info:    "26 1 254:0 / / rw - ext4 /dev/vda rw\n",
			wantErr: ErrNoCgroupV2,
			errHas:  []string{"cgroup v2 is required", "no cgroup filesystem"},
		},
		{name: "empty table", info: "", wantErr: ErrNoCgroupV2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ms, err := parseMountInfo(strings.NewReader(tt.info))
			if err != nil {
				t.Fatal(err)
			}
			got, err := findRoot(ms)
			if tt.wantErr != nil {
				if !errors.Is(err, tt.wantErr) {
					t.Fatalf("findRoot = %q, %v; want error %v", got, err, tt.wantErr)
				}
				for _, s := range tt.errHas {
					if !strings.Contains(err.Error(), s) {
						t.Errorf("error %q does not say %q", err, s)
					}
				}
				return
			}
			if err != nil || got != tt.want {
				t.Fatalf("findRoot = %q, %v; want %q", got, err, tt.want)
			}
		})
	}
}

func TestParseMountInfo(t *testing.T) {
	ms, err := parseMountInfo(strings.NewReader(thisHost))
	if err != nil {
		t.Fatal(err)
	}
	if len(ms) != 11 {
		t.Fatalf("parsed %d mounts, want 11", len(ms))
	}
	want := map[int]mount{
		4:  {root: "/", mountPoint: "/sys/fs/cgroup/cpu", fsType: "cgroup", superOpts: "rw,cpu"},
		8:  {root: "/", mountPoint: "/sys/fs/cgroup/unified", fsType: "cgroup2", superOpts: "rw"},
		10: {root: "/run/netns", mountPoint: "/run/netns", fsType: "ext4", superOpts: "rw,discard,resv_strict,resuid=65534,resgid=65534"},
	}
	for i, w := range want {
		if ms[i] != w {
			t.Errorf("mount %d = %+v; want %+v", i, ms[i], w)
		}
	}
}

func TestParseMountInfoMalformed(t *testing.T) {
	for _, line := range []string{
		"35 24 0:30 / /cg rw cgroup2 cgroup2 rw", // no separator
		"35 24 0:30 / /cg rw -",                  // nothing after it
		"35 24 0:30 / /cg rw - cgroup2",          // no source
		"35 24 - cgroup2 cgroup2 rw",             // separator among the fixed fields
	} {
		if ms, err := parseMountInfo(strings.NewReader(line + "\n")); err == nil {
			t.Errorf("parseMountInfo(%q) = %+v; want an error", line, ms)
		}
	}
}

func TestUnescape(t *testing.T) {
	for in, want := range map[string]string{
		`/plain`:         "/plain",
		`/a\040b`:        "/a b",
		`/nl\012`:        "/nl\n",
		`/back\134slash`: `/back\slash`,
		`/short\04`:      `/short\04`,
		`/notoctal\089`:  `/notoctal\089`,
		`\040\040`:       "  ",
		`/trailing\`:     `/trailing\`,
	} {
		if got := unescape(in); got != want {
			t.Errorf("unescape(%q) = %q; want %q", in, got, want)
		}
	}
}
