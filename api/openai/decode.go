package openai

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
)

// Defaults used when a Limits field is zero.
const (
	DefaultMaxBodyBytes = 4 << 20
	// DefaultMaxTokens is OpenAI's default for max_tokens in completions.
	DefaultMaxTokens = 16
)

// Limits are what a server allows; the zero value allows everything that
// is well-formed, with the defaults above.
type Limits struct {
	// MaxBodyBytes bounds the request body; a larger one gets 413. Zero
	// means DefaultMaxBodyBytes.
	MaxBodyBytes int64
	// DefaultMaxTokens replaces an absent max_tokens. Zero means
	// DefaultMaxTokens; it is lowered to MaxTokens when above it.
	DefaultMaxTokens int
	// MaxTokens bounds max_tokens; zero means no bound.
	MaxTokens int
	// Models are the model names the server answers to; a request naming
	// another gets 404. A request with no model is accepted, and so is any
	// model when Models is empty.
	Models []string
}

func (l Limits) maxBody() int64 {
	if l.MaxBodyBytes > 0 {
		return l.MaxBodyBytes
	}
	return DefaultMaxBodyBytes
}

func (l Limits) defaultMaxTokens() int {
	n := l.DefaultMaxTokens
	if n <= 0 {
		n = DefaultMaxTokens
	}
	if l.MaxTokens > 0 && n > l.MaxTokens {
		n = l.MaxTokens
	}
	return n
}

// DecodeCompletion reads, checks and completes the body of a completion
// request. On failure it returns an *Error with a 4xx status: 413 for a body
// over l.MaxBodyBytes, 404 for an unknown model, 400 otherwise.
func DecodeCompletion(r io.Reader, l Limits) (*CompletionRequest, *Error) {
	fields, e := readObject(r, l)
	if e != nil {
		return nil, e
	}
	req := &CompletionRequest{}
	var f fieldReader
	f.fields = fields
	req.Model = f.str("model")
	if raw, ok := f.get("prompt"); ok {
		if f.err == nil {
			req.Prompt, f.err = parsePrompt(raw)
		}
	} else {
		f.fail(invalidf("prompt", `"prompt" is required`))
	}
	f.sampling(&req.Temperature, &req.TopP, &req.Seed, &req.Stop, &req.IgnoreEOS, &req.NoCache)
	req.PD = f.pd()
	req.MaxTokens = f.intp("max_tokens")
	req.Stream = f.boolean("stream")
	req.StreamOptions = f.streamOptions()
	req.User = f.str("user")
	req.N = f.choices()
	if n := f.intp("best_of"); n != nil && *n != 1 {
		f.fail(choicesErr("best_of", *n))
	}
	if f.boolean("echo") {
		f.fail(unsupportedf("echo", `"echo" is not supported`))
	}
	if _, ok := f.get("logprobs"); ok {
		f.fail(unsupportedf("logprobs", `"logprobs" is not supported`))
	}
	f.unsupportedCommon()
	f.unsupportedCompletion()
	if f.err != nil {
		return nil, f.err
	}
	if req.MaxTokens == nil {
		req.MaxTokens = ptr(l.defaultMaxTokens())
	}
	fillSampling(&req.Temperature, &req.TopP)
	if e := req.Validate(l); e != nil {
		return nil, e
	}
	return req, nil
}

// DecodeChat reads, checks and completes the body of a chat completion
// request, failing as DecodeCompletion does.
func DecodeChat(r io.Reader, l Limits) (*ChatCompletionRequest, *Error) {
	fields, e := readObject(r, l)
	if e != nil {
		return nil, e
	}
	req := &ChatCompletionRequest{}
	var f fieldReader
	f.fields = fields
	req.Model = f.str("model")
	if raw, ok := f.get("messages"); ok {
		if f.err == nil {
			req.Messages, f.err = parseMessages(raw)
		}
	} else {
		f.fail(invalidf("messages", `"messages" is required`))
	}
	f.sampling(&req.Temperature, &req.TopP, &req.Seed, &req.Stop, &req.IgnoreEOS, &req.NoCache)
	req.PD = f.pd()
	req.MaxTokens = f.intp("max_tokens")
	req.MaxCompletionTokens = f.intp("max_completion_tokens")
	req.Stream = f.boolean("stream")
	req.StreamOptions = f.streamOptions()
	req.User = f.str("user")
	req.N = f.choices()
	if f.boolean("logprobs") {
		f.fail(unsupportedf("logprobs", `"logprobs" is not supported`))
	}
	if n := f.intp("top_logprobs"); n != nil && *n != 0 {
		f.fail(unsupportedf("top_logprobs", `"top_logprobs" is not supported`))
	}
	f.unsupportedCommon()
	f.unsupportedChat()
	if f.err != nil {
		return nil, f.err
	}
	if req.MaxTokens == nil && req.MaxCompletionTokens == nil {
		req.MaxCompletionTokens = ptr(l.defaultMaxTokens())
	}
	fillSampling(&req.Temperature, &req.TopP)
	if e := req.Validate(l); e != nil {
		return nil, e
	}
	return req, nil
}

