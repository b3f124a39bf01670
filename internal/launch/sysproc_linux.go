package launch

import "syscall"

// sysProcAttr puts a child in its own process group (a stop signals the
// group; a terminal's Ctrl-C reaches only the launcher, which forwards it)
// and has Linux kill it when the launcher dies.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
}
