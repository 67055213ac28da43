#!/usr/bin/env bash
# Checks every series of patches/k3s without a k3s checkout (the k3s module is not served here):
# SERIES names the k3s repo, the 40-hex commit the series was written against, its CLI and its
# target files; the patches are numbered git format-patch mails 1/N..N/N that git parses, whose
# targets are exactly the SERIES files; the files they add are gofmt-clean Go; every symbol they
# use from this module exists. Then `make k3s` must fail fast, with a message, when it is given no
# version or cannot reach the k3s repository.
set -euo pipefail
cd "$(dirname "$0")/.."
fail() { echo "FAIL  $*" >&2; exit 1; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT

for dir in patches/k3s/*/; do
  series=$(basename "$dir")
  meta="$dir/SERIES"
  [ -f "$meta" ] || fail "$series: no SERIES file"
  field() { sed -n "s/^$1: //p" "$meta"; }
  [ "$(field k3s-repo)" = "k3s-io/k3s" ] || fail "$series: SERIES names no k3s-repo"
  commit=$(field k3s-commit)
  [[ "$commit" =~ ^[0-9a-f]{40}$ ]] || fail "$series: SERIES k3s-commit is not a commit: '$commit'"
  [[ "$commit" == "$series"* ]] || fail "$series: directory is not named by its commit $commit"
  cli=$(field cli); [ -n "$cli" ] || fail "$series: SERIES names no cli"
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
    grep -q "$commit" "$p" || fail "$p: does not name the k3s commit $commit"
    git apply --numstat "$p" >/dev/null 2>"$tmp/err" || fail "$p: git cannot parse it: $(cat "$tmp/err")"
    while read -r _ _ f; do touched+=("$f"); done < <(git apply --numstat "$p")
    # the files the patch adds, extracted and checked as Go
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
      go doc ./pkg/agent/images "$sym" >/dev/null 2>&1 || fail "$series: ${g##*/} uses k3spinning.$sym, which pkg/agent/images does not export"
    done
  done
  rm -rf "$tmp/new"
  echo "ok    $series: $total patches, $(echo $files | wc -w) files, k3s-io/k3s $commit ($cli)"
done

# make k3s fails fast, saying what it needs.
start=$(date +%s)
if out=$(make -s k3s 2>&1); then fail "make k3s without K3S_VERSION succeeded"; fi
grep -q 'K3S_VERSION' <<<"$out" || fail "make k3s without K3S_VERSION: message does not name K3S_VERSION: $out"
if out=$(K3S_REMOTE=https://127.0.0.1:9/k3s-io/k3s.git make -s k3s K3S_VERSION=v1.35.0+k3s1 2>&1); then fail "make k3s with an unreachable repository succeeded"; fi
grep -q 'needs network access' <<<"$out" || fail "make k3s offline: message does not say it needs network access: $out"
took=$(( $(date +%s) - start ))
[ "$took" -lt 60 ] || fail "make k3s took ${took} s to fail without a version or network"
echo "ok    make k3s fails fast without K3S_VERSION and without network (${took} s)"