// Validate checks the values of r against l; absent optional fields are
// valid. DecodeCompletion calls it; a client may call it before sending.
func (r *CompletionRequest) Validate(l Limits) *Error {
	if e := checkModel(r.Model, l); e != nil {
		return e
	}
	if r.Prompt.Tokens != nil {
		if len(r.Prompt.Tokens) == 0 {
			return invalidf("prompt", `"prompt" must not be empty`)
		}
		for i, t := range r.Prompt.Tokens {
			if t < 0 {
				return invalidf("prompt", `"prompt[%d]" must be a token id (at least 0), got %d`, i, t)
			}
		}
	} else if r.Prompt.Text == "" {
		return invalidf("prompt", `"prompt" must not be empty`)
	}
	if e := checkMaxTokens("max_tokens", r.MaxTokens, l); e != nil {
		return e
	}
	return checkSampling(r.Temperature, r.TopP, r.Stop, r.Stream, r.StreamOptions)
}

// Validate checks the values of r against l as CompletionRequest.Validate
// does.
func (r *ChatCompletionRequest) Validate(l Limits) *Error {
	if e := checkModel(r.Model, l); e != nil {
		return e
	}
	if len(r.Messages) == 0 {
		return invalidf("messages", `"messages" must not be empty`)
	}
	for i, m := range r.Messages {
		switch m.Role {
		case RoleSystem, RoleUser, RoleAssistant, RoleTool:
		default:
			return invalidf(fmt.Sprintf("messages[%d].role", i),
				`"messages[%d].role" must be one of system, user, assistant, tool, got %q`, i, m.Role)
		}
		if m.Content.Parts == nil {
			continue
		}
		if len(m.Content.Parts) == 0 {
			return invalidf(fmt.Sprintf("messages[%d].content", i), `"messages[%d].content" must not be an empty array`, i)
		}
		for j, p := range m.Content.Parts {
			if p.Type != "text" {
				return unsupportedf(fmt.Sprintf("messages[%d].content[%d].type", i, j),
					`content part type %q is not supported, only "text"`, p.Type)
			}
		}
	}
	if e := checkMaxTokens("max_tokens", r.MaxTokens, l); e != nil {
		return e
	}
	if e := checkMaxTokens("max_completion_tokens", r.MaxCompletionTokens, l); e != nil {
		return e
	}
	return checkSampling(r.Temperature, r.TopP, r.Stop, r.Stream, r.StreamOptions)
}

// Params returns r's sampling settings, with l's defaults for absent ones.
func (r *CompletionRequest) Params(l Limits) Params {
	p := params(r.MaxTokens, l, r.Temperature, r.TopP, r.Seed, r.Stop, r.IgnoreEOS)
	p.NoCache = r.NoCache
	return p
}

// Params returns r's sampling settings, with l's defaults for absent ones;
// max_completion_tokens wins over max_tokens.
func (r *ChatCompletionRequest) Params(l Limits) Params {
	mt := r.MaxCompletionTokens
	if mt == nil {
		mt = r.MaxTokens
	}
	p := params(mt, l, r.Temperature, r.TopP, r.Seed, r.Stop, r.IgnoreEOS)
	p.NoCache = r.NoCache
	return p
}

func params(maxTokens *int, l Limits, temp, topP *float64, seed *int64, stop []string, ignoreEOS bool) Params {
	p := Params{MaxTokens: l.defaultMaxTokens(), Temperature: 1, TopP: 1, Stop: stop, IgnoreEOS: ignoreEOS}
	if maxTokens != nil {
		p.MaxTokens = *maxTokens
	}
	if temp != nil {
		p.Temperature = *temp
	}
	if topP != nil {
		p.TopP = *topP
	}
	if seed != nil {
		p.Seed, p.HasSeed = *seed, true
	}
	return p
}

