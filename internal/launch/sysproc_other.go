//go:build unix && !linux

package launch

import "syscall"

// sysProcAttr puts a child in its own process group (a stop signals the
// group; a terminal's Ctrl-C reaches only the launcher, which forwards it).
// Outside Linux there is no parent-death signal: a launcher killed with
// SIGKILL leaves its children running.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true}
}
