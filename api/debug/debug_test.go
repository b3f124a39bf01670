package debug

import (
	"encoding/json"
	"math"
	"reflect"
	"regexp"
	"strings"
	"testing"
)

// TestIDJSON: an id is written as a string of decimal digits, the whole
// 64 bits exact, and read back from that string or from a JSON number; a
// negative, fractional, oversized or non-numeric value is refused.
func TestIDJSON(t *testing.T) {
	for _, v := range []ID{0, 7, 1<<53 + 1, math.MaxUint64} {
		data, err := json.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		if want := `"` + v.String() + `"`; string(data) != want {
			t.Errorf("Marshal(%d) = %s, want %s", uint64(v), data, want)
		}
		var back ID
		if err := json.Unmarshal(data, &back); err != nil || back != v {
			t.Errorf("round trip of %d: %d, %v", uint64(v), uint64(back), err)
		}
		var num ID
		if err := json.Unmarshal([]byte(v.String()), &num); err != nil || num != v {
			t.Errorf("from the number %s: %d, %v", v, uint64(num), err)
		}
	}
	for _, bad := range []string{`-1`, `1.5`, `"1.5"`, `"18446744073709551616"`, `"x"`, `""`, `true`, `" 7"`, `"0x10"`, `{}`} {
		var id ID
		if err := json.Unmarshal([]byte(bad), &id); err == nil {
			t.Errorf("Unmarshal(%s) = %d, want an error", bad, uint64(id))
		}
	}
	id := ID(9)
	if err := json.Unmarshal([]byte(`null`), &id); err != nil || id != 9 {
		t.Errorf("null: %d, %v; want the id unchanged", uint64(id), err)
	}
	// A room in an entry: a string, as jq and JavaScript need it.
	data, _ := json.Marshal(PDEntry{ID: 3, Room: 1<<63 + 5})
	if !strings.Contains(string(data), `"id":"3","room":"9223372036854775813"`) {
		t.Errorf("entry: %s", data)
	}
	var e PDEntry
	if err := json.Unmarshal([]byte(`{"id":3,"room":"9223372036854775813"}`), &e); err != nil || e.Room != 1<<63+5 || e.ID != 3 {
		t.Errorf("entry read back: %+v, %v", e, err)
	}
}

// TestConventions walks every answer type of the package: a duration field
// (a float64 one) has a name ending in _ms, a name ending in _seconds (or
// any other unit of time) exists nowhere, and a uint64 field is a count,
// never an id or a room.
func TestConventions(t *testing.T) {
	types := []any{StepsResponse{}, CollectivesResponse{}, RequestsResponse{}, AbortResponse{}, AbortAllResponse{},
		PDResponse{}, ClusterResponse{}, Settings{}, StateResponse{}, FaultsResponse{}, GPUResponse{}, DecisionsResponse{}}
	seen := map[reflect.Type]bool{}
	otherUnit := regexp.MustCompile(`_(seconds|secs|s|us|ns|minutes)$`)
	var walk func(reflect.Type, string)
	walk = func(ty reflect.Type, path string) {
		for ty.Kind() == reflect.Pointer || ty.Kind() == reflect.Slice || ty.Kind() == reflect.Map {
			ty = ty.Elem()
		}
		if ty.Kind() != reflect.Struct || seen[ty] || ty.PkgPath() != reflect.TypeOf(ID(0)).PkgPath() {
			return
		}
		seen[ty] = true
		for i := range ty.NumField() {
			f := ty.Field(i)
			name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
			where := path + "." + f.Name
			if otherUnit.MatchString(name) {
				t.Errorf("%s: JSON name %q: durations are in milliseconds, named *_ms", where, name)
			}
			if f.Type.Kind() == reflect.Float64 && strings.Contains(strings.ToLower(f.Name), "ms") != strings.HasSuffix(name, "_ms") {
				t.Errorf("%s: JSON name %q does not match its Go name's unit", where, name)
			}
			if f.Type.Kind() == reflect.Uint64 && f.Type != reflect.TypeOf(ID(0)) && (name == "id" || name == "room" || strings.HasSuffix(name, "_id")) {
				t.Errorf("%s: %q is a uint64: ids travel as debug.ID", where, name)
			}
			walk(f.Type, where)
		}
	}
	for _, v := range types {
		walk(reflect.TypeOf(v), reflect.TypeOf(v).Name())
	}
}
