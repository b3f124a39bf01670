#!/bin/sh
# cuda-headers.sh fetches the few CUDA 11.8 files that compiling (not running)
# pdkit's -tags cuda build needs: cuda.h, nvrtc.h and the libcuda/libnvrtc link
# stubs. They come from Debian bookworm's nvidia-cuda-dev package (non-free),
# downloaded with a private apt configuration: nothing is installed and the
# system's apt sources are left alone.
#
# It prints the cache directory on stdout, holding include/ and lib/, for
#   CGO_CFLAGS=-I$dir/include CGO_LDFLAGS=-L$dir/lib
# Progress goes to stderr. A second run finds the files and prints only the path.
#
# Environment:
#   PDKIT_HOME     cache root (default ~/.cache/pdkit); files land in $PDKIT_HOME/cuda
#   DEBIAN_MIRROR  Debian mirror URL (default: the one the system's apt sources use
#                  for bookworm, else http://deb.debian.org/debian)
set -eu

dir=${PDKIT_HOME:-$HOME/.cache/pdkit}/cuda
files="include/cuda.h include/nvrtc.h lib/libcuda.so lib/libnvrtc.so"

have_all() {
	for f in $files; do
		[ -s "$dir/$f" ] || return 1
	done
}

if have_all; then
	echo "$dir"
	exit 0
fi

say() { printf 'cuda-headers: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }

for tool in apt-get dpkg-deb tar; do
	command -v "$tool" >/dev/null 2>&1 || die "$tool is needed (this recipe works on Debian and its derivatives)"
done

# mirror prints the first mirror URL that the system's apt sources use for the
# bookworm suite, in either the one-line or the deb822 format.
mirror() {
	for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
		[ -r "$f" ] || continue
		awk '$1 == "deb" {
			i = 2
			if ($i ~ /^\[/) { while ($i !~ /\]$/) i++; i++ }
			if ($(i + 1) == "bookworm") { print $i; exit }
		}' "$f"
	done
	for f in /etc/apt/sources.list.d/*.sources; do
		[ -r "$f" ] || continue
		awk '
		function flush() {
			if (uri != "" && suites ~ /(^| )bookworm( |$)/) { print uri; exit }
			uri = ""; suites = ""
		}
		/^[ \t]*$/ { flush(); next }
		/^URIs:/ { uri = $2 }
		/^Suites:/ { sub(/^Suites:[ \t]*/, ""); suites = $0 }
		END { flush() }' "$f"
	done
}

url=${DEBIAN_MIRROR:-$(mirror | head -n 1)}
url=${url:-http://deb.debian.org/debian}

work=$(mktemp -d "${TMPDIR:-/tmp}/pdkit-cuda.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/deb"

keyring=/usr/share/keyrings/debian-archive-keyring.gpg
opts=""
[ -r "$keyring" ] && opts=" [signed-by=$keyring]"
echo "deb$opts $url bookworm non-free" >"$work/sources.list"

set -- -q -o Dir::Etc::SourceList="$work/sources.list" -o Dir::Etc::SourceParts=/dev/null \
	-o Dir::State::Lists="$work/lists" -o Dir::Cache="$work/cache" \
	-o Acquire::Languages=none
# As root apt downloads as the _apt user, which cannot write to a private
# temporary directory; keep the download with the caller instead.
[ "$(id -u)" -eq 0 ] && set -- "$@" -o APT::Sandbox::User=root

say "reading the package index of $url bookworm non-free"
apt-get "$@" update >"$work/log" 2>&1 || { cat "$work/log" >&2; die "apt-get update failed"; }
say "downloading nvidia-cuda-dev (about 770 MB)"
(cd "$work/deb" && apt-get "$@" download nvidia-cuda-dev) >"$work/log" 2>&1 ||
	{ cat "$work/log" >&2; die "apt-get download nvidia-cuda-dev failed"; }

say "extracting cuda.h, nvrtc.h and the link stubs"
deb=$(ls "$work"/deb/*.deb)
stubs=usr/lib/x86_64-linux-gnu/stubs
dpkg-deb --fsys-tarfile "$deb" |
	tar -x -C "$work" ./usr/include/cuda.h ./usr/include/nvrtc.h ./$stubs/libcuda.so ./$stubs/libnvrtc.so ||
	die "the package does not hold the expected files"
rm -f "$deb"

# Move the files into place only once all of them are there.
mkdir -p "$dir.tmp/include" "$dir.tmp/lib"
cp "$work/usr/include/cuda.h" "$work/usr/include/nvrtc.h" "$dir.tmp/include/"
cp "$work/$stubs/libcuda.so" "$work/$stubs/libnvrtc.so" "$dir.tmp/lib/"
rm -rf "$dir"
mv "$dir.tmp" "$dir"
have_all || die "files missing in $dir after extraction"
say "done: $dir"
echo "$dir"
