package api

import (
	"errors"
	"fmt"
	"net/http"
	"testing"

	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/ha"
)

// TestHAErrorCodes checks the classification of package ha's errors,
// wrapped as the dataplane wraps them, and that they win over the
// category of fluxvm they may also carry.
func TestHAErrorCodes(t *testing.T) {
	for _, tc := range []struct {
		err    error
		code   Code
		status int
	}{
		{ha.ErrResetRequired, CodeResetRequired, http.StatusConflict},
		{ha.ErrGap, CodeSequenceGap, http.StatusConflict},
		{ha.ErrStaleEpoch, CodeStaleEpoch, http.StatusConflict},
		{ha.ErrFenced, CodeFenced, http.StatusConflict},
		{ha.ErrCursorAhead, CodeCursorAhead, http.StatusConflict},
		{ha.ErrService, CodeServiceMismatch, http.StatusBadRequest},
		{ha.ErrSeeds, CodeSeedMismatch, http.StatusConflict},
		{ha.ErrFormat, CodeSnapshotUnreadable, http.StatusUnprocessableEntity},
		{ha.ErrCorrupt, CodeSnapshotCorrupt, http.StatusBadRequest},
		{ha.ErrTruncated, CodeSnapshotCorrupt, http.StatusBadRequest},
		{ha.ErrInvalidOp, CodeInvalidRequest, http.StatusBadRequest},
		{ha.ErrNoEpoch, CodeInvalidRequest, http.StatusBadRequest},
		{fluxvm.ErrPrerequisite, CodeMissingPrerequisite, http.StatusUnprocessableEntity},
		{fmt.Errorf("%w: %w", ha.ErrFenced, fluxvm.ErrConflict), CodeFenced, http.StatusConflict},
		{fluxvm.ErrClosed, CodeUnavailable, http.StatusServiceUnavailable},
		{&http.MaxBytesError{Limit: 10}, CodePayloadTooLarge, http.StatusRequestEntityTooLarge},
		{fmt.Errorf("%w (applied before it)", &http.MaxBytesError{Limit: 10}), CodePayloadTooLarge, http.StatusRequestEntityTooLarge},
	} {
		wrapped := fmt.Errorf("fluxvm: import flow delta of web: ha: cursor j1/3: %w", tc.err)
		e := toAPIError(wrapped)
		if e.code != tc.code || e.status != tc.status || e.code.Status() != tc.status {
			t.Errorf("%v: code %s status %d, want %s %d", tc.err, e.code, e.status, tc.code, tc.status)
		}
		if tc.code != CodePayloadTooLarge && tc.code != CodeUnavailable && e.message != wrapped.Error() {
			t.Errorf("%v: message %q, want the error's", tc.err, e.message)
		}
	}
}

func TestRepeatedKey(t *testing.T) {
	for _, tc := range []struct{ body, want string }{
		{`{"a":1,"b":2}`, ""},
		{`{"a":1,"a":2}`, "a"},
		{`{"a":{"b":1},"c":{"b":2}}`, ""},
		{`{"a":{"b":1,"b":2}}`, "a.b"},
		{`{"a":[{"x":1},{"x":1,"y":[1,{"z":1,"z":2}]}]}`, "a[1].y[1].z"},
		{`{"a":"b","b":"a"}`, ""},
		{`[{"k":1},{"k":2,"k":3}]`, "[1].k"},
		{`{"s":"a\"b","s":1}`, "s"},
		{`{"a":[],"b":{},"a":null}`, "a"},
		{`7`, ""},
	} {
		if got := repeatedKey([]byte(tc.body)); got != tc.want {
			t.Errorf("repeatedKey(%s) = %q, want %q", tc.body, got, tc.want)
		}
	}
}

// TestDecodeStrictTypeField checks that a value of the wrong type names
// its field.
func TestDecodeStrictTypeField(t *testing.T) {
	var l fluxvm.HALease
	err := decodeStrictNoRepeat([]byte(`{"epoch":"x"}`), &l)
	var ae *apiError
	if !errors.As(err, &ae) || ae.code != CodeInvalidRequest || ae.field != "epoch" {
		t.Errorf("error %v, want invalid_request on epoch", err)
	}
}
