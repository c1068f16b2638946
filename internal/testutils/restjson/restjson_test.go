package restjson

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

func TestDo(t *testing.T) {
	// The server echoes what it got: method, token, content type, body.
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		if r.URL.Path == "/fail" {
			http.Error(w, `{"error":"bad"}`, http.StatusConflict)
			return
		}
		if len(b) == 0 {
			b = []byte("null")
		}
		json.NewEncoder(w).Encode(map[string]any{
			"method": r.Method, "auth": r.Header.Get("Authorization"), "type": r.Header.Get("Content-Type"), "body": json.RawMessage(b),
		})
	}))
	defer srv.Close()
	type echo struct {
		Method, Auth, Type string
		Body               any
	}
	for _, tc := range []struct {
		name, method, path string
		body               any
		want               echo
		wantErr            string
	}{
		{name: "get", method: "GET", path: "/x", want: echo{Method: "GET", Auth: "Bearer tok", Body: nil}},
		{name: "post", method: "POST", path: "/x", body: map[string]int{"a": 1},
			want: echo{Method: "POST", Auth: "Bearer tok", Type: "application/json", Body: map[string]any{"a": float64(1)}}},
		{name: "status", method: "POST", path: "/fail", body: 1, wantErr: `409 Conflict: {"error":"bad"}`},
		{name: "unencodable", method: "POST", path: "/x", body: func() {}, wantErr: "unsupported type"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var got echo
			err := Do(context.Background(), srv.Client(), "tok", tc.method, srv.URL+tc.path, tc.body, &got)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err %v, want %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got.Method != tc.want.Method || got.Auth != tc.want.Auth || got.Type != tc.want.Type || !sameJSON(got.Body, tc.want.Body) {
				t.Fatalf("server got %+v, want %+v", got, tc.want)
			}
		})
	}
}

func sameJSON(a, b any) bool {
	am, aok := a.(map[string]any)
	bm, bok := b.(map[string]any)
	if aok != bok {
		return false
	}
	if !aok {
		return a == b
	}
	if len(am) != len(bm) {
		return false
	}
	for k, v := range am {
		if bm[k] != v {
			return false
		}
	}
	return true
}