func checkModel(model string, l Limits) *Error {
	if model == "" || len(l.Models) == 0 || slices.Contains(l.Models, model) {
		return nil
	}
	return ModelNotFound(model)
}

func checkMaxTokens(name string, n *int, l Limits) *Error {
	if n == nil {
		return nil
	}
	if *n < 1 {
		return invalidf(name, `%q must be at least 1, got %d`, name, *n)
	}
	if l.MaxTokens > 0 && *n > l.MaxTokens {
		return invalidf(name, `%q must be at most %d, got %d`, name, l.MaxTokens, *n)
	}
	return nil
}

func checkSampling(temp, topP *float64, stop []string, stream bool, so *StreamOptions) *Error {
	if temp != nil && !(*temp >= 0 && *temp <= 2) {
		return invalidf("temperature", `"temperature" must be between 0 and 2, got %s`, fmtFloat(*temp))
	}
	if topP != nil && !(*topP > 0 && *topP <= 1) {
		return invalidf("top_p", `"top_p" must be greater than 0 and at most 1, got %s`, fmtFloat(*topP))
	}
	if len(stop) > MaxStop {
		return invalidf("stop", `"stop" may hold at most %d strings, got %d`, MaxStop, len(stop))
	}
	for i, s := range stop {
		if s == "" {
			return invalidf("stop", `"stop[%d]" must not be empty`, i)
		}
		if len(s) > MaxStopBytes {
			return invalidf("stop", `"stop[%d]" must be at most %d bytes, got %d`, i, MaxStopBytes, len(s))
		}
	}
	if so != nil && !stream {
		return invalidf("stream_options", `"stream_options" is only allowed when "stream" is true`)
	}
	return nil
}

func fmtFloat(v float64) string { return strconv.FormatFloat(v, 'g', -1, 64) }

func ptr[T any](v T) *T { return &v }

func fillSampling(temp, topP **float64) {
	if *temp == nil {
		*temp = ptr(1.0)
	}
	if *topP == nil {
		*topP = ptr(1.0)
	}
}

// MaxChoices bounds "n": the choices of one request, samples of one
// prompt that the server prefills once.
const MaxChoices = 16

// choices reads "n", 1 to MaxChoices; one choice, absent or 1, is nil.
func (f *fieldReader) choices() *int {
	n := f.intp("n")
	switch {
	case n == nil || *n == 1:
		return nil
	case *n < 1:
		f.fail(choicesErr("n", *n))
	case *n > MaxChoices:
		f.fail(invalidf("n", `"n" must be at most %d, got %d`, MaxChoices, *n))
	}
	return n
}

// choicesErr refuses n below 1 or best_of other than 1, saying what is
// supported.
func choicesErr(name string, n int) *Error {
	if n < 1 {
		return invalidf(name, `%q must be at least 1, got %d`, name, n)
	}
	return unsupportedf(name, `%q must be 1: one candidate per request is supported, got %d; "n" gives up to %d choices`, name, n, MaxChoices)
}

// readObject reads the body, at most l.maxBody() bytes, and splits the
// top-level JSON object into its fields.
func readObject(r io.Reader, l Limits) (map[string]json.RawMessage, *Error) {
	max := l.maxBody()
	tooLarge := func(limit int64) *Error {
		return &Error{
			Status:  http.StatusRequestEntityTooLarge,
			Message: fmt.Sprintf("request body is larger than %d bytes", limit),
			Type:    TypeInvalidRequest,
			Code:    CodeRequestTooLarge,
		}
	}
	body, err := io.ReadAll(io.LimitReader(r, max+1))
	if err != nil {
		// A server may bound the body itself with http.MaxBytesReader.
		if mbe, ok := errors.AsType[*http.MaxBytesError](err); ok {
			return nil, tooLarge(mbe.Limit)
		}
		return nil, invalidf("", "reading the request body: %v", err)
	}
	if int64(len(body)) > max {
		return nil, tooLarge(max)
	}
	if len(bytes.TrimSpace(body)) == 0 {
		return nil, invalidf("", "request body is empty; expected a JSON object")
	}
	if err := syntaxCheck(body); err != nil {
		return nil, err
	}
	if bytes.TrimLeft(body, " \t\r\n")[0] != '{' {
		return nil, invalidf("", "request body must be a JSON object")
	}
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(body, &fields); err != nil {
		return nil, invalidf("", "request body must be a JSON object: %v", err)
	}
	return fields, nil
}

