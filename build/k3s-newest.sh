#!/usr/bin/env bash
# The k3s source make k3s and make k3s-e2e build by default: the newest k3s line in
# ../shared/k3s-src (master in current/ first, then current/'s release lines, then the older
# archives at the top), the newest version of that kind. Prints its path, or nothing.
set -euo pipefail
shopt -s nullglob
dir=${K3S_SRC_DIR:-$(cd "$(dirname "$0")/.." && pwd)/../shared/k3s-src}
dir=$(cd "$dir" 2>/dev/null && pwd) || exit 0
for pattern in "current/k3s-master-*.tar.gz" "current/k3s-release-*.tar.gz" "k3s-release-*.tar.gz"; do
  found=("$dir"/$pattern)
  if [ ${#found[@]} -gt 0 ]; then printf '%s\n' "${found[@]}" | sort -V | tail -1; exit 0; fi
done
