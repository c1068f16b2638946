package main

import (
	"context"
	"fmt"
	"os"

	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/fluxvm/api"
	"github.com/fluxvm/servicefabric/intent"
)

// MaxIPCacheFileBytes bounds the ipcache file (ipcache_file). A full
// ipcache, 65,536 prefixes of each family, is about 8 MiB of compact JSON;
// the bound leaves room for indentation.
const MaxIPCacheFileBytes = 16 << 20

// readIPCacheFile reads and validates the ipcache document at path (the
// format of intent.IPCache: {"entries": [{"prefix": "10.0.0.0/24",
// "identity": 1001}, ...]}), decoded strictly and bounded by
// MaxIPCacheFileBytes. Its errors name the file and, for a bad document,
// the field ("entries[3].prefix").
func readIPCacheFile(path string) (fluxvm.IPCache, error) {
	f, err := os.Open(path)
	if err != nil {
		return fluxvm.IPCache{}, fmt.Errorf("ipcache_file: %w", err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return fluxvm.IPCache{}, fmt.Errorf("ipcache_file: %w", err)
	}
	if !fi.Mode().IsRegular() {
		return fluxvm.IPCache{}, fmt.Errorf("ipcache_file %s: not a regular file", path)
	}
	ipc, err := intent.DecodeIPCache(f, MaxIPCacheFileBytes)
	if err == nil {
		err = intent.ValidateIPCache(ipc)
	}
	if err != nil {
		return fluxvm.IPCache{}, fmt.Errorf("ipcache_file %s: %w", path, err)
	}
	return ipc, nil
}

// ipcacheSource is the REST API's ipcache source (POST
// /v1/network/services/policies/reconcile): the file read again, or nil
// without ipcache_file.
func ipcacheSource(path string) api.IPCacheSource {
	if path == "" {
		return nil
	}
	return func(context.Context) (fluxvm.IPCache, error) { return readIPCacheFile(path) }
}
