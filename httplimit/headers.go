package httplimit

import (
	"encoding/json"
	"net/http"
	"strings"
)

// appendMember adds member to the Structured Field List in h[name], keeping
// the whole list in one field line. Field lines that are already there (from
// an outer Middleware, or added by someone else with Header.Add) are joined
// first, as RFC 9651 Section 3.1 allows.
func appendMember(h http.Header, name, member string) {
	switch old := h[name]; len(old) {
	case 0:
		h[name] = []string{member}
	case 1:
		if old[0] == "" {
			h[name] = []string{member}
		} else {
			h[name] = []string{old[0] + ", " + member}
		}
	default:
		var parts []string
		for _, v := range old {
			if v = strings.TrimSpace(v); v != "" {
				parts = append(parts, v)
			}
		}
		h[name] = []string{strings.Join(append(parts, member), ", ")}
	}
}

// problem is an RFC 9457 problem details object.
type problem struct {
	Type     string   `json:"type"`
	Title    string   `json:"title"`
	Status   int      `json:"status"`
	Detail   string   `json:"detail,omitempty"`
	Violated []string `json:"violated-policies,omitempty"`
}

// writeProblem writes p as the application/problem+json response.
func writeProblem(w http.ResponseWriter, p problem) {
	body, err := json.Marshal(p)
	if err != nil { // cannot happen: strings and ints only
		body = []byte(`{"type":"about:blank","status":500}`)
		p.Status = http.StatusInternalServerError
	}
	h := w.Header()
	h["Content-Type"] = []string{"application/problem+json"}
	h["X-Content-Type-Options"] = []string{"nosniff"}
	h["Cache-Control"] = []string{"no-store"}
	w.WriteHeader(p.Status)
	_, _ = w.Write(body)
}
