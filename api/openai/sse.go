package openai

import (
	"encoding/json"
	"io"
	"net/http"
)

// WriteEvent writes v as one server-sent event, "data: <json>\n\n", in a
// single write, and flushes w when it is an http.Flusher.
func WriteEvent(w io.Writer, v any) error {
	data, err := json.Marshal(v)
	if err != nil {
		return err
	}
	buf := make([]byte, 0, len(data)+8)
	buf = append(buf, "data: "...)
	buf = append(buf, data...)
	buf = append(buf, "\n\n"...)
	return writeFlush(w, buf)
}

// WriteDone writes the event that ends an OpenAI stream, "data: [DONE]\n\n",
// and flushes w when it is an http.Flusher.
func WriteDone(w io.Writer) error {
	return writeFlush(w, []byte("data: [DONE]\n\n"))
}

func writeFlush(w io.Writer, b []byte) error {
	if _, err := w.Write(b); err != nil {
		return err
	}
	if f, ok := w.(http.Flusher); ok {
		f.Flush()
	}
	return nil
}
