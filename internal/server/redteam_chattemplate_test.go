package server

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/openai"
	"github.com/pdkit/pdkit/engine/chattemplate"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/waitfor"
)

// triggerTemplate is ChatML, except that a message saying "trigger" sends
// it round a loop of 10^10 turns.
const triggerTemplate = `{% for m in messages %}{% if 'trigger' in m.content %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}`

// TestRedTeamChatTemplateTrigger: the model's own template loops only when
// a message says a word. A chat request that says it is answered 400
// naming the time bound, its renderer killed; while it renders, other chat
// requests are served; and a client that leaves ends the render. Without
// the sandbox such a request took the server to gigabytes and went on
// after its client left.
func TestRedTeamChatTemplateTrigger(t *testing.T) {
	m := chatModel(t, triggerTemplate)
	bounded := chattemplate.NewSandbox(chattemplate.Bounds{Time: 300 * time.Millisecond})
	t.Cleanup(bounded.Close)
	e := newEnvModelOpts(t, m, serve.Config{PageSize: 4, MaxRunning: 8}, Options{ChatSandbox: bounded})
	if e.srv.ChatTemplate().Name() != ChatJinja {
		t.Fatalf("template %s, want the model's", e.srv.ChatTemplate().Name())
	}
	code, b := chatRequest(t, e, []openai.Message{msg("user", "pull the trigger")})
	var body openai.ErrorBody
	if code != http.StatusBadRequest || json.Unmarshal(b, &body) != nil || body.Error.Param == nil || *body.Error.Param != "messages" ||
		!strings.Contains(body.Error.Message, "time bound of 300ms") {
		t.Fatalf("the trigger: %d %s, want 400 naming the time bound", code, b)
	}
	if st := bounded.Stats(); st.Bounded != 1 || st.Workers != 0 {
		t.Errorf("sandbox %+v: want one render bounded, its worker gone", st)
	}
	if code, b := chatRequest(t, e, conversation); code != http.StatusOK {
		t.Fatalf("after the trigger: %d %s", code, b)
	}

	// A renderer with no time bound to speak of: the trigger holds one
	// worker until its client goes.
	slow := chattemplate.NewSandbox(chattemplate.Bounds{Time: time.Hour, Workers: 2})
	t.Cleanup(slow.Close)
	e = newEnvModelOpts(t, m, serve.Config{PageSize: 4, MaxRunning: 8}, Options{ChatSandbox: slow})
	ctx, leave := context.WithCancel(t.Context())
	defer leave()
	ended := make(chan error, 1)
	go func() {
		raw, _ := json.Marshal(map[string]any{"messages": []openai.Message{msg("user", "trigger")}, "max_tokens": 4})
		req, _ := http.NewRequestWithContext(ctx, "POST", e.ts.URL+"/v1/chat/completions", bytes.NewReader(raw))
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			resp.Body.Close()
		}
		ended <- err
	}()
	waitfor.For(t, "the trigger rendering", 20*time.Second, func() bool { return slow.Stats().InFlight == 1 })
	if code, b := chatRequest(t, e, conversation); code != http.StatusOK {
		t.Fatalf("beside the trigger: %d %s", code, b)
	}
	if st := slow.Stats(); st.InFlight != 1 {
		t.Fatalf("sandbox %+v: the trigger ended before the other request was served", st)
	}
	leave()
	waitfor.Recv(t, "the client gone", 20*time.Second, ended)
	waitfor.For(t, "the trigger's renderer killed", 20*time.Second, func() bool {
		st := slow.Stats()
		return st.InFlight == 0 && st.Workers == 1
	})
}
