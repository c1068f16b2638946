package main

import (
	"context"
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/fluxvm/servicefabric/fluxvm"
)

// TestParseConfigIPCacheFile: ipcache_file is a top-level key of the
// daemon's, an absolute path, empty by default.
func TestParseConfigIPCacheFile(t *testing.T) {
	if c := defaultConfig(); c.IPCacheFile != "" {
		t.Errorf("default ipcache_file %q", c.IPCacheFile)
	}
	c, err := parseConfig([]byte("[sandbox.dataplane.service]\nipcache_file = \"/etc/fluxvm/ipcache.json\"\n"))
	if err != nil || c.IPCacheFile != "/etc/fluxvm/ipcache.json" {
		t.Fatalf("%+v %v", c.IPCacheFile, err)
	}
	for _, tc := range []struct {
		doc  string
		kind error
	}{
		{"[sandbox.dataplane.service]\nipcache_file = \"ipcache.json\"\n", fluxvm.ErrInvalid},
		{"[sandbox.dataplane.service]\nipcache_file = 7\n", fluxvm.ErrMalformed},
		{"[sandbox.dataplane.service.api]\nipcache_file = \"/x\"\n", fluxvm.ErrMalformed}, // not a key of the api table
	} {
		_, err := parseConfig([]byte(tc.doc))
		var ve *fluxvm.ValidationError
		if !errors.As(err, &ve) || !strings.HasSuffix(ve.Field, "ipcache_file") || !errors.Is(err, tc.kind) {
			t.Errorf("%q: %v", tc.doc, err)
		}
	}
}

func writeFile(t *testing.T, dir, name, content string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestReadIPCacheFile: the file is decoded strictly, validated and
// bounded; every error names the file, and the field when there is one.
func TestReadIPCacheFile(t *testing.T) {
	dir := t.TempDir()
	good := writeFile(t, dir, "good.json", `{"entries": [
  {"prefix": "10.0.0.0/24", "identity": 1001},
  {"prefix": "2001:db8::/64", "identity": 1002},
  {"prefix": "10.0.0.7", "identity": 2001}
]}`)
	ipc, err := readIPCacheFile(good)
	if err != nil {
		t.Fatal(err)
	}
	want := fluxvm.IPCache{Entries: []fluxvm.IPCacheEntry{
		{Prefix: netip.MustParsePrefix("10.0.0.0/24"), Identity: 1001},
		{Prefix: netip.MustParsePrefix("2001:db8::/64"), Identity: 1002},
		{Prefix: netip.MustParsePrefix("10.0.0.7/32"), Identity: 2001},
	}}
	if !reflect.DeepEqual(ipc, want) {
		t.Errorf("got %+v", ipc)
	}
	if ipc, err := readIPCacheFile(writeFile(t, dir, "empty.json", `{"entries": []}`)); err != nil || len(ipc.Entries) != 0 {
		t.Errorf("empty ipcache: %+v %v", ipc, err)
	}

	for _, tc := range []struct {
		name, content string
		kind          error
		field         string
	}{
		{"host bits", `{"entries": [{"prefix": "10.0.0.0/24", "identity": 1}, {"prefix": "10.0.1.1/24", "identity": 2}]}`, fluxvm.ErrInvalid, "entries[1].prefix"},
		{"identity 0", `{"entries": [{"prefix": "10.0.0.0/24", "identity": 0}]}`, fluxvm.ErrInvalid, "entries[0].identity"},
		{"identity too large", `{"entries": [{"prefix": "10.0.0.0/24", "identity": 16777216}]}`, fluxvm.ErrInvalid, "entries[0].identity"},
		{"prefix twice", `{"entries": [{"prefix": "10.0.0.0/24", "identity": 1}, {"prefix": "10.0.0.0/24", "identity": 2}]}`, fluxvm.ErrConflict, "entries[1].prefix"},
		{"not a prefix", `{"entries": [{"prefix": "ten", "identity": 1}]}`, fluxvm.ErrMalformed, "entries[0].prefix"},
		{"unknown field", `{"entries": [], "version": 2}`, fluxvm.ErrMalformed, "version"},
		{"not JSON", `entries: []`, fluxvm.ErrMalformed, ""},
		{"trailing data", `{"entries": []} {}`, fluxvm.ErrMalformed, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := writeFile(t, dir, "bad.json", tc.content)
			_, err := readIPCacheFile(path)
			var ve *fluxvm.ValidationError
			if err == nil || !errors.Is(err, tc.kind) || !strings.Contains(err.Error(), path) {
				t.Fatalf("error %v, want %v naming %s", err, tc.kind, path)
			}
			if tc.field != "" && (!errors.As(err, &ve) || ve.Field != tc.field) {
				t.Errorf("error %v does not name the field %s", err, tc.field)
			}
		})
	}
	// Missing, a directory, too large.
	missing := filepath.Join(dir, "missing.json")
	if _, err := readIPCacheFile(missing); !errors.Is(err, os.ErrNotExist) || !strings.Contains(err.Error(), missing) {
		t.Errorf("missing file: %v", err)
	}
	if _, err := readIPCacheFile(dir); err == nil || !strings.Contains(err.Error(), "not a regular file") {
		t.Errorf("directory: %v", err)
	}
	big := writeFile(t, dir, "big.json", `{"entries": []}`+strings.Repeat(" ", MaxIPCacheFileBytes))
	if _, err := readIPCacheFile(big); !errors.Is(err, fluxvm.ErrTooLarge) || !strings.Contains(err.Error(), big) {
		t.Errorf("big file: %v", err)
	}
}

