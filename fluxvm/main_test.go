package fluxvm

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"testing"

	"github.com/fluxvm/servicefabric/bpf"
)

// childEnv makes the test binary a child process that the tests start
// under `ip netns exec` (a private /sys: the host's BPF filesystem
// hidden): its value is a childJob in JSON.
const childEnv = "FLUXVM_TEST_FLUXVM_CHILD"

// childJob is what such a child does: "cleanup" runs Cleanup on PinRoot,
// CatalogPath and Advertisements (in the child's network namespace);
// "open" runs Open with Loader (logging to stdout) and prints
// the log, then closes.
type childJob struct {
	Do                                   string
	PinRoot, CatalogPath, Advertisements string
	Loader                               bpf.Options
}

func TestMain(m *testing.M) {
	if job := os.Getenv(childEnv); job != "" {
		os.Exit(childMain(job))
	}
	os.Exit(m.Run())
}

// childMain runs the job and prints what happened; it exits 0 when the
// job ran (whatever its result: the parent judges it), 2 on a bad job.
func childMain(job string) int {
	var j childJob
	if err := json.Unmarshal([]byte(job), &j); err != nil {
		fmt.Println("bad job:", err)
		return 2
	}
	switch j.Do {
	case "cleanup":
		err := Cleanup(context.Background(), CleanupOptions{PinRoot: j.PinRoot, CatalogPath: j.CatalogPath, AdvertisementsPath: j.Advertisements})
		fmt.Printf("cleanup: %v\n", err)
	case "open":
		d, err := Open(context.Background(), Options{Loader: j.Loader, ConntrackGCInterval: -1, Logger: slog.New(slog.NewTextHandler(os.Stdout, nil))})
		if err != nil {
			fmt.Printf("open: %v\n", err)
			return 0
		}
		fmt.Printf("open: ok\n")
		d.Close()
	default:
		fmt.Println("bad job:", j.Do)
		return 2
	}
	return 0
}
