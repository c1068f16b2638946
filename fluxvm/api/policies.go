package api

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"

	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/intent"
)

// IPCacheSource returns the node's ipcache as its owner keeps it (the
// reference daemon: the file named by ipcache_file, read again on every
// call). POST /v1/network/services/policies/reconcile calls it and applies
// what it returns (PolicyStore.SetIPCache) before answering.
type IPCacheSource func(ctx context.Context) (fluxvm.IPCache, error)

// policyReconcileRequest is the body of POST
// /v1/network/services/policies/reconcile: empty or "{}" today.
type policyReconcileRequest struct{}

// listPolicies answers GET /v1/network/services/policies.
func (h *handler) listPolicies(w http.ResponseWriter, r *http.Request) error {
	st, err := h.roles.Policies.Policies(r.Context())
	if err != nil {
		return err
	}
	h.writeJSON(w, r, http.StatusOK, policiesStatus(st))
	return nil
}

// applyPolicies answers POST /v1/network/services/policies: the body is
// one policy object or a JSON array of them, applied as one reconcile
// (PolicyStore.ApplyPolicies). Every policy is checked on its own first, so
// that an error names the field of the request ("[2].deny_identities[0]"
// in an array): a malformed or invalid policy is 400, one service named
// twice 409, a policy of a service the node does not have 422
// missing_prerequisite (field "service"): apply the service first.
func (h *handler) applyPolicies(w http.ResponseWriter, r *http.Request) error {
	body, err := readBody(r)
	if err != nil {
		return err
	}
	trimmed := bytes.TrimLeft(body, " \t\r\n")
	array := len(trimmed) > 0 && trimmed[0] == '['
	var list []fluxvm.Policy
	if array {
		list, err = intent.DecodePolicies(bytes.NewReader(body), h.maxBody)
		if err != nil {
			return err
		}
		if len(list) == 0 {
			return newAPIError(CodeInvalidRequest, "empty array: send at least one policy (POST /v1/network/services/policies/reconcile rewrites the current ones)")
		}
	} else {
		p, err := intent.DecodePolicy(bytes.NewReader(body), h.maxBody)
		if err != nil {
			return err
		}
		list = []fluxvm.Policy{p}
	}
	// field names a field of policy i as the request spells it.
	field := func(i int, f string) string {
		if !array {
			return f
		}
		if f == "" {
			return fmt.Sprintf("[%d]", i)
		}
		return fmt.Sprintf("[%d].%s", i, f)
	}
	seen := make(map[string]int, len(list))
	for i, p := range list {
		if err := intent.ValidatePolicy(p); err != nil {
			var ve *fluxvm.ValidationError
			if errors.As(err, &ve) {
				return &fluxvm.ValidationError{Field: field(i, ve.Field), Reason: ve.Reason, Kind: ve.Unwrap()}
			}
			return err
		}
		if j, dup := seen[p.Service]; dup {
			return &fluxvm.ValidationError{Field: field(i, "service"), Kind: fluxvm.ErrConflict,
				Reason: fmt.Sprintf("service %q already has the policy %s of this request", p.Service, field(j, ""))}
		}
		seen[p.Service] = i
		if _, err := h.roles.Services.Service(p.Service); err != nil {
			if errors.Is(err, fluxvm.ErrNotFound) {
				return errNoService(field(i, "service"), p.Service)
			}
			return err
		}
	}
	st, err := h.roles.Policies.ApplyPolicies(r.Context(), list...)
	if err != nil {
		return err
	}
	h.writeJSON(w, r, http.StatusOK, policiesStatus(st))
	return nil
}

// errNoService is the answer to a policy of a service the node does not
// have.
func errNoService(field, name string) *apiError {
	e := newAPIError(CodeMissingPrerequisite, fmt.Sprintf("%s: service %q does not exist: apply the service before its policy", field, name))
	e.field = field
	return e
}

