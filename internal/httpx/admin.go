package httpx

import (
	"crypto/subtle"
	"net/http"
	"strings"

	"github.com/pdkit/pdkit/api/openai"
)

// AdminRule says who may call an admin API (a server's /admin/v1/, the
// router's pause and resume): the holder of a bearer token, compared in
// constant time; without a token, anyone on a listener bound to loopback
// only, and no one elsewhere.
type AdminRule struct {
	// Token is the bearer token the calls must carry; "" for none.
	Token string
	// Derived says Token is the one the cluster secret derives
	// (clusterauth.Secret.AdminToken), so that a refusal can say where to
	// find it.
	Derived bool
	// Loopback says the listener is bound to loopback only.
	Loopback bool
}

// Check applies the rule to r: nil when the call may go on, else the
// error to answer (401 with a WWW-Authenticate header set on w for a
// missing or wrong token, 403 for an API no one may call).
func (a AdminRule) Check(w http.ResponseWriter, r *http.Request) *openai.Error {
	whose := ""
	if a.Derived {
		whose = "; this server takes the token its cluster secret derives, which pdctl sends given the secret (--cluster-secret-file, PD_CLUSTER_SECRET)"
	}
	if a.Token == "" {
		if a.Loopback {
			return nil
		}
		return &openai.Error{Status: http.StatusForbidden, Type: openai.TypeInvalidRequest,
			Message: "admin API disabled: set --admin-token"}
	}
	unauthorized := func(msg string) *openai.Error {
		w.Header().Set("WWW-Authenticate", `Bearer realm="pdkit admin"`)
		return &openai.Error{Status: http.StatusUnauthorized, Type: openai.TypeInvalidRequest, Message: msg + whose}
	}
	scheme, got, ok := strings.Cut(r.Header.Get("Authorization"), " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return unauthorized("admin API: missing bearer token (Authorization: Bearer <token>)")
	}
	if subtle.ConstantTimeCompare([]byte(strings.TrimSpace(got)), []byte(a.Token)) != 1 {
		return unauthorized("admin API: wrong bearer token")
	}
	return nil
}