// syntaxCheck reports malformed JSON with its position.
func syntaxCheck(body []byte) *Error {
	var v json.RawMessage
	dec := json.NewDecoder(bytes.NewReader(body))
	err := dec.Decode(&v)
	if err == nil {
		// One value only: anything but white space after it is an error.
		off := dec.InputOffset()
		if rest := bytes.TrimLeft(body[off:], " \t\r\n"); len(rest) > 0 {
			off = int64(len(body) - len(rest))
			line, col := position(body, off)
			return invalidf("", "invalid JSON at line %d, column %d (byte %d): unexpected data after the top-level value", line, col, off)
		}
		return nil
	}
	var se *json.SyntaxError
	if errors.As(err, &se) {
		off := se.Offset - 1 // Offset counts the bytes read, the bad one included
		line, col := position(body, off)
		return invalidf("", "invalid JSON at line %d, column %d (byte %d): %v", line, col, off, se)
	}
	if errors.Is(err, io.ErrUnexpectedEOF) {
		off := int64(len(body))
		line, col := position(body, off)
		return invalidf("", "invalid JSON at line %d, column %d (byte %d): unexpected end of JSON input", line, col, off)
	}
	return invalidf("", "invalid JSON: %v", err)
}

// position returns the 1-based line and column of byte offset off.
func position(body []byte, off int64) (line, col int) {
	off = min(max(off, 0), int64(len(body)))
	before := body[:off]
	line = 1 + bytes.Count(before, []byte{'\n'})
	col = int(off) - (bytes.LastIndexByte(before, '\n') + 1) + 1
	return line, col
}

// fieldReader reads the fields of a top-level object, keeping the first
// error; after an error every read returns a zero value.
type fieldReader struct {
	fields map[string]json.RawMessage
	err    *Error
}

func (f *fieldReader) fail(e *Error) {
	if f.err == nil {
		f.err = e
	}
}

// get returns the raw value of a field that is present and not null.
func (f *fieldReader) get(name string) (json.RawMessage, bool) {
	raw, ok := f.fields[name]
	if !ok || string(raw) == "null" {
		return nil, false
	}
	return raw, true
}

func (f *fieldReader) str(name string) string {
	raw, ok := f.get(name)
	if !ok || f.err != nil {
		return ""
	}
	s, e := parseString(raw, name)
	f.fail(e)
	return s
}

func (f *fieldReader) boolean(name string) bool {
	raw, ok := f.get(name)
	if !ok || f.err != nil {
		return false
	}
	switch string(raw) {
	case "true":
		return true
	case "false":
		return false
	}
	f.fail(invalidf(name, "%q must be a boolean", name))
	return false
}

func (f *fieldReader) intp(name string) *int {
	raw, ok := f.get(name)
	if !ok || f.err != nil {
		return nil
	}
	n, e := parseInt(raw, name, strconv.IntSize)
	if e != nil {
		f.fail(e)
		return nil
	}
	return ptr(int(n))
}

func (f *fieldReader) int64p(name string) *int64 {
	raw, ok := f.get(name)
	if !ok || f.err != nil {
		return nil
	}
	n, e := parseInt(raw, name, 64)
	if e != nil {
		f.fail(e)
		return nil
	}
	return &n
}

func (f *fieldReader) floatp(name string) *float64 {
	raw, ok := f.get(name)
	if !ok || f.err != nil {
		return nil
	}
	if !isNumber(raw) {
		f.fail(invalidf(name, "%q must be a number", name))
		return nil
	}
	v, err := strconv.ParseFloat(string(raw), 64)
	if err != nil {
		f.fail(invalidf(name, "%q is out of range", name))
		return nil
	}
	return &v
}

// sampling reads the sampling fields that completion and chat share.
func (f *fieldReader) sampling(temp, topP **float64, seed **int64, stop *[]string, ignoreEOS, noCache *bool) {
	*temp = f.floatp("temperature")
	*topP = f.floatp("top_p")
	*seed = f.int64p("seed")
	if raw, ok := f.get("stop"); ok && f.err == nil {
		*stop, f.err = parseStop(raw)
	}
	*ignoreEOS = f.boolean("ignore_eos")
	*noCache = f.boolean("no_cache")
}

