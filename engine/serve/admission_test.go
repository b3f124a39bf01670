package serve

import "testing"

// TestPrefixUnstallLetsTheHeadIn: 40 chats whose cached prefixes, locked
// while they wait, hold more than the small pool: the waiting requests
// behind the head give theirs up (Unstalls), newest first, or the queue
// would wait for ever; and what is generated is what the engine without a
// prefix cache generates, at TP 2, with every page back at the end.
func TestPrefixUnstallLetsTheHeadIn(t *testing.T) {
	m := tinyModel(t)
	ss := sessions(31, 40, 5, 24, m.Config.VocabSize) // 200 requests, 40 revisits
	const maxTok = 4
	cfg := Config{TP: 2, PageSize: 4, KVTokens: 256, MaxRunning: 4, MaxBatchTokens: 48, PrefillChunk: 16}
	off := cfg
	off.DisablePrefixCache = true
	want := runSessions(t, newEngine(t, m, off), ss, maxTok)
	e := newEngine(t, m, cfg)
	got := runSessions(t, e, ss, maxTok)
	checkTurns(t, got, want, "cache on", "off")
	checkPools(t, e)
	tot := e.View().Snapshot().Totals
	t.Logf("hits %d, cached tokens %d, evictions %d, unstalls %d", tot.PrefixHits, tot.CachedTokens, tot.PrefixEvictions, tot.Unstalls)
	if tot.Unstalls == 0 {
		t.Error("no waiting request gave its cached prefix up: the workload never locked the whole pool")
	}
	if tot.PrefixHits == 0 || tot.CachedTokens == 0 || tot.PrefixEvictions == 0 {
		t.Errorf("the prefix cache was not exercised: %+v", tot)
	}
}
