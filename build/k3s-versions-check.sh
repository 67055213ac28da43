#!/usr/bin/env bash
# make k3s, step 3: adding k3s-pinning must not change a version k3s selected. Compares two
# `go list -m all` listings of the k3s tree (before and after the module is required), each with a
# first line "go <directive>", by the version each module is built at (the right side of a
# replace). Modules only k3s-pinning brings in are listed and allowed; any other change fails,
# naming the module, its version before and after.
#
#   build/k3s-versions-check.sh <before> <after>
set -euo pipefail
before=${1:?before} after=${2:?after}
grep -q '^github.com/k3s-pinning/k3s-pinning ' "$after" || { echo "make k3s: $after does not list github.com/k3s-pinning/k3s-pinning" >&2; exit 1; }
effective() { # path built-version, one per module
  awk '$1=="go"{print "go", $2; next} {v=$2; if ($3=="=>") v=($5!="" ? $5 : $4); print $1, v}' "$1" | sort
}
changed=$(join -a2 -e NONE -o 0,1.2,2.2 <(effective "$before") <(effective "$after") | awk '$2!=$3')
added=$(awk '$2=="NONE"' <<<"$changed")
raised=$(awk '$2!="NONE" && $1!="github.com/k3s-pinning/k3s-pinning"' <<<"$changed")
if [ -n "$added" ]; then
  echo "== modules only k3s-pinning brings in (allowed):"
  awk '{print "   ", $1, $3}' <<<"$added"
fi
if [ -n "$raised" ]; then
  echo "make k3s: adding github.com/k3s-pinning/k3s-pinning changes versions k3s selected (its go.mod must require no more than k3s does):" >&2
  awk '{print "   ", $1, $2, "->", $3}' <<<"$raised" >&2
  exit 1
fi
echo "== adding github.com/k3s-pinning/k3s-pinning changed no version k3s selected ($(grep -vc '^go ' "$before") modules)"