// pd reads the fields a PD router adds: bootstrap_room, an unsigned 64-bit
// integer as a JSON number or as a string of digits (which JavaScript and
// jq keep exact above 2^53), bootstrap_url, a string, and probe, which
// marks the router's canary.
func (f *fieldReader) pd() PD {
	var pd PD
	if raw, ok := f.get("bootstrap_room"); ok && f.err == nil {
		digits := string(raw)
		if len(raw) >= 2 && raw[0] == '"' && raw[len(raw)-1] == '"' {
			digits = digits[1 : len(digits)-1]
		}
		n, err := strconv.ParseUint(digits, 10, 64)
		if err != nil {
			f.fail(invalidf("bootstrap_room", `"bootstrap_room" must be an unsigned 64-bit integer, as a number or a string of digits`))
			return pd
		}
		pd.BootstrapRoom = &n
	}
	pd.BootstrapURL = f.str("bootstrap_url")
	pd.Probe = f.boolean("probe")
	return pd
}

func (f *fieldReader) streamOptions() *StreamOptions {
	raw, ok := f.get("stream_options")
	if !ok || f.err != nil {
		return nil
	}
	var obj map[string]json.RawMessage
	if raw[0] != '{' || json.Unmarshal(raw, &obj) != nil {
		f.fail(invalidf("stream_options", `"stream_options" must be an object`))
		return nil
	}
	sub := fieldReader{fields: obj}
	so := &StreamOptions{IncludeUsage: sub.boolean("include_usage")}
	if sub.err != nil {
		f.fail(invalidf("stream_options.include_usage", `"stream_options.include_usage" must be a boolean`))
		return nil
	}
	return so
}

func isNumber(raw []byte) bool {
	return len(raw) > 0 && (raw[0] == '-' || raw[0] >= '0' && raw[0] <= '9')
}

func parseString(raw json.RawMessage, name string) (string, *Error) {
	var s string
	if len(raw) == 0 || raw[0] != '"' || json.Unmarshal(raw, &s) != nil {
		return "", invalidf(name, "%q must be a string", name)
	}
	return s, nil
}

// parseInt reads a JSON integer; name is the param, bits the size of the
// destination.
func parseInt(raw json.RawMessage, name string, bits int) (int64, *Error) {
	if !isNumber(raw) || bytes.ContainsAny(raw, ".eE") {
		return 0, invalidf(name, "%q must be an integer", name)
	}
	n, err := strconv.ParseInt(string(raw), 10, bits)
	if err != nil {
		return 0, invalidf(name, "%q is out of range", name)
	}
	return n, nil
}

func parseStop(raw json.RawMessage) ([]string, *Error) {
	const msg = `"stop" must be a string or an array of strings`
	if raw[0] == '"' {
		s, e := parseString(raw, "stop")
		if e != nil {
			return nil, e
		}
		return []string{s}, nil
	}
	var items []json.RawMessage
	if raw[0] != '[' || json.Unmarshal(raw, &items) != nil {
		return nil, invalidf("stop", "%s", msg)
	}
	if len(items) == 0 {
		return nil, nil
	}
	stop := make([]string, len(items))
	for i, it := range items {
		s, e := parseString(it, "stop")
		if e != nil {
			return nil, invalidf("stop", "%s", msg)
		}
		stop[i] = s
	}
	return stop, nil
}

func parsePrompt(raw json.RawMessage) (Prompt, *Error) {
	const msg = `"prompt" must be a string, an array of one string or an array of token ids`
	if len(raw) > 0 && raw[0] == '"' {
		s, e := parseString(raw, "prompt")
		return Prompt{Text: s}, e
	}
	var items []json.RawMessage
	if len(raw) == 0 || raw[0] != '[' || json.Unmarshal(raw, &items) != nil {
		return Prompt{}, invalidf("prompt", "%s", msg)
	}
	if len(items) == 0 {
		return Prompt{}, invalidf("prompt", `"prompt" must not be empty`)
	}
	switch first := items[0]; {
	case first[0] == '"' || first[0] == '[':
		if len(items) > 1 {
			return Prompt{}, unsupportedf("prompt", `"prompt" holds %d prompts; batched prompts are not supported, send one per request`, len(items))
		}
		if first[0] == '[' {
			return parseTokens(first, msg)
		}
		s, e := parseString(first, "prompt")
		return Prompt{Text: s}, e
	case isNumber(first):
		return parseTokens(raw, msg)
	}
	return Prompt{}, invalidf("prompt", "%s", msg)
}