// reconcilePolicies answers POST /v1/network/services/policies/reconcile:
// with an IPCacheSource the ipcache is read from it and applied (which
// recompiles and rewrites every policy); without one the current policies
// are recompiled and rewritten as they are.
func (h *handler) reconcilePolicies(w http.ResponseWriter, r *http.Request) error {
	body, err := readBody(r)
	if err != nil {
		return err
	}
	if len(bytes.TrimSpace(body)) > 0 {
		if err := decodeStrict(body, &policyReconcileRequest{}); err != nil {
			return err
		}
	}
	var st fluxvm.PoliciesStatus
	if h.ipcache != nil {
		ipc, err := h.ipcache(r.Context())
		if err == nil {
			err = intent.ValidateIPCache(ipc)
		}
		if err != nil {
			if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
				return err
			}
			// The request is fine; what the node reads is not: nothing
			// changed, the message says what to fix.
			e := newAPIError(CodeMissingPrerequisite, "the ipcache source failed; nothing changed: "+err.Error())
			var ve *fluxvm.ValidationError
			if errors.As(err, &ve) && ve.Field != "" {
				e.field = "ipcache." + ve.Field
			}
			return e
		}
		st, err = h.roles.Policies.SetIPCache(r.Context(), ipc)
		if err != nil {
			return err
		}
	} else {
		st, err = h.roles.Policies.ApplyPolicies(r.Context())
		if err != nil {
			return err
		}
	}
	h.writeJSON(w, r, http.StatusOK, policiesStatus(st))
	return nil
}

// getPolicy answers GET /v1/network/services/{name}/policy.
func (h *handler) getPolicy(w http.ResponseWriter, r *http.Request) error {
	name := r.PathValue("name")
	if fluxvm.IsReservedName(name) {
		return errReservedRoute(r, name)
	}
	st, err := h.roles.Policies.Policy(r.Context(), name)
	if err != nil {
		return err
	}
	h.writeJSON(w, r, http.StatusOK, policyStatus(st))
	return nil
}

// deletePolicy answers DELETE /v1/network/services/{name}/policy: 204,
// 404 when the service has no policy.
func (h *handler) deletePolicy(w http.ResponseWriter, r *http.Request) error {
	name := r.PathValue("name")
	if fluxvm.IsReservedName(name) {
		// Validation refuses a policy for a reserved name: none exists.
		return errReservedRoute(r, name)
	}
	if err := h.roles.Policies.DeletePolicy(r.Context(), name); err != nil {
		return err
	}
	w.Header().Del("Content-Type")
	w.WriteHeader(http.StatusNoContent)
	return nil
}

// policiesStatus makes the lists of st [] rather than null.
func policiesStatus(st fluxvm.PoliciesStatus) fluxvm.PoliciesStatus {
	if st.Policies == nil {
		st.Policies = []fluxvm.PolicyStatus{}
	}
	for i := range st.Policies {
		st.Policies[i] = policyStatus(st.Policies[i])
	}
	return st
}

func policyStatus(p fluxvm.PolicyStatus) fluxvm.PolicyStatus {
	if p.AllowIdentities == nil {
		p.AllowIdentities = []fluxvm.Identity{}
	}
	if p.DenyIdentities == nil {
		p.DenyIdentities = []fluxvm.Identity{}
	}
	if p.Unresolved == nil {
		p.Unresolved = []fluxvm.Identity{}
	}
	return p
}

// getEnvoy answers GET /v1/network/services/{name}/l7/envoy: the document
// an Envoy/xDS adapter configures the service's L7 proxy from (listeners
// on its VIPs, a cluster of its backends, routes from the policy's
// authorities and path prefixes); 404 when the service has no policy with
// an l7 part.
func (h *handler) getEnvoy(w http.ResponseWriter, r *http.Request) error {
	name := r.PathValue("name")
	if fluxvm.IsReservedName(name) {
		return errReservedRoute(r, name)
	}
	doc, err := h.roles.Policies.Envoy(name)
	if err != nil {
		return err
	}
	h.writeJSON(w, r, http.StatusOK, doc)
	return nil
}
