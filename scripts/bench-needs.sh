#!/usr/bin/env bash
# make bench's first step: what its later rows need, checked before its first row is taken. The
# standalone half takes about half an hour before the k3s section boots real k3s nodes (runc,
# mkfs.ext4, losetup) and the fleet row a cluster in network namespaces (ip, nsenter): on a fresh
# machine, a missing tool would otherwise fail make bench over an hour in.
set -euo pipefail
[ "$(id -u)" = 0 ] || { echo "make bench needs root: it runs private containerds and k3s nodes" >&2; exit 1; }
missing=()
for tool in runc:runc mkfs.ext4:e2fsprogs losetup:mount ip:iproute2 nsenter:util-linux python3:python3; do
  command -v "${tool%%:*}" >/dev/null || missing+=("${tool%%:*} (Debian: ${tool##*:})")
done
if [ ${#missing[@]} -gt 0 ]; then
  printf 'make bench: missing %s\n' "${missing[@]}" >&2
  echo "make bench: .ci/run installs them (or apt-get install runc e2fsprogs mount iproute2 util-linux python3)" >&2
  exit 1
fi