// parseTokens reads a JSON array of token ids.
func parseTokens(raw json.RawMessage, msg string) (Prompt, *Error) {
	var items []json.RawMessage
	if json.Unmarshal(raw, &items) != nil {
		return Prompt{}, invalidf("prompt", "%s", msg)
	}
	if len(items) == 0 {
		return Prompt{}, invalidf("prompt", `"prompt" must not be empty`)
	}
	toks := make([]int, len(items))
	for i, it := range items {
		n, e := parseInt(it, "prompt", 32)
		if e != nil {
			return Prompt{}, invalidf("prompt", `"prompt[%d]" must be a token id, got %s`, i, clip(it))
		}
		if n < 0 {
			return Prompt{}, invalidf("prompt", `"prompt[%d]" must be a token id (at least 0), got %d`, i, n)
		}
		toks[i] = int(n)
	}
	return Prompt{Tokens: toks}, nil
}

// clip shortens a raw value for an error message.
func clip(raw json.RawMessage) string {
	if len(raw) > 32 {
		return string(raw[:32]) + "..."
	}
	return string(raw)
}

func parseMessages(raw json.RawMessage) ([]Message, *Error) {
	var items []json.RawMessage
	if raw[0] != '[' || json.Unmarshal(raw, &items) != nil {
		return nil, invalidf("messages", `"messages" must be an array`)
	}
	if len(items) == 0 {
		return nil, invalidf("messages", `"messages" must not be empty`)
	}
	msgs := make([]Message, len(items))
	for i, it := range items {
		name := fmt.Sprintf("messages[%d]", i)
		var obj map[string]json.RawMessage
		if it[0] != '{' || json.Unmarshal(it, &obj) != nil {
			return nil, invalidf(name, "%q must be an object", name)
		}
		f := fieldReader{fields: obj}
		m := &msgs[i]
		if _, ok := f.get("role"); !ok {
			return nil, invalidf(name+".role", "%q is required", name+".role")
		}
		m.Role = f.str("role")
		m.Name = f.str("name")
		m.ToolCallID = f.str("tool_call_id")
		if f.err != nil {
			f.err.Param = name + "." + f.err.Param
			f.err.Message = fmt.Sprintf("%q must be a string", f.err.Param)
			return nil, f.err
		}
		if f.unsupportedMessage(i); f.err != nil {
			return nil, f.err
		}
		c, ok := f.get("content")
		if !ok {
			return nil, invalidf(name+".content", "%q is required", name+".content")
		}
		var e *Error
		if m.Content, e = parseContent(c, name+".content"); e != nil {
			return nil, e
		}
	}
	return msgs, nil
}

// parseContent reads a message's content; name is its param.
func parseContent(raw json.RawMessage, name string) (Content, *Error) {
	msg := fmt.Sprintf("%q must be a string or an array of text parts", name)
	if len(raw) > 0 && raw[0] == '"' {
		s, e := parseString(raw, name)
		return Content{Text: s}, e
	}
	var items []json.RawMessage
	if len(raw) == 0 || raw[0] != '[' || json.Unmarshal(raw, &items) != nil {
		return Content{}, invalidf(name, "%s", msg)
	}
	if len(items) == 0 {
		return Content{}, invalidf(name, "%q must not be an empty array", name)
	}
	parts := make([]ContentPart, len(items))
	for j, it := range items {
		pname := fmt.Sprintf("%s[%d]", name, j)
		var obj map[string]json.RawMessage
		if it[0] != '{' || json.Unmarshal(it, &obj) != nil {
			return Content{}, invalidf(pname, "%q must be an object", pname)
		}
		f := fieldReader{fields: obj}
		if _, ok := f.get("type"); !ok {
			return Content{}, invalidf(pname+".type", "%q is required", pname+".type")
		}
		typ, e := parseString(f.fields["type"], pname+".type")
		if e != nil {
			return Content{}, e
		}
		if typ != "text" {
			return Content{}, unsupportedf(pname+".type", `content part type %q is not supported, only "text"`, typ)
		}
		t, ok := f.get("text")
		if !ok {
			return Content{}, invalidf(pname+".text", "%q is required", pname+".text")
		}
		text, e := parseString(t, pname+".text")
		if e != nil {
			return Content{}, e
		}
		parts[j] = ContentPart{Type: typ, Text: text}
	}
	return Content{Parts: parts}, nil
}
