#!/usr/bin/env bash
# make k3s-patches-check, without building k3s (make k3s-e2e builds and runs it):
#  - every patches/k3s series: SERIES names the k3s repo, the 40-hex commit it was written against
#    and its files; the patches are numbered git format-patch mails 1/N..N/N whose targets are
#    exactly the SERIES files; added Go files are gofmt-clean and use only what this module
#    exports; and the series applies (git apply --check) to every k3s tree in ../shared/k3s-src
#    whose commit its SERIES lists under "lines:", and to one at least (no k3s tree here is a failure);
#  - each patch of patches/k3s-offline/k3s applies to every k3s tree there whose go.mod replaces a
#    module with the fork it stands in for (patches/k3s-offline/k3s/WHEN): make k3s applies it the
#    day the module proxy refuses that fork;
#  - Dockerfile.k3s installs what k3s's own build environment (Dockerfile.dapper) installs to build
#    k3s, and builds statically as k3s's CI does;
#  - make k3s with K3S_VERSION and no network fails fast, saying so.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
fail() { echo "FAIL  $*" >&2; exit 1; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
k3s_src=${K3S_SRC_DIR:-$repo/../shared/k3s-src}

# The k3s trees here, unpacked once, as git repositories, keyed by the commit their README row names.
declare -A trees=()
for archive in "$k3s_src"/k3s-release-*.tar.gz "$k3s_src"/current/k3s-*.tar.gz; do
  [ -f "$archive" ] || continue
  name=$(basename "$archive" .tar.gz)
  short=${name##*-}
  mkdir -p "$tmp/$name"
  tar -xzf "$archive" -C "$tmp/$name" --strip-components=1
  (cd "$tmp/$name" && git init -q && git add -A && git -c user.email=x@x -c user.name=x commit -qm k3s)
  trees[$short]=$tmp/$name
done
[ ${#trees[@]} -gt 0 ] || fail "no k3s archive in $k3s_src: no series can be checked against a tree (../shared/k3s-src, or K3S_SRC_DIR)"

declare -A covered=()
for dir in patches/k3s/*/; do
  series=$(basename "$dir")
  meta="$dir/SERIES"
  [ -f "$meta" ] || fail "$series: no SERIES file"
  field() { sed -n "s/^$1: //p" "$meta"; }
  [ "$(field k3s-repo)" = "k3s-io/k3s" ] || fail "$series: SERIES names no k3s-repo"
  commit=$(field k3s-commit)
  [[ "$commit" =~ ^[0-9a-f]{40}$ ]] || fail "$series: SERIES k3s-commit is not a commit: '$commit'"
  [[ "$commit" == "$series"* ]] || fail "$series: directory is not named by its commit $commit"
  files=$(field files); [ -n "$files" ] || fail "$series: SERIES names no files"
  mapfile -t patches < <(ls "$dir"*.patch 2>/dev/null)
  total=${#patches[@]}
  [ "$total" -gt 0 ] || fail "$series: no patches"
  touched=()
  for i in "${!patches[@]}"; do
    p=${patches[$i]} n=$((i + 1))
    [[ "$(basename "$p")" == $(printf '%04d' $n)-* ]] || fail "$p: not numbered $(printf '%04d' $n)"
    head -1 "$p" | grep -q '^From [0-9a-f]\{40\} ' || fail "$p: not a git format-patch mail"
    grep -q "^Subject: \[PATCH $n/$total\] " "$p" || fail "$p: subject is not [PATCH $n/$total]"
    git apply --numstat "$p" >/dev/null 2>"$tmp/err" || fail "$p: git cannot parse it: $(cat "$tmp/err")"
    while read -r _ _ f; do touched+=("$f"); done < <(git apply --numstat "$p")
    mkdir -p "$tmp/new"
    awk -v out="$tmp/new" -v n="$n" '
      /^diff --git / { f = ""; newf = 0; next }
      /^new file mode/ { newf = 1; next }
      /^\+\+\+ b\// { if (newf) { name = substr($0, 7); gsub("/", "_", name); f = out "/" n "-" name } next }
      /^@@/ { next }
      f != "" && /^\+/ { print substr($0, 2) > f }' "$p"
  done
  for f in "${touched[@]}"; do [[ " $files " == *" $f "* ]] || fail "$series: patch touches $f, not listed in SERIES"; done
  for f in $files; do printf '%s\n' "${touched[@]}" | grep -qx "$f" || fail "$series: SERIES lists $f, no patch touches it"; done
  for g in "$tmp"/new/*; do
    gofmt -e -l "$g" >"$tmp/fmt" 2>&1 || fail "$series: added file ${g##*/} does not parse: $(cat "$tmp/fmt")"
    [ ! -s "$tmp/fmt" ] || fail "$series: added file ${g##*/} is not gofmt-clean"
    for sym in $(grep -o 'k3spinning\.[A-Z][A-Za-z0-9]*' "$g" | sort -u | cut -d. -f2); do
      go doc ./pkg/k3spinning "$sym" >/dev/null 2>&1 || fail "$series: ${g##*/} uses k3spinning.$sym, which pkg/k3spinning does not export"
    done
  done
  rm -rf "$tmp/new"
  applied=()
  for short in "${!trees[@]}"; do
    grep -q "$short" <<<"$(field lines) $commit" || continue
    (cd "${trees[$short]}" && git apply --check "$repo/$dir"*.patch 2>"$tmp/err") || fail "$series: does not apply to the k3s tree at $short, which its SERIES lists: $(cat "$tmp/err")"
    applied+=("$short")
    covered[$short]=$series
  done
  if [ ${#applied[@]} -gt 0 ]; then
    echo "ok    $series: $total patches, applies to the k3s trees at ${applied[*]}"
  elif [ ${#trees[@]} -gt 0 ]; then
    fail "$series: applies to none of the k3s trees in $k3s_src (${!trees[*]}): a series is kept only for a k3s line it was written against and that can build the module"
  else
    echo "ok    $series: $total patches, well formed (no k3s tree here to apply it to)"
  fi
done

# Every k3s tree here is claimed by a series, or a SERIES says why it is dropped.
for short in "${!trees[@]}"; do
  [ -z "${covered[$short]:-}" ] || continue
  why=$(sed -n "s/^dropped: \(.*$short.*\)/\1/p" patches/k3s/*/SERIES | head -1)
  [ -n "$why" ] || fail "no series lists the k3s tree at $short under lines:, and none says under dropped: why not"
  echo "note  the k3s tree at $short is not supported: $why"
done

# The module's dependency floor fits every supported tree: no module of this go.mod is required at a
# version above the one the tree's go.mod selects (unless the tree replaces it: then k3s's replace
# decides). make k3s checks the full selection (build/k3s-versions-check.sh) but needs each line's
# module downloads; this catches a raised require without them (containerd/platforms rc.2 above
# v1.34.3's rc.1 went unseen from the first commit until 80b11e874 was built with its forks).
for short in "${!covered[@]}"; do
  go mod edit -json "${trees[$short]}/go.mod" > "$tmp/k3s-go.mod.json"
  go mod edit -json go.mod | PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=build python3 -c '
import json, sys
from semver import key
ours = json.load(sys.stdin)
k3s = json.load(open(sys.argv[1]))
replaced = {r["Old"]["Path"] for r in k3s.get("Replace") or []}
selected = {r["Path"]: r["Version"] for r in k3s.get("Require") or []}
above = []
for r in ours.get("Require") or []:
    path, version = r["Path"], r["Version"]
    if path in selected and path not in replaced and key(version) > key(selected[path]):
        above.append(f"{path} {version} (k3s: {selected[path]})")
if above:
    print("\n".join(above))
    sys.exit(1)
' "$tmp/k3s-go.mod.json" > "$tmp/above" || fail "go.mod requires more than the k3s tree at $short selects (make k3s would fail): $(tr '\n' ';' < "$tmp/above")"
  echo "ok    go.mod requires no module above what the k3s tree at $short selects"
done

for p in patches/k3s-offline/k3s/*.patch; do
  whens=$(awk -v p="$(basename "$p")" '$1==p {$1=""; print}' patches/k3s-offline/k3s/WHEN)
  [ -n "$whens" ] || fail "$p: patches/k3s-offline/k3s/WHEN does not say for which refused fork it is applied"
  for short in "${!trees[@]}"; do
    when=""
    for w in $whens; do grep -q "=> ${w%@*} ${w#*@}" "${trees[$short]}/go.mod" && when=$w; done
    if [ -z "$when" ]; then
      echo "ok    $(basename "$p"): not for the k3s tree at $short (none of the forks$whens in its go.mod)"
      continue
    fi
    (cd "${trees[$short]}" && git apply --check "$repo/$p" 2>"$tmp/err") || fail "$p does not apply to the k3s tree at $short, whose go.mod has the fork $when it stands in for: $(cat "$tmp/err")"
    echo "ok    $(basename "$p") applies to the k3s tree at $short (for the fork $when, when the proxy refuses it)"
  done
done

# Dockerfile.k3s: what k3s's build environment installs to build k3s (not its release, lint and
# upload tools), and a static build. The build environment is Dockerfile.dapper up to 1.34.3, and
# the infra stage of Dockerfile (apk and xx-apk) on the 2026 trees.
not_for_building="docker vim less curl wget npm python3 py3-pip pipx openssl-dev libffi-dev mingw-w64-gcc"
for short in "${!trees[@]}"; do
  dapper=${trees[$short]}/Dockerfile.dapper
  [ -f "$dapper" ] || dapper=${trees[$short]}/Dockerfile
  [ -f "$dapper" ] || continue
  pkgs=$(awk '/apk -U --no-cache add|apk -U add|xx-apk add/{on=1} on{sub(/&&.*/, ""); sub(/;.*/, ""); print} on && !/\\$/{on=0}' "$dapper" | head -20 | tr ' \\' '\n\n' | grep -E '^[a-z0-9][a-z0-9.+-]*$' | grep -vE '^(apk|xx-apk|add|RUN|true|mingw-w64-gcc)$' | sort -u)
  for pkg in $pkgs; do
    [[ " $not_for_building " == *" $pkg "* ]] && continue
    grep -qw -- "$pkg" Dockerfile.k3s || fail "Dockerfile.k3s does not install $pkg, which k3s's $(basename "$dapper") (tree at $short) installs to build k3s"
  done
  golang=$(sed -n 's/^ARG GOLANG=//p' "$dapper")
  grep -q "ARG GOLANG=$golang" Dockerfile.k3s || echo "note  Dockerfile.k3s's GOLANG is not $golang, k3s's at $short (set --build-arg GOLANG for that line)"
  grep -q 'STATIC_BUILD=true' Dockerfile.k3s || fail "Dockerfile.k3s does not build statically (STATIC_BUILD=true), as k3s's CI does"
  echo "ok    Dockerfile.k3s installs what k3s's $(basename "$dapper") at $short installs to build k3s"
done

# make k3s for a release fails fast, saying what it needs, without network.
start=$(date +%s)
if out=$(K3S_SOURCE='' bash scripts/build-k3s.sh 2>&1); then fail "make k3s without K3S_SOURCE or K3S_VERSION succeeded"; fi
grep -q 'K3S_SOURCE' <<<"$out" || fail "make k3s without a source: message does not name K3S_SOURCE: $out"
if out=$(K3S_REMOTE=https://127.0.0.1:9/k3s-io/k3s.git K3S_VERSION=v1.35.0+k3s1 bash scripts/build-k3s.sh 2>&1); then fail "make k3s with an unreachable repository succeeded"; fi
grep -q 'needs network access' <<<"$out" || fail "make k3s K3S_VERSION=... offline: message does not say it needs network access: $out"
took=$(( $(date +%s) - start ))
[ "$took" -lt 60 ] || fail "make k3s took ${took} s to fail without a source or network"
echo "ok    make k3s fails fast without a source, and for a release without network (${took} s)"
