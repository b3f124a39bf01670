package debug

// Fault is one fault switch of a server: a real code path, off by default,
// that reproduces a production failure.
type Fault struct {
	Name  string   `json:"name"`
	Roles []string `json:"roles"` // the server roles whose code it changes
	Doc   string   `json:"doc"`
	On    bool     `json:"on"`
}

// FaultsResponse answers GET /debug/v1/faults and the admin calls
// POST /admin/v1/faults/{name}/on|off.
type FaultsResponse struct {
	Faults []Fault `json:"faults"`
}
