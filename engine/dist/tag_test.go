package dist

import (
	"context"
	"errors"
	"strings"
	"testing"
)

// TestTagsRecordedAndChecked: a tagged collective's tag is in every rank's
// flight recorder; two ranks that run the same operation, of the same
// shape, for different purposes break the group on the tag (a collective
// layer that checks shapes only would let it pass), and the error says
// which phase each rank was in.
func TestTagsRecordedAndChecked(t *testing.T) {
	g := newGroup(t, 2, Options{})
	errs := runRanks(t, g, func(ctx context.Context, c *Comm) error {
		if err := c.AllReduceMinInt(WithTag(ctx, "room"), make([]int64, 2)); err != nil {
			return err
		}
		tag := "poll"
		if c.Rank() == 1 {
			tag = "room"
		}
		return c.AllReduceMinInt(WithTag(ctx, tag), make([]int64, 2))
	})
	for r, err := range errs {
		var me *MismatchError
		if !errors.As(err, &me) || me.Reason != "tag" || me.Seq != 2 {
			t.Fatalf("rank %d: %v, want a tag mismatch at seq 2", r, err)
		}
		for _, want := range []string{"rank 0 AllReduceMin int64[2] in poll", "rank 1 AllReduceMin int64[2] in room"} {
			if !strings.Contains(err.Error(), want) {
				t.Fatalf("rank %d: %v, want %q", r, err, want)
			}
		}
	}
	for r := range 2 {
		recs := g.Rank(r).Records()
		if len(recs) != 2 || recs[0].Tag != "room" || recs[0].Outcome != "ok" {
			t.Fatalf("rank %d: records %+v, want the first call tagged room and ok", r, recs)
		}
	}
	// An untagged call matches any: the forward pass's collectives carry
	// none, and a tag is never needed to agree.
	g2 := newGroup(t, 2, Options{})
	errs = runRanks(t, g2, func(ctx context.Context, c *Comm) error {
		if c.Rank() == 0 {
			ctx = WithTag(ctx, "input")
		}
		_, err := c.BroadcastBytes(ctx, 0, []byte("x"))
		return err
	})
	if errors.Join(errs...) != nil {
		t.Fatalf("an untagged call against a tagged one: %v", errs)
	}
}
