#!/usr/bin/env bash
# make fuzz (FUZZTIME=60s) and the short run in make test (FUZZTIME=5s): each fuzz target for
# FUZZTIME, printing its executions. A crash fails the run, and go test writes the input that
# crashed under the package's testdata/fuzz, to be committed with the fix. Inputs are not
# minimized (-fuzzminimizetime 0x): the engine minimizes every input that finds new coverage
# before it reports, and FuzzRead's tar inputs found some every moment, so a short run spent most
# of its time minimizing and ran a few hundred inputs instead of tens of thousands. A crashing
# input is written as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
fuzztime=${FUZZTIME:-60s}
for target in ./pkg/airgap:FuzzRead ./pkg/pinning:FuzzPolicy ./pkg/agent/keep:FuzzQuickDigestRef; do
  pkg=${target%%:*} name=${target##*:}
  # The fuzzing engine itself sometimes ends a short run with a bare "context deadline exceeded"
  # and no failing input (now and then in 5 s runs): that run is tried again, once.
  # A crash writes its input under testdata/fuzz and always fails.
  for try in 1 2; do
    if out=$(go test -run '^$' -fuzz "^$name\$" -fuzztime "$fuzztime" -fuzzminimizetime 0x "$pkg" 2>&1); then break; fi
    if [ "$try" = 1 ] && grep -q 'context deadline exceeded' <<<"$out" && ! grep -q 'Failing input written to' <<<"$out"; then
      echo "note  $name: the fuzzing engine stopped with a deadline and no failing input; trying again"
      continue
    fi
    echo "$out"; echo "FAIL  $name: crashed"; exit 1
  done
  execs=$(echo "$out" | sed -n 's/.*execs: \([0-9]*\) .*/\1/p' | tail -1)
  elapsed=$(echo "$out" | sed -n 's/^fuzz: elapsed: \([0-9]*\)s, execs.*/\1/p' | tail -1)
  execs=${execs:-0} elapsed=${elapsed:-0}
  # A target renamed or gone matches nothing, and go test passes without fuzzing.
  if grep -q 'no fuzz tests to fuzz' <<<"$out"; then echo "$out"; echo "FAIL  $name: no fuzz target of that name in $pkg"; exit 1; fi
  if [ "$execs" -eq 0 ]; then
    # The whole FUZZTIME went to running the corpus cached from earlier runs (baseline coverage).
    baseline=$(sed -n 's/.*gathering baseline coverage: \([0-9]*\)\/[0-9]* completed.*/\1/p' <<<"$out" | tail -1)
    if [ "${baseline:-0}" -eq 0 ]; then echo "$out"; echo "FAIL  $name: ran no input"; exit 1; fi
    echo "ok    $name: $baseline inputs of its cached corpus run in $fuzztime (baseline coverage, no new input), no crash"
    continue
  fi
  echo "ok    $name: $execs executions in $elapsed s ($(( execs / (elapsed > 0 ? elapsed : 1) )) per second), no crash"
done
