//go:build linux

package cgtest_test

import "os/exec"

func execSleep() *exec.Cmd { return exec.Command("sleep", "60") }
