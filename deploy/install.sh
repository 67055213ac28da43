#!/bin/sh
# Install k3s-pinning offline, from the files beside this script (make release's dist/): the
# binary for this machine's architecture, checked against sha256sum.txt, the systemd unit and its
# defaults file; then, with systemd running and no DESTDIR, enable and start the unit. Running it
# again changes nothing. Environment:
#   DESTDIR                          install under this root instead (no systemctl)
#   INSTALL_K3S_PINNING_BIN_DIR      where the binary goes (default /usr/local/bin)
#   INSTALL_K3S_PINNING_SKIP_START   true: install and enable nothing more
set -eu

fail() {
	echo "install.sh: $*" >&2
	exit 1
}

here=$(cd "$(dirname "$0")" && pwd)
destdir=${DESTDIR:-}
bindir=${INSTALL_K3S_PINNING_BIN_DIR:-/usr/local/bin}

case $(uname -m) in
x86_64 | amd64) arch=amd64 ;;
aarch64 | arm64) arch=arm64 ;;
armv7l | armv7 | armhf) arch=arm ;;
*) fail "no k3s-pinning binary for $(uname -m) (there are amd64, arm64 and arm v7)" ;;
esac
bin=k3s-pinning-linux-$arch
[ -f "$here/$bin" ] || fail "$here/$bin is missing: copy it beside this script"
[ -f "$here/sha256sum.txt" ] || fail "$here/sha256sum.txt is missing: copy it beside this script"
want=$(awk -v f="$bin" '$2 == f || $2 == "*" f { print $1 }' "$here/sha256sum.txt")
[ -n "$want" ] || fail "$bin is not listed in sha256sum.txt"
got=$(sha256sum "$here/$bin" | awk '{ print $1 }')
[ "$want" = "$got" ] || fail "$bin: sha256 $got, sha256sum.txt says $want: not installed"

changed=false
# put SRC DEST MODE: install SRC as DEST unless DEST already holds the same bytes.
put() {
	if [ -f "$2" ] && cmp -s "$1" "$2"; then
		return 0
	fi
	mkdir -p "$(dirname "$2")"
	tmp="$2.install-$$"
	cp "$1" "$tmp"
	chmod "$3" "$tmp"
	mv -f "$tmp" "$2"
	echo "installed $2"
	changed=true
}

put "$here/$bin" "$destdir$bindir/k3s-pinning" 0755
unit=$(mktemp)
trap 'rm -f "$unit"' EXIT
sed "s#@BINDIR@#$bindir#" "$here/k3s-pinning.service" >"$unit"
put "$unit" "$destdir/etc/systemd/system/k3s-pinning.service" 0644
# The operator's flags: written once, never replaced.
if [ ! -f "$destdir/etc/default/k3s-pinning" ]; then
	put "$here/k3s-pinning.default" "$destdir/etc/default/k3s-pinning" 0644
fi

if [ -n "$destdir" ] || [ "${INSTALL_K3S_PINNING_SKIP_START:-}" = true ] || [ ! -d /run/systemd/system ] || ! command -v systemctl >/dev/null 2>&1; then
	echo "k3s-pinning installed in $destdir$bindir; not started (start it with: systemctl enable --now k3s-pinning)"
	exit 0
fi
if [ "$changed" = true ]; then
	systemctl daemon-reload
	systemctl restart k3s-pinning 2>/dev/null || true
fi
systemctl enable --now k3s-pinning
echo "k3s-pinning installed and running (systemctl status k3s-pinning)"
