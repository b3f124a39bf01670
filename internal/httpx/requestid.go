package httpx

import (
	"fmt"
	"net/http"

	"github.com/pdkit/pdkit/api/openai"
)

// RequestIDHeader carries a client's own id of a request (as proxies and
// tracing set it): pdkit keeps it, echoes it in the response and names it
// in the request's log lines and debug entries.
const RequestIDHeader = "X-Request-Id"

// MaxRequestIDBytes bounds a client's request id.
const MaxRequestIDBytes = 128

// ClientRequestID returns r's X-Request-Id, "" when it has none. An id
// longer than MaxRequestIDBytes, or with a byte other than a letter, a
// digit or one of "-._~:/+=@", is refused with a 400 naming the header: it
// goes into log lines, where a newline or a control byte could forge one.
func ClientRequestID(r *http.Request) (string, *openai.Error) {
	vs := r.Header.Values(RequestIDHeader)
	if len(vs) == 0 {
		return "", nil
	}
	bad := func(why string) *openai.Error {
		return openai.InvalidRequest(RequestIDHeader, fmt.Sprintf("header %s %s: want one value of 1 to %d letters, digits or -._~:/+=@",
			RequestIDHeader, why, MaxRequestIDBytes))
	}
	if len(vs) > 1 {
		return "", bad(fmt.Sprintf("given %d times", len(vs)))
	}
	id := vs[0]
	if id == "" || len(id) > MaxRequestIDBytes {
		return "", bad(fmt.Sprintf("of %d bytes", len(id)))
	}
	for i := 0; i < len(id); i++ {
		if c := id[i]; !requestIDByte(c) {
			return "", bad(fmt.Sprintf("has the byte %q at %d", c, i))
		}
	}
	return id, nil
}

func requestIDByte(c byte) bool {
	switch {
	case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		return true
	}
	switch c {
	case '-', '.', '_', '~', ':', '/', '+', '=', '@':
		return true
	}
	return false
}
