#!/usr/bin/env bash
# make patches-check: for each supported kubernetes line, take k8s.io/kubernetes at the newest
# patch release the module proxy serves, `go mod vendor` it in a scratch module, apply
# patches/kubernetes to the vendor tree, build it, and run the kubelet's own
# pkg/kubelet/images unit tests together with the GC filter tests the patch adds.
# Prints one line per kubernetes line; exits 1 if any failed.
#
# The scratch modules live in the user cache dir (the Go build cache keeps the builds), never in
# the repository. KUBERNETES_LINES overrides the lines checked, e.g. KUBERNETES_LINES="1.37".
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${XDG_CACHE_HOME:-$HOME/.cache}/k3s-pinning/patches-check
lines=${KUBERNETES_LINES:-1.34 1.35 1.36 1.37}
mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9 # one check at a time on this machine: they share the scratch dirs

# releases LINE: the v<LINE>.N releases the module proxy serves, newest first. The proxy's list can
# lag behind what it serves, so the releases after the newest listed one are asked for too.
releases() {
  local line=$1 listed n
  listed=$(go list -m -versions k8s.io/kubernetes 2>/dev/null | tr ' ' '\n' | grep -E "^v${line//./\\.}\.[0-9]+$" | sort -V)
  [ -n "$listed" ] || return 0
  n=$(echo "$listed" | tail -1)
  n=${n##*.}
  while go mod download "k8s.io/kubernetes@v$line.$((n + 1))" >/dev/null 2>&1; do
    n=$((n + 1))
    listed="$listed v$line.$n"
  done
  echo $listed | tr ' ' '\n' | sort -rV
}

# scratch VERSION DIR: a module in DIR that vendors k8s.io/kubernetes VERSION's pkg/kubelet/images
# with what its tests import. Fails when a module it needs is not served (a release can be served
# before all of its staging modules are).
scratch() {
  local version=$1 dir=$2 staging gomod goversion src
  staging=v0.${version#v1.}
  rm -rf "$dir" && mkdir -p "$dir"
  gomod=$(go mod download -json "k8s.io/kubernetes@$version" | sed -n 's/.*"GoMod": "\(.*\)",/\1/p')
  goversion=$(sed -n 's/^go \([0-9.]*\)$/\1/p' "$gomod")
  {
    echo "module k3s-pinning.local/patches-check"
    echo "go $goversion"
    echo "require k8s.io/kubernetes $version"
    # k8s.io/kubernetes replaces its staging modules with ./staging dirs: use their tagged releases.
    sed -n 's#^\s*\(k8s.io/[^ ]*\) => ./staging/src/.*#replace \1 => \1 '"$staging"'#p' "$gomod"
  } >"$dir/go.mod"
  cd "$dir" || return 1
  echo 'package check' >deps.go
  echo 'import _ "k8s.io/kubernetes/pkg/kubelet/images"' >>deps.go
  GOFLAGS=-mod=mod go mod tidy || return 1
  # go mod vendor copies no test files: vendor what the package's tests import, then copy them.
  go list -f '{{join .TestImports "\n"}}{{"\n"}}{{join .XTestImports "\n"}}' k8s.io/kubernetes/pkg/kubelet/images |
    grep -v '^$' | sed 's/.*/import _ "&"/' >>deps.go
  GOFLAGS=-mod=mod go mod tidy || return 1
  src=$(go list -mod=mod -f '{{.Dir}}' k8s.io/kubernetes/pkg/kubelet/images) || return 1
  go mod vendor || return 1
  chmod -R u+w vendor
  cp "$src"/*_test.go vendor/k8s.io/kubernetes/pkg/kubelet/images/ || return 1
}

# check LINE: prints the result line; returns non-zero on failure.
check() {
  local line=$1
  local version="" skipped="" dir=$cache/$line log=$cache/$line.log
  : >"$log"
  for v in $(releases "$line"); do
    echo "== $v" >>"$log"
    if (scratch "$v" "$dir") >>"$log" 2>&1; then
      version=$v
      break
    fi
    skipped="$skipped $v"
  done
  [ -z "$skipped" ] || skipped=" (newer, not fully served:$skipped)"
  if [ -z "$version" ]; then
    echo "FAIL  kubernetes $line: no release whose modules the proxy serves$skipped (log: $log)"
    return 1
  fi
  (
    cd "$dir" || exit 1
    vendored=vendor/k8s.io/kubernetes
    "$root/build/apply-kubernetes-patches.sh" "$vendored" >>"$log" 2>&1 || { echo "patch does not apply"; exit 1; }
    go build -mod=vendor k8s.io/kubernetes/pkg/kubelet/images >>"$log" 2>&1 || { echo "patched kubelet does not build"; exit 1; }
    go vet -mod=vendor k8s.io/kubernetes/pkg/kubelet/images >>"$log" 2>&1 || { echo "go vet failed"; exit 1; }
    go test -mod=vendor -count=1 -v k8s.io/kubernetes/pkg/kubelet/images >"$dir/test.out" 2>&1
    rc=$?
    cat "$dir/test.out" >>"$log"
    passed=$(grep -c '^--- PASS: ' "$dir/test.out")
    failed=$(grep -c '^--- FAIL: ' "$dir/test.out")
    ours=$(grep -c '^--- PASS: TestGCFilter' "$dir/test.out")
    if [ $rc -ne 0 ] || [ "$ours" -eq 0 ]; then
      echo "tests failed: $failed failed, $passed passed ($ours GC filter tests passed)"
      exit 1
    fi
    echo "$passed tests passed, $ours of them the GC filter's"
  ) >"$dir.result"
  local rc=$?
  if [ $rc -eq 0 ]; then
    echo "ok    kubernetes $line ($version): patch applied, kubelet built, $(cat "$dir.result")$skipped"
  else
    echo "FAIL  kubernetes $line ($version): $(cat "$dir.result") (log: $log)$skipped"
  fi
  return $rc
}

status=0
for line in $lines; do
  check "$line" || status=1
done
exit $status
