package dist

import "context"

// A tag names what a collective is for in the caller's protocol (the rank
// loop's phases: "input", "poll", ...). It travels in the call's context,
// so that the collectives' signatures stay those of the operation, and it
// is kept in the flight recorder and in a MismatchError: a broken group
// then says which phase each rank was in, not only which operation.
type tagKey struct{}

// WithTag returns ctx with the tag that the collectives called with it
// record. Build the context once per tag and reuse it: a collective only
// reads it.
func WithTag(ctx context.Context, tag string) context.Context {
	return context.WithValue(ctx, tagKey{}, tag)
}

// tagOf is ctx's tag, "" when none.
func tagOf(ctx context.Context) string {
	t, _ := ctx.Value(tagKey{}).(string)
	return t
}
