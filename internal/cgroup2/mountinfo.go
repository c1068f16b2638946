package cgroup2

import (
	"bufio"
	"fmt"
	"io"
	"strings"
)

// mount is the part of one /proc/<pid>/mountinfo line this package needs.
type mount struct {
	root       string // path of the mount's root within its filesystem
	mountPoint string // where it is mounted, relative to the process's root
	fsType     string
	superOpts  string // per-superblock options, e.g. "rw,cpu" for cgroup v1
}

// parseMountInfo parses the format described in proc(5):
//
//	36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue
//	(1)(2)(3)   (4)   (5)      (6)      (7)   (8) (9)   (10)         (11)
//
// Field 7 is zero or more optional fields ended by a lone "-". Paths
// carry octal escapes (\040 for a space and so on).
func parseMountInfo(r io.Reader) ([]mount, error) {
	var ms []mount
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64*1024), 1024*1024)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		if strings.TrimSpace(line) == "" {
			continue
		}
		f := strings.Fields(line)
		sep := -1
		for i := 6; i < len(f); i++ {
			if f[i] == "-" {
				sep = i
				break
			}
		}
		if len(f) < 6 || sep < 0 || len(f) < sep+3 {
			return nil, fmt.Errorf("cgroup2: mountinfo line %d: malformed: %q", n, line)
		}
		m := mount{
			root:       unescape(f[3]),
			mountPoint: unescape(f[4]),
			fsType:     f[sep+1],
		}
		if len(f) > sep+3 {
			m.superOpts = f[sep+3]
		}
		ms = append(ms, m)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("cgroup2: reading mountinfo: %w", err)
	}
	return ms, nil
}

// unescape undoes the kernel's octal escapes (\040 space, \011 tab, \012
// newline, \134 backslash) in a mountinfo path. Anything else is kept as
// it is.
func unescape(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) && isOctal(s[i+1]) && isOctal(s[i+2]) && isOctal(s[i+3]) {
			b.WriteByte((s[i+1]-'0')<<6 | (s[i+2]-'0')<<3 | (s[i+3] - '0'))
			i += 3
			continue
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

func isOctal(c byte) bool { return c >= '0' && c <= '7' }

// findRoot picks the cgroup v2 mount from a mount table: the first whose
// root is "/" (the whole hierarchy), else the first cgroup2 mount at all.
func findRoot(ms []mount) (string, error) {
	var first string
	var v1 []string
	for _, m := range ms {
		switch m.fsType {
		case "cgroup2":
			if m.root == "/" {
				return m.mountPoint, nil
			}
			if first == "" {
				first = m.mountPoint
			}
		case "cgroup":
			v1 = append(v1, m.mountPoint)
		}
	}
	if first != "" {
		return first, nil
	}
	if len(v1) > 0 {
		return "", fmt.Errorf("cgroup2: %w: cgroup v1 only: %s mounted", ErrNoCgroupV2, strings.Join(v1, ", "))
	}
	return "", fmt.Errorf("cgroup2: %w: no cgroup filesystem is mounted", ErrNoCgroupV2)
}
