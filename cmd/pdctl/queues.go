package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/pdkit/pdkit/api/client"
	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/spf13/cobra"
)

func newCmdQueues(f *factory) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "queues <command>",
		Short: "Show the PD queues of the prefill and decode servers",
		Args:  needsCommand("dump"),
		RunE:  func(cmd *cobra.Command, args []string) error { return nil },
	}
	cmd.AddCommand(newCmdQueuesDump(f, nil))
	return cmd
}

type queuesDumpOptions struct {
	f        *factory
	Attach   *attachOptions
	Rank     int    // -1: every rank
	Queue    string // "": every queue
	Watch    bool
	JSON     bool
	Interval time.Duration // between two frames of --watch
}

func newCmdQueuesDump(f *factory, runF func(context.Context, *queuesDumpOptions) error) *cobra.Command {
	opts := &queuesDumpOptions{f: f, Attach: &f.attach, Interval: time.Second}
	cmd := &cobra.Command{
		Use:   "dump",
		Short: "Dump every PD queue entry of every rank, and the rooms joined across prefill and decode",
		Long: `Dump every PD queue entry of every rank of the prefill and decode servers
(from GET /debug/v1/pd): server, role, rank, request id (the N of the server's
response id cmpl-N or chatcmpl-N, as the router logs it), bootstrap room, queue,
the rank's own KVPoll state and the state its server's ranks agreed on, age in
the queue, peer endpoint, KV bytes moved, and the decode's ABORT (no, sent, or
acked by the prefill rank). A rank whose POLL is above AGREED is waiting for
another rank. Then the rooms joined: one line per room with its prefill-side
and its decode-side state (server, ranks, queue, agreed state, age), so that a
decode waiting for KV that the prefill forgot shows as a room with no prefill
side.

Colocated servers have no PD queues and are left out. --watch redraws every
second until interrupted (human output only).`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if opts.Queue != "" && !slices.Contains(debug.PDQueues, opts.Queue) {
				return newUsageError(cmd, "unknown queue %q (known: %s)", opts.Queue, strings.Join(debug.PDQueues, ", "))
			}
			if opts.Watch && opts.JSON {
				return newUsageError(cmd, "--watch and --json cannot be used together")
			}
			if runF != nil {
				return runF(cmd.Context(), opts)
			}
			return queuesDumpRun(cmd.Context(), opts)
		},
	}
	cmd.Flags().IntVar(&opts.Rank, "rank", -1, "only this rank's entries")
	cmd.Flags().StringVar(&opts.Queue, "queue", "", "only this queue's entries: "+strings.Join(debug.PDQueues, ", "))
	cmd.Flags().BoolVar(&opts.Watch, "watch", false, "redraw every second until interrupted")
	cmd.Flags().BoolVar(&opts.JSON, "json", false, "print a JSON object")
	return cmd
}

// queueEntry is one PD queue entry of the output.
type queueEntry struct {
	Server string `json:"server"`
	Role   string `json:"role"`
	Rank   int    `json:"rank"`
	debug.PDEntry
}

// roomSide is one side's state of a room: a server and queue, with the
// ranks that hold the room there.
type roomSide struct {
	Server string `json:"server"`
	Ranks  []int  `json:"ranks"`
	Queue  string `json:"queue"`
	// Agreed is the KVPoll state the server's ranks agreed on (the lowest
	// one read when the ranks were read between two iterations).
	Agreed    string  `json:"agreed"`
	InQueueMS float64 `json:"in_queue_ms"` // the longest of the ranks
}

// roomView is one room joined across the prefill and decode sides; a side
// that does not hold the room is empty.
type roomView struct {
	Room    debug.ID   `json:"room"`
	Prefill []roomSide `json:"prefill"`
	Decode  []roomSide `json:"decode"`
}

type queuesOutput struct {
	Entries []queueEntry `json:"entries"`
	Rooms   []roomView   `json:"rooms"`
	// Errors names the servers that could not be read, by URL.
	Errors map[string]string `json:"errors,omitempty"`
}

// readQueues reads every PD server's queues and joins them by room.
func readQueues(ctx context.Context, opts *queuesDumpOptions, targets []*target) queuesOutput {
	out := queuesOutput{Entries: []queueEntry{}, Rooms: []roomView{}}
	per := make([][]queueEntry, len(targets))
	errs := make([]string, len(targets))
	var wg sync.WaitGroup
	for i, t := range targets {
		if t.Err != nil {
			errs[i] = t.Err.Error()
			continue
		}
		if t.Role != "" && !isPD(t.Role) {
			continue
		}
		wg.Go(func() {
			pd, err := t.c.PD(ctx, opts.Queue)
			if err != nil {
				if client.StatusOf(err) != http.StatusNotFound || t.Role != "" {
					errs[i] = err.Error()
				}
				return
			}
			for _, rk := range pd.Ranks {
				if opts.Rank >= 0 && rk.Rank != opts.Rank {
					continue
				}
				for _, e := range rk.Entries {
					per[i] = append(per[i], queueEntry{Server: t.URL, Role: pd.Role, Rank: rk.Rank, PDEntry: e})
				}
			}
		})
	}
	wg.Wait()
	for i, t := range targets {
		out.Entries = append(out.Entries, per[i]...)
		if errs[i] != "" {
			if out.Errors == nil {
				out.Errors = map[string]string{}
			}
			out.Errors[t.URL] = errs[i]
		}
	}
	rooms := map[debug.ID]*roomView{}
	for _, e := range out.Entries {
		rv := rooms[e.Room]
		if rv == nil {
			rv = &roomView{Room: e.Room, Prefill: []roomSide{}, Decode: []roomSide{}}
			rooms[e.Room] = rv
		}
		sides := &rv.Decode
		if e.Role == pdproto.RolePrefill {
			sides = &rv.Prefill
		}
		i := slices.IndexFunc(*sides, func(s roomSide) bool { return s.Server == e.Server && s.Queue == e.Queue })
		if i < 0 {
			*sides = append(*sides, roomSide{Server: e.Server, Queue: e.Queue, Agreed: e.Agreed})
			i = len(*sides) - 1
		}
		s := &(*sides)[i]
		s.Ranks = append(s.Ranks, e.Rank)
		if pollRank(e.Agreed) < pollRank(s.Agreed) {
			s.Agreed = e.Agreed
		}
		s.InQueueMS = max(s.InQueueMS, e.InQueueMS)
	}
	for _, rv := range rooms {
		out.Rooms = append(out.Rooms, *rv)
	}
	slices.SortFunc(out.Rooms, func(a, b roomView) int {
		switch {
		case a.Room < b.Room:
			return -1
		case a.Room > b.Room:
			return 1
		}
		return 0
	})
	return out
}

