package fluxvm

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"testing"

	"github.com/fluxvm/servicefabric/advert"
)

// TestUnopenedDataplane calls every exported method of Dataplane (and of
// the HA it returns, and of the zero HA), found by
// reflection, on a nil *Dataplane and on a zero Dataplane{} (one that Open
// did not make): none panics; each that returns an error fails with one
// matching ErrClosed and zero other results; the read-only ones without
// an error answer as documented (empty). A method added to Dataplane is
// called too; one without an error result fails the test until a row
// below says what it answers.
func TestUnopenedDataplane(t *testing.T) {
	readOnly := map[string]func(res any) string{
		"Status": func(res any) string {
			if st := res.(Status); !reflect.ValueOf(st).IsZero() {
				return fmt.Sprintf("%+v, want the zero Status", st)
			}
			return ""
		},
		"Services": func(res any) string {
			if ss := res.([]ServiceStatus); ss == nil || len(ss) != 0 {
				return fmt.Sprintf("%#v, want an empty list", ss)
			}
			return ""
		},
		"Health": func(res any) string {
			if h := res.(HealthReport); h.Services == nil || len(h.Services) != 0 {
				return fmt.Sprintf("%#v, want no services", h)
			}
			return ""
		},
		"Advertisements": func(res any) string {
			s := res.(advert.Snapshot)
			if s.Generation != 0 || s.Entries == nil || len(s.Entries) != 0 || s.SchemaVersion != advert.SchemaVersion {
				return fmt.Sprintf("%+v, want generation 0 and no entries", s)
			}
			return ""
		},
		"HAStatus": func(res any) string {
			if st := res.(HAStatus); !reflect.ValueOf(st).IsZero() {
				return fmt.Sprintf("%+v, want the zero HAStatus", st)
			}
			return ""
		},
	}
	// HA's calls: on the HA of such a Dataplane, and on the zero HA.
	haReadOnly := map[string]func(res any) string{"Status": readOnly["HAStatus"]}
	readOnly["HA"] = func(res any) string {
		if h := res.(HA); h.d != nil && !h.d.unopened() {
			return fmt.Sprintf("%+v, want the HA of an unopened Dataplane", h)
		}
		return ""
	}
	for _, c := range []struct {
		name string
		d    *Dataplane
	}{{"nil", nil}, {"zero", &Dataplane{}}} {
		t.Run(c.name, func(t *testing.T) {
			callEvery(t, reflect.ValueOf(c.d), c.name+" Dataplane", readOnly)
			callEvery(t, reflect.ValueOf(c.d.HA()), "HA of a "+c.name+" Dataplane", haReadOnly)
		})
	}
	t.Run("zero HA", func(t *testing.T) { callEvery(t, reflect.ValueOf(HA{}), "zero HA", haReadOnly) })
}

// callEvery calls every exported method of recv with zero arguments (a
// live context for a context): none may panic; each that returns an error
// fails with one matching ErrClosed and zero other results; the others
// answer what readOnly says.
func callEvery(t *testing.T, recv reflect.Value, what string, readOnly map[string]func(res any) string) {
	t.Helper()
	ctxType := reflect.TypeFor[context.Context]()
	errType := reflect.TypeFor[error]()
	typ := recv.Type()
	for i := range typ.NumMethod() {
		m := typ.Method(i)
		args := []reflect.Value{recv}
		nin := m.Type.NumIn()
		if m.Type.IsVariadic() {
			nin-- // no variadic arguments
		}
		for j := 1; j < nin; j++ {
			if in := m.Type.In(j); in == ctxType {
				args = append(args, reflect.ValueOf(context.Background()))
			} else {
				args = append(args, reflect.Zero(in))
			}
		}
		out, panicked := func() (out []reflect.Value, panicked any) {
			defer func() { panicked = recover() }()
			return m.Func.Call(args), nil
		}()
		if panicked != nil {
			t.Errorf("%s on a %s panicked: %v", m.Name, what, panicked)
			continue
		}
		if n := m.Type.NumOut(); n > 0 && m.Type.Out(n-1) == errType {
			err, _ := out[n-1].Interface().(error)
			if !errors.Is(err, ErrClosed) {
				t.Errorf("%s on a %s: %v, want ErrClosed", m.Name, what, err)
			}
			for k, v := range out[:n-1] {
				if !v.IsZero() {
					t.Errorf("%s on a %s: result %d is %v, want the zero value", m.Name, what, k, v)
				}
			}
			continue
		}
		check := readOnly[m.Name]
		if check == nil {
			t.Errorf("%s (%s) returns no error: add a row to this test saying what it answers on a Dataplane that Open did not make", m.Name, what)
			continue
		}
		if why := check(out[0].Interface()); why != "" {
			t.Errorf("%s on a %s: %s", m.Name, what, why)
		}
	}
}
