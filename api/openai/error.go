package openai

import (
	"encoding/json"
	"fmt"
	"net/http"
)

// Error types carried in the "type" field of an error body.
const (
	TypeInvalidRequest = "invalid_request_error"
	TypeServer         = "server_error"
)

// Error codes carried in the "code" field of an error body.
const (
	CodeModelNotFound   = "model_not_found"
	CodeRequestTooLarge = "request_too_large"
	CodeUnsupported     = "unsupported_parameter"
)

// Error is a request failure as OpenAI reports it: the HTTP status to
// answer with and the fields of the error body. Param names the request
// field at fault ("temperature", "messages[1].content"); Param and Code are
// empty when they do not apply and are then written as null.
type Error struct {
	Status  int
	Message string
	Type    string
	Param   string
	Code    string
}

func (e *Error) Error() string {
	if e.Param != "" {
		return fmt.Sprintf("%d %s (param %s): %s", e.Status, e.Type, e.Param, e.Message)
	}
	return fmt.Sprintf("%d %s: %s", e.Status, e.Type, e.Message)
}

// ErrorBody is the JSON body of an error response:
// {"error":{"message":...,"type":...,"param":...,"code":...}}.
type ErrorBody struct {
	Error ErrorDetail `json:"error"`
}

// ErrorDetail is the object inside an ErrorBody. Param and Code are null
// when absent.
type ErrorDetail struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    *string `json:"code"`
}

// Body returns the JSON body for e.
func (e *Error) Body() ErrorBody {
	d := ErrorDetail{Message: e.Message, Type: e.Type}
	if e.Param != "" {
		p := e.Param
		d.Param = &p
	}
	if e.Code != "" {
		c := e.Code
		d.Code = &c
	}
	return ErrorBody{Error: d}
}

// WriteJSON answers with e: its status (500 when unset) and its JSON body.
func (e *Error) WriteJSON(w http.ResponseWriter) {
	status := e.Status
	if status == 0 {
		status = http.StatusInternalServerError
	}
	body, err := json.Marshal(e.Body())
	if err != nil { // cannot happen: the body holds only strings
		body = []byte(`{"error":{"message":"internal error","type":"server_error","param":null,"code":null}}`)
	}
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(status)
	w.Write(append(body, '\n'))
}

// ParseError turns an error response (its status and body) back into an
// *Error. A body that is not an OpenAI error body yields an error whose
// message is the body's text.
func ParseError(status int, body []byte) *Error {
	var b ErrorBody
	if err := json.Unmarshal(body, &b); err != nil || b.Error.Message == "" {
		typ := TypeInvalidRequest
		if status >= 500 {
			typ = TypeServer
		}
		msg := string(body)
		if msg == "" {
			msg = http.StatusText(status)
		}
		return &Error{Status: status, Message: msg, Type: typ}
	}
	e := &Error{Status: status, Message: b.Error.Message, Type: b.Error.Type}
	if b.Error.Param != nil {
		e.Param = *b.Error.Param
	}
	if b.Error.Code != nil {
		e.Code = *b.Error.Code
	}
	return e
}

// InvalidRequest returns a 400 invalid_request_error about param (which may
// be empty), for checks the server makes after decoding, such as a prompt
// longer than the context.
func InvalidRequest(param, message string) *Error {
	return &Error{Status: http.StatusBadRequest, Message: message, Type: TypeInvalidRequest, Param: param}
}

// ModelNotFound returns the 404 for a model the server does not serve.
func ModelNotFound(model string) *Error {
	return &Error{
		Status:  http.StatusNotFound,
		Message: fmt.Sprintf("model %q does not exist", model),
		Type:    TypeInvalidRequest,
		Param:   "model",
		Code:    CodeModelNotFound,
	}
}

// ServerError returns a 500 server_error.
func ServerError(message string) *Error {
	return &Error{Status: http.StatusInternalServerError, Message: message, Type: TypeServer}
}

// invalidf is InvalidRequest with a format.
func invalidf(param, format string, args ...any) *Error {
	return InvalidRequest(param, fmt.Sprintf(format, args...))
}

// unsupportedf is a 400 for a feature pdkit does not implement.
func unsupportedf(param, format string, args ...any) *Error {
	e := invalidf(param, format, args...)
	e.Code = CodeUnsupported
	return e
}
