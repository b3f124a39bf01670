#!/bin/sh
# deps.sh installs what building and testing pdkit needs on a Debian machine:
# a C compiler and the C library headers (cgo and -race), pkg-config and the
# ZeroMQ development files, then the Go modules. Go itself is not installed.
#
# It only acts on what is missing, so a second run prints nothing. System
# packages come from apt; as a non-root user it uses sudo when sudo exists.
#
# Environment: GO names the go command (default "go").
set -eu

GO=${GO:-go}

say() { printf 'deps: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }

if ! command -v "$GO" >/dev/null 2>&1; then
	die "Go is not installed (or \"$GO\" is not on PATH). pdkit needs Go 1.26 or newer: see https://go.dev/doc/install"
fi

# Each check adds the Debian package that provides what is missing.
missing=""
command -v gcc >/dev/null 2>&1 || missing="$missing gcc"
[ -e /usr/include/stdio.h ] || missing="$missing libc6-dev"
if command -v pkg-config >/dev/null 2>&1; then
	pkg-config --exists libzmq || missing="$missing libzmq3-dev"
else
	missing="$missing pkg-config libzmq3-dev"
fi

if [ -n "$missing" ]; then
	missing=${missing# }
	command -v apt-get >/dev/null 2>&1 ||
		die "missing: $missing. This machine has no apt-get; install them with its package manager."
	if [ "$(id -u)" -eq 0 ]; then
		as_root=""
	elif command -v sudo >/dev/null 2>&1; then
		as_root="sudo"
	else
		die "missing: $missing. Installing them needs root, and sudo is not available."
	fi
	say "installing $missing"
	log=$(mktemp "${TMPDIR:-/tmp}/pdkit-deps.XXXXXX")
	trap 'rm -f "$log"' EXIT
	# shellcheck disable=SC2086 # $as_root and $missing split on purpose.
	if ! { $as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
		$as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			--no-install-recommends $missing; } >"$log" 2>&1; then
		cat "$log" >&2
		die "apt-get failed; see the output above."
	fi
	if ! pkg-config --exists libzmq; then
		die "libzmq3-dev is installed but pkg-config cannot find libzmq."
	fi
fi

# Fetch the modules named in go.mod; silent when they are already cached.
cd "$(dirname "$0")/.."
out=$("$GO" mod download 2>&1) || { printf '%s\n' "$out" >&2; die "go mod download failed"; }
# A module with no requirements makes go say so; that is not news.
case $out in
"" | *"no module dependencies to download"*) ;;
*) printf '%s\n' "$out" >&2 ;;
esac
