#!/usr/bin/env bash
# The release artifacts, checked from outside (in make test): make release on this tree, then
# sha256sum.txt verifies; the amd64 binary runs and prints its version; the arm64 and arm binaries
# are static ELF files for their machine (read from their headers, not run); the .deb installs
# with dpkg into this machine with the documented files and modes, enables nothing, and purges
# cleanly; the .rpm's file list is read back with rpm; install.sh passes shellcheck as POSIX sh,
# installs into a temp root and a second run changes nothing. Needs root (dpkg), rpm, shellcheck.
set -euo pipefail
cd "$(dirname "$0")/.."
fail() { echo "FAIL  $*" >&2; exit 1; }
ok() { echo "ok    $*"; }
for tool in rpm shellcheck dpkg readelf; do
  command -v $tool >/dev/null || fail "$tool is missing (.ci/run installs it)"
done
[ "$(id -u)" = 0 ] || fail "needs root: the .deb is installed into this machine"

version=release-check
VERSION=$version bash scripts/release.sh
cd dist
sha256sum --quiet -c sha256sum.txt || fail "sha256sum.txt does not verify"
ok "sha256sum.txt verifies $(wc -l < sha256sum.txt) files"

out=$(./k3s-pinning-linux-amd64 --version)
[ "$out" = "k3s-pinning version $version" ] || fail "k3s-pinning-linux-amd64 --version: $out"
ok "k3s-pinning-linux-amd64 --version: $out"
for pair in amd64:X86-64 arm64:AArch64 arm:ARM; do # readelf's names
  arch=${pair%%:*} machine=${pair#*:}
  bin=k3s-pinning-linux-$arch
  readelf -h "$bin" | grep -q "Machine:.* $machine\$" || fail "$bin is not an ELF for $machine: $(readelf -h "$bin" | grep Machine)"
  ! readelf -l "$bin" | grep -q INTERP || fail "$bin asks for a dynamic loader: not static"
  # Go writes no ARM attributes section; its build information names GOARM.
  if [ "$arch" = arm ]; then
    go version -m "$bin" | grep -q "GOARM=7" || fail "$bin is not built for ARM v7: $(go version -m "$bin" | grep GOARM)"
  fi
  ok "$bin: static ELF for $machine ($(stat -c %s "$bin") bytes)"
done

deb=$(ls k3s-pinning_*_amd64.deb)
if dpkg -s k3s-pinning >/dev/null 2>&1; then
  fail "a k3s-pinning package is installed on this machine already: not touching it"
fi
cleanup() { dpkg -P k3s-pinning >/dev/null 2>&1 || true; }
trap cleanup EXIT
dpkg -i "$deb" >/dev/null
for f in /usr/bin/k3s-pinning:755 /usr/lib/systemd/system/k3s-pinning.service:644 /etc/default/k3s-pinning:644; do
  path=${f%:*} mode=${f#*:}
  [ "$(stat -c %a "$path")" = "$mode" ] || fail "$deb installed $path with mode $(stat -c %a "$path"), want $mode"
done
[ "$(/usr/bin/k3s-pinning --version)" = "k3s-pinning version $version" ] || fail "the installed binary's version"
grep -q '^ExecStart=/usr/bin/k3s-pinning run \$K3S_PINNING_ARGS$' /usr/lib/systemd/system/k3s-pinning.service || fail "the packaged unit's ExecStart"
[ ! -e /etc/systemd/system/multi-user.target.wants/k3s-pinning.service ] || fail "installing the .deb enabled the unit"
dpkg-query -W -f='${Conffiles}\n' k3s-pinning | grep -q /etc/default/k3s-pinning || fail "/etc/default/k3s-pinning is not a conffile"
dpkg -P k3s-pinning >/dev/null
for path in /usr/bin/k3s-pinning /usr/lib/systemd/system/k3s-pinning.service /etc/default/k3s-pinning; do
  [ ! -e "$path" ] || fail "$path left after dpkg -P"
done
trap - EXIT
ok "$deb: installs /usr/bin/k3s-pinning 0755, the unit 0644, /etc/default/k3s-pinning 0644 (conffile), enables nothing, purges cleanly"

for rpmfile in k3s-pinning-*.rpm; do
  files=$(rpm -qlp "$rpmfile" 2>/dev/null | sort | tr '\n' ' ')
  [ "$files" = "/etc/default/k3s-pinning /usr/bin/k3s-pinning /usr/lib/systemd/system/k3s-pinning.service " ] || fail "$rpmfile lists: $files"
  rpm -qp --qf '%{ARCH}\n' "$rpmfile" 2>/dev/null | grep -qx "x86_64\|aarch64\|armv7hl" || fail "$rpmfile arch: $(rpm -qp --qf '%{ARCH}' "$rpmfile" 2>/dev/null)"
done
ok "rpm file lists: /usr/bin/k3s-pinning, the unit, /etc/default/k3s-pinning ($(ls k3s-pinning-*.rpm | wc -l) packages)"

shellcheck -s sh install.sh || fail "shellcheck install.sh"
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
first=$(DESTDIR=$root sh install.sh)
grep -q "installed $root/usr/local/bin/k3s-pinning" <<<"$first" || fail "install.sh: $first"
[ "$(stat -c %a "$root/usr/local/bin/k3s-pinning")" = 755 ] || fail "install.sh: binary mode"
grep -q "^ExecStart=/usr/local/bin/k3s-pinning run" "$root/etc/systemd/system/k3s-pinning.service" || fail "install.sh: the unit's ExecStart"
second=$(DESTDIR=$root sh install.sh)
! grep -q "^installed" <<<"$second" || fail "install.sh run twice changed: $second"
echo "operator's flags" > "$root/etc/default/k3s-pinning"
DESTDIR=$root sh install.sh >/dev/null
[ "$(cat "$root/etc/default/k3s-pinning")" = "operator's flags" ] || fail "install.sh replaced /etc/default/k3s-pinning"
cp k3s-pinning-linux-amd64 "$root/bad" && printf x >> "$root/bad"
mkdir "$root/dist" && cp install.sh k3s-pinning.service k3s-pinning.default sha256sum.txt "$root/dist/" && cp "$root/bad" "$root/dist/k3s-pinning-linux-amd64"
if DESTDIR=$root/other sh "$root/dist/install.sh" 2>/dev/null; then fail "install.sh installed a binary whose sha256 does not match"; fi
[ ! -e "$root/other/usr/local/bin/k3s-pinning" ] || fail "install.sh left a bad binary behind"
ok "install.sh: shellcheck, into a temp root, a second run changes nothing, the operator's defaults kept, a bad sha256 refused"

echo "== release artifacts (make release):"
awk '{ print $2 }' sha256sum.txt | while read -r f; do printf '%12d  %s\n' "$(stat -c %s "$f")" "$f"; done
