package pdproto

// Roles of a pdkit server.
const (
	RoleColocated = "colocated"
	RolePrefill   = "prefill"
	RoleDecode    = "decode"
	RoleRouter    = "router"
)

// InfoPath is where every pdkit server describes itself (GET, JSON
// ServerInfo); a router reads it to learn each server's role, TP size and,
// for a prefill server, its bootstrap registry.
const InfoPath = "/pd/v1/info"

// ServerInfo is the answer of InfoPath.
type ServerInfo struct {
	// ID names this run of the server (random, new at every start): a
	// router signs each PD request for the ID of the server it sends it
	// to, and a server refuses one signed for another.
	ID     string `json:"id,omitempty"`
	Role   string `json:"role"`
	Model  string `json:"model"`
	TPSize int    `json:"tp_size"`
	// BootstrapURL is the prefill server's registry base URL (for example
	// http://127.0.0.1:8998), which a router hands to the decode side in
	// the request's bootstrap_url; empty on other roles.
	BootstrapURL string `json:"bootstrap_url,omitempty"`
	// ContextTokens and TokenBytes are the server's prompt bound (its
	// model's context length, and the most bytes of prompt text one of
	// its tokens stands for): a router refuses a prompt that cannot fit
	// before it forwards any of it. Zero from a server that reports none.
	ContextTokens int `json:"context_tokens,omitempty"`
	TokenBytes    int `json:"token_bytes,omitempty"`
}
