package testenv

import (
	"fmt"
	"strings"
	"testing"
)

// recorder stands in for a *testing.T so the gate's decision can be seen
// without ending the real test.
type recorder struct {
	testing.TB
	skipped, failed string
}

func (r *recorder) Helper()                      {}
func (r *recorder) Skipf(f string, args ...any)  { r.skipped = fmt.Sprintf(f, args...) }
func (r *recorder) Fatalf(f string, args ...any) { r.failed = fmt.Sprintf(f, args...) }

func TestGate(t *testing.T) {
	tests := []struct {
		name              string
		problem, required string
		wantSkip, wantErr bool
	}{
		{"privileged", "", "", false, false},
		{"privileged and required", "", "1", false, false},
		{"unprivileged skips", "process lacks CAP_BPF", "", true, false},
		{"unprivileged fails when required", "process lacks CAP_BPF", "1", false, true},
		{"only 1 means required", "process lacks CAP_BPF", "true", true, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Setenv(RequireEnv, tt.required)
			r := &recorder{TB: t}
			gate(r, tt.problem)
			if (r.skipped != "") != tt.wantSkip || (r.failed != "") != tt.wantErr {
				t.Fatalf("skipped=%q failed=%q; want skip=%v fail=%v", r.skipped, r.failed, tt.wantSkip, tt.wantErr)
			}
			for _, msg := range []string{r.skipped, r.failed} {
				if msg != "" && (!strings.Contains(msg, tt.problem) || !strings.Contains(msg, RequireEnv)) {
					t.Errorf("message %q should name the problem and %s", msg, RequireEnv)
				}
			}
		})
	}
}
