#!/usr/bin/env bash
# Offline only: make a k3s tree build without the github.com/k3s-io forks, which the module proxy
# refuses. Every go.mod replace that points at a k3s-io fork is substituted by the upstream module
# the fork was made from, at the fork's version less its -k3sN suffix, except where
# build/k3s-offline.overrides names another version for this kubernetes line (with its reason).
# Forks that have no served upstream come from local trees: spegel and kube-router from the
# archives beside the k3s archive (K3S_SRC_DIR), cri-tools from its upstream module with
# cmd/crictl made importable (k3s imports it as a package), cri-dockerd as an empty module (the
# offline build uses k3s's no_cri_dockerd tag). k8s.io/kubernetes is a local copy of the upstream
# module with patches/kubernetes (the kubelet GC filter) and patches/k3s-offline/kubernetes (the
# fork-only APIs k3s calls) applied; then patches/k3s-offline/k3s is applied to the k3s tree.
# Prints every substitution and patch. A networked build never runs this.
#
#   build/k3s-offline.sh <k3s tree> <dir for the local stand-ins>
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
src=$(cd "${1:?k3s tree}" && pwd)
standins=${2:?dir for stand-ins}
srcdir=${K3S_SRC_DIR:-$repo/../shared/k3s-src}
mkdir -p "$standins"; standins=$(cd "$standins" && pwd)
cd "$src"
die() { echo "make k3s (offline): $*" >&2; exit 1; }

k8s_minor=$(go mod edit -json | python3 -c 'import json,sys; v=[r["Version"] for r in json.load(sys.stdin)["Require"] if r["Path"]=="k8s.io/kubernetes"][0]; print(".".join(v.lstrip("v").split(".")[:2]))')

# The substitution plan: one line per replace, "old-path new-path-or-dir new-version kind note".
go mod edit -json > "$standins/go.mod.json"
plan=$(python3 - "$repo/build/k3s-offline.overrides" "$k8s_minor" "$standins/go.mod.json" <<'EOF'
import json, re, sys
mod = json.load(open(sys.argv[3]))
overrides = {}
for line in open(sys.argv[1]):
    line = line.split("#", 1)[0].strip()
    if not line: continue
    minor, path, version, *reason = line.split()
    if minor == sys.argv[2]: overrides[path] = (version, " ".join(reason))
def strip(v): return re.sub(r"-k3s[0-9.]*$", "", v)
seen = set()
for r in mod.get("Replace") or []:
    old, new = r["Old"]["Path"], r["New"]
    path, ver = new["Path"], new.get("Version", "")
    if not path.startswith("github.com/k3s-io/"):
        if old in overrides:
            v, why = overrides[old]; seen.add(old)
            print(old, old, v, "module", f"k3s replaces it with {path} {ver}; {why}")
        continue
    fork = f"{path} {ver}"
    if path == "github.com/k3s-io/kubernetes":
        print(old, "kubernetes", strip(ver), "local", fork); continue
    m = re.match(r"github.com/k3s-io/kubernetes/staging/src/(.*)", path)
    if m:
        v = "v0." + strip(ver).split(".", 1)[1]
        print(old, m.group(1), v, "module", fork); continue
    if path.startswith("github.com/k3s-io/etcd/"):
        print(old, "go.etcd.io/etcd/" + path[len("github.com/k3s-io/etcd/"):], strip(ver), "module", fork); continue
    if path == "github.com/k3s-io/cri-tools":
        print(old, "cri-tools", strip(ver), "local", fork); continue
    if path == "github.com/k3s-io/cri-dockerd":
        print(old, "cri-dockerd", strip(ver), "local", fork); continue
    if path == "github.com/k3s-io/spegel":
        print(old, "spegel", ver, "local", fork); continue
    if path.startswith("github.com/k3s-io/kube-router"):
        print(old, "kube-router", strip(ver), "local", fork); continue
    v, why = overrides.get(old, (strip(ver), "")); seen.add(old)
    print(old, old, v, "module", fork + ("; " + why if why else ""))
for old, (v, why) in overrides.items():
    if old not in seen and not any(r["Old"]["Path"] == old for r in mod.get("Replace") or []):
        print(old, old, v, "module", f"not replaced by k3s; {why}")
EOF
)