func queuesTables(out queuesOutput) []*table {
	entries := newTable([]string{"SERVER", "ROLE", "RANK", "ID", "ROOM", "QUEUE", "POLL", "AGREED", "AGE", "PEER", "BYTES", "ABORT", "ERROR"}, "AGE")
	for _, e := range out.Entries {
		entries.add(e.Server, e.Role, itoa(e.Rank), fmt.Sprint(e.ID), fmt.Sprint(e.Room), e.Queue, e.Poll, e.Agreed,
			fmtMS(e.InQueueMS), e.Peer, itoa(e.Bytes), abortCell(e.PDEntry), e.Error)
	}
	for url, err := range sortedMap(out.Errors) {
		entries.add(url, "", "", "", "", "", "", "", "", "", "", "", "unreachable: "+err)
	}
	rooms := newTable([]string{"ROOM", "PREFILL SERVER", "P RANKS", "P QUEUE", "P POLL", "P AGE", "DECODE SERVER", "D RANKS", "D QUEUE", "D POLL", "D AGE"}, "P AGE", "D AGE")
	for _, rv := range out.Rooms {
		row := []string{fmt.Sprint(rv.Room)}
		row = append(row, sideCells(rv.Prefill)...)
		row = append(row, sideCells(rv.Decode)...)
		rooms.add(row...)
	}
	return []*table{entries, rooms}
}

// abortCell is a decode entry's ABORT: no, sent, or acked by its prefill
// rank.
func abortCell(e debug.PDEntry) string {
	switch {
	case e.Acked:
		return "acked"
	case e.AbortSent:
		return "sent"
	}
	return "no"
}

// pollRank orders KVPoll state names as the states are ordered (Failed
// lowest); an unknown name ranks above every state, so that any known
// state replaces it.
func pollRank(name string) int {
	if s, ok := pdproto.ParseKVPoll(name); ok {
		return int(s)
	}
	return int(pdproto.Success) + 1
}

// sideCells renders one side of a room: server, ranks, queue, agreed
// KVPoll, age; several groups (ranks in different queues) are joined by
// ";".
func sideCells(sides []roomSide) []string {
	var srv, ranks, queue, poll, age []string
	for _, s := range sides {
		srv = append(srv, s.Server)
		var rs []string
		for _, r := range s.Ranks {
			rs = append(rs, itoa(r))
		}
		ranks = append(ranks, strings.Join(rs, ","))
		queue = append(queue, s.Queue)
		poll = append(poll, s.Agreed)
		age = append(age, fmtMS(s.InQueueMS))
	}
	j := func(x []string) string { return strings.Join(x, ";") }
	return []string{j(srv), j(ranks), j(queue), j(poll), j(age)}
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

// sortedMap iterates m by key.
func sortedMap(m map[string]string) func(func(string, string) bool) {
	return func(yield func(string, string) bool) {
		keys := make([]string, 0, len(m))
		for k := range m {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		for _, k := range keys {
			if !yield(k, m[k]) {
				return
			}
		}
	}
}

func queuesDumpRun(ctx context.Context, opts *queuesDumpOptions) error {
	f := opts.f
	targets, err := opts.Attach.targets(ctx, f)
	if err != nil {
		return err
	}
	if !opts.Watch {
		out := readQueues(ctx, opts, targets)
		if opts.JSON {
			err = writeJSON(f.Out, out)
		} else {
			err = printTables(f, queuesTables(out)...)
		}
		if err != nil {
			return err
		}
		if len(out.Errors) > 0 {
			return &unreachableError{n: len(out.Errors), of: len(targets)}
		}
		return nil
	}
	tick := time.NewTicker(opts.Interval)
	defer tick.Stop()
	for frame := 0; ; frame++ {
		out := readQueues(ctx, opts, targets)
		if ctx.Err() != nil {
			return nil // interrupted: the watch is over
		}
		if f.OutTTY {
			io.WriteString(f.Out, "\x1b[H\x1b[2J") // home, clear
		} else if frame > 0 {
			io.WriteString(f.Out, "\n")
		}
		if err := printTables(f, queuesTables(out)...); err != nil {
			return err
		}
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
	}
}
