package membw

import "sync/atomic"

// sink keeps the reads' result alive, so that no compiler drops them.
var sink atomic.Uint64
