#!/usr/bin/env bash
# make docs: renders each docs/*.dot to an SVG beside it with Graphviz's dot. Each SVG records the
# sha256 of the source it was rendered from, and make test compares (internal/docs): a picture
# cannot go stale silently.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v dot >/dev/null || { echo "make docs needs Graphviz's dot (Debian: apt-get install graphviz)" >&2; exit 1; }
for src in docs/*.dot; do
  sum=$(sha256sum "$src" | cut -d' ' -f1)
  dot -Tsvg "$src" | sed "1a <!-- rendered by make docs ($(dot -V 2>&1)) from $(basename "$src"), sha256 $sum -->" > "${src%.dot}.svg"
  echo "rendered ${src%.dot}.svg from $src"
done
