package server

import (
	"context"
	"net/http"
	"runtime"

	"github.com/pdkit/pdkit/api/openai"
	"github.com/pdkit/pdkit/engine/tokenizer"
)

// Memory per request is bounded before any work is done on it.
//
// Tokenizing costs tens of times a prompt's size, so a prompt that cannot
// fit the context is refused before it is tokenized (openai.PromptBound,
// with the model's context and its longest token), and a body is read only
// as far as a prompt that fits could go. Token-id prompts are refused by
// their count, chat requests by their messages' count and text, before
// the template runs. The server publishes its bound (ServerInfo), and a
// router checks the same before it forwards. Tokenizing runs at most
// GOMAXPROCS at a time; a request waits its turn, or goes when its client
// does.

// tokenBytes is the most bytes of text one of t's tokens stands for (its
// piece; Encode reads no control token from text), plus one for the space
// a SentencePiece vocabulary may add in front.
func tokenBytes(t tokenizer.Tokenizer) int {
	n := 0
	for id := range int32(t.VocabSize()) {
		n = max(n, len(t.Piece(id)))
	}
	return n + 1
}

// tokenizing runs encode once one of the tokenizer's places is free, or
// gives up when the request's client goes.
func (s *Server) tokenizing(ctx context.Context, encode func() error) error {
	select {
	case s.tokenize <- struct{}{}:
	case <-ctx.Done():
		return context.Cause(ctx)
	}
	defer func() { <-s.tokenize }()
	return encode()
}

// tokenizePlaces is how many requests tokenize at once.
func tokenizePlaces() int { return runtime.GOMAXPROCS(0) }

// clientGone answers a request whose client left while it waited to be
// tokenized (nobody reads the answer; the status is for the logs).
func clientGone(w http.ResponseWriter, err error) {
	(&openai.Error{Status: 499, Type: openai.TypeInvalidRequest, Message: "the client went while the prompt waited to be tokenized: " + err.Error()}).WriteJSON(w)
}