// TestIPCacheSource: the API's source reads the file again at each call.
func TestIPCacheSource(t *testing.T) {
	if ipcacheSource("") != nil {
		t.Error("a source without ipcache_file")
	}
	path := writeFile(t, t.TempDir(), "ipcache.json", `{"entries": [{"prefix": "10.0.0.0/24", "identity": 1001}]}`)
	src := ipcacheSource(path)
	ipc, err := src(context.Background())
	if err != nil || len(ipc.Entries) != 1 || ipc.Entries[0].Identity != 1001 {
		t.Fatalf("%+v %v", ipc, err)
	}
	writeFile(t, filepath.Dir(path), "ipcache.json", `{"entries": [{"prefix": "10.0.0.0/24", "identity": 1002}]}`)
	if ipc, err := src(context.Background()); err != nil || ipc.Entries[0].Identity != 1002 {
		t.Errorf("after the edit: %+v %v", ipc, err)
	}
}

// TestCheckConfigIPCacheFile: check-config reads the ipcache file as the
// start does, and a bad one fails naming the file and the field.
func TestCheckConfigIPCacheFile(t *testing.T) {
	dir := t.TempDir()
	ipc := writeFile(t, dir, "ipcache.json", `{"entries": [{"prefix": "10.0.0.1/24", "identity": 1001}]}`)
	cfg := writeFile(t, dir, "fluxvmd.toml", "[sandbox.dataplane.service]\nipcache_file = \""+ipc+"\"\n")
	err := run(context.Background(), []string{"-config", cfg, "check-config"})
	if err == nil || !strings.Contains(err.Error(), ipc) || !strings.Contains(err.Error(), "entries[0].prefix") {
		t.Errorf("bad ipcache file: %v", err)
	}
	// The start fails the same way, before the dataplane is opened.
	t.Setenv(EnvAdminToken, "admin-token-for-the-test")
	err = run(context.Background(), []string{"-config", cfg, "run"})
	if err == nil || !strings.Contains(err.Error(), "ipcache_file "+ipc) || !strings.Contains(err.Error(), "entries[0].prefix") {
		t.Errorf("start with a bad ipcache file: %v", err)
	}
	writeFile(t, dir, "ipcache.json", `{"entries": [{"prefix": "10.0.0.0/24", "identity": 1001}]}`)
	if err := run(context.Background(), []string{"-config", cfg, "check-config"}); err != nil {
		t.Errorf("good ipcache file: %v", err)
	}
}