unpack() { # archive-name dest: the archive beside the k3s archive, unpacked once
  local archive=$srcdir/$1 dest=$2
  [ -f "$archive" ] || die "$archive not found: the stand-in for a k3s-io fork the proxy does not serve (see ../shared/k3s-src/README.md)"
  rm -rf "$dest"; mkdir -p "$dest"
  tar -xzf "$archive" -C "$dest" --strip-components=1
}
moddir() { go mod download -json "$1@$2" | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d.get("Dir") or ""); sys.exit(1 if d.get("Error") else 0)' || die "the module proxy does not serve $1@$2"; }

edits=()
echo "== offline: substitutions for the k3s-io forks (a networked build uses the forks)"
while read -r old target version kind note; do
  case "$kind:$target" in
    module:*)
      edits+=("-replace=$old=$target@$version")
      echo "offline: $old: $note -> $target $version" ;;
    local:kubernetes)
      dir=$standins/kubernetes
      rm -rf "$dir"; cp -a "$(moddir k8s.io/kubernetes "$version")" "$dir"; chmod -R u+w "$dir"
      "$repo/build/apply-kubernetes-patches.sh" "$dir"
      for p in "$repo"/patches/k3s-offline/kubernetes/*.patch; do
        (cd "$dir" && GIT_CEILING_DIRECTORIES=$(dirname "$dir") git apply "$p") || die "$(basename "$p") does not apply to k8s.io/kubernetes $version"
        echo "offline: patch $(basename "$p") applied to k8s.io/kubernetes $version"
      done
      edits+=("-replace=$old=$dir")
      echo "offline: $old: $note -> k8s.io/kubernetes $version (local copy, patches/kubernetes and patches/k3s-offline/kubernetes applied)" ;;
    local:cri-tools)
      dir=$standins/cri-tools
      rm -rf "$dir"; cp -a "$(moddir sigs.k8s.io/cri-tools "$version")" "$dir"; chmod -R u+w "$dir"
      # k3s calls crictl.Main(): the fork makes cmd/crictl a package; upstream's is package main.
      rm -f "$dir"/cmd/crictl/*_test.go
      sed -i 's/^package main$/package crictl/; s/^func main() {$/func Main() {/' "$dir"/cmd/crictl/*.go
      edits+=("-replace=$old=$dir")
      echo "offline: $old: $note -> sigs.k8s.io/cri-tools $version (local copy, cmd/crictl as package crictl with Main)" ;;
    local:cri-dockerd)
      dir=$standins/cri-dockerd
      rm -rf "$dir"; mkdir -p "$dir"; printf 'module github.com/Mirantis/cri-dockerd\n\ngo 1.22\n' > "$dir/go.mod"
      edits+=("-replace=$old=$dir")
      echo "offline: $old: $note -> an empty module (built with no_cri_dockerd: no cri-dockerd in this k3s)" ;;
    local:spegel)
      dir=$standins/spegel; unpack "spegel-$version.tar.gz" "$dir"
      edits+=("-replace=$old=$dir")
      echo "offline: $old: $note -> spegel-$version.tar.gz (the same fork, from the archive)" ;;
    local:kube-router)
      dir=$standins/kube-router; unpack "kube-router-$version.tar.gz" "$dir"
      edits+=("-replace=$old=$dir")
      echo "offline: $old: $note -> github.com/cloudnativelabs/kube-router $version (upstream, from the archive)" ;;
    *) die "no stand-in for $old ($note)";;
  esac
done <<<"$plan"
go mod edit "${edits[@]}"

# A local stand-in whose go.mod needs a newer Go raises the tree's go directive (the go command
# would do it at its first write of go.mod); done here so that it is said, and is not taken for a
# change that adding k3s-pinning made.
have=$(go mod edit -json | python3 -c 'import json,sys; print(json.load(sys.stdin)["Go"])')
for d in "$standins"/*/; do
  [ -f "$d/go.mod" ] || continue
  need=$(sed -n 's/^go //p' "$d/go.mod")
  if [ -n "$need" ] && [ "$(printf '%s\n%s\n' "$have" "$need" | sort -V | tail -1)" != "$have" ]; then
    echo "offline: go directive $have -> $need ($(sed -n 's/^module //p' "$d/go.mod") from $(basename "$d") requires it)"
    go mod edit -go="$need"; have=$need
  fi
done

for p in "$repo"/patches/k3s-offline/k3s/*.patch; do
  [ -f "$p" ] || continue
  git apply --check "$p" 2>/dev/null || die "$(basename "$p") does not apply to this k3s tree"
  git am --quiet "$p"
  echo "offline: patch $(basename "$p") applied to k3s"
done
