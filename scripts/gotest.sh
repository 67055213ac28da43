#!/usr/bin/env bash
# scripts/gotest.sh [--show] GO-TEST-ARGS...: go test -v, then a check of what it ran, so that a
# green run means the tests ran: it fails when
#  - a test was skipped (a suite that needs root, a daemon or a variable it did not get),
#  - a package ran no test ("no tests to run": a -run or -skip that matches nothing there),
#  - a -run pattern of subtests (A/B) matched no subtest at that depth (a renamed subtest),
#  - nothing passed at all.
# --show streams go test's output (the e2e tables are the point of their runs); without it the
# output is kept and printed only on failure, with go test's package lines. The last line says
# how many tests passed. GOTEST_LOG, when set, names a file that keeps the whole output.
set -euo pipefail
show=no
if [ "${1:-}" = --show ]; then show=yes; shift; fi
# The -run pattern, if any: its depth is the number of levels of subtests it selects.
run=""
args=("$@")
for i in "${!args[@]}"; do
  case "${args[$i]}" in
    -run=*) run=${args[$i]#-run=} ;;
    -run) run=${args[$((i + 1))]:-} ;;
  esac
done
if [ -n "${GOTEST_LOG:-}" ]; then
  out=$GOTEST_LOG
else
  out=$(mktemp); trap 'rm -f "$out"' EXIT
fi
rc=0
if [ "$show" = yes ]; then
  go test -v "$@" 2>&1 | tee "$out" || rc=$?
else
  go test -v "$@" > "$out" 2>&1 || rc=$?
  grep -E '^(ok|FAIL|---? FAIL|panic:)' "$out" | grep -v '^--- PASS' || true
fi
if [ "$rc" -ne 0 ]; then
  [ "$show" = yes ] || cat "$out"
  echo "FAIL: go test $*" >&2
  exit "$rc"
fi
problems=()
if grep -q -- '--- SKIP: ' "$out"; then
  problems+=("tests were skipped:")
  while IFS= read -r line; do problems+=("  $line"); done < <(grep -A1 -- '--- SKIP: ' "$out" | grep -v '^--$')
fi
if grep -q 'no tests to run' "$out"; then
  problems+=("a package ran no test (its -run or -skip matches none of its tests):")
  while IFS= read -r line; do problems+=("  $line"); done < <(grep -B1 -A2 'no tests to run' "$out" | grep -E '^(ok|testing:)')
fi
passed=$(grep -c -E '^ *--- PASS: ' "$out" || true)
[ "$passed" -gt 0 ] || problems+=("no test passed")
depth=$(tr -cd / <<<"$run" | wc -c)
if [ "$depth" -gt 0 ]; then
  # A passing subtest name with as many slashes as the pattern has.
  if ! grep -E '^ *--- PASS: ' "$out" | awk -v d="$depth" '{ if (gsub("/", "/", $3) >= d) found = 1 } END { exit !found }'; then
    problems+=("-run $run matched no subtest at depth $depth (renamed?)")
  fi
fi
if [ ${#problems[@]} -gt 0 ]; then
  [ "$show" = yes ] || cat "$out"
  printf 'FAIL: go test %s ran less than it was asked to:\n' "$*" >&2
  printf '  %s\n' "${problems[@]}" >&2
  exit 1
fi
echo "ran: $passed tests and subtests passed, none skipped (go test $*)"
