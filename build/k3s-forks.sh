#!/usr/bin/env bash
# make k3s from a k3s tree or archive (here, without GitHub): every github.com/k3s-io fork that
# k3s's go.mod replaces is used as k3s ships it wherever the module proxy serves it, and only a fork
# it refuses is substituted, by the upstream module the fork was made from, at the fork's version
# less its -k3sN suffix (or the version build/k3s-standins.overrides names for that fork, with its
# reason). What the proxy serves changes from day to day (../shared/k3s-src/README.md), so this is
# decided at every build, by asking the proxy for each fork, and every decision is printed.
#
# Whatever the source, k8s.io/kubernetes is a local copy (the fork, or upstream for a refused fork)
# with patches/kubernetes (the kubelet's image GC filter) applied; a refused fork's copy also gets
# patches/k3s-offline/kubernetes (the fork-only APIs k3s calls). Forks without a served upstream
# come from local trees: spegel and kube-router from the archives in ../shared/k3s-src, cri-tools
# from its upstream module with cmd/crictl made importable (k3s imports it as a package),
# cri-dockerd as an empty module (k3s's no_cri_dockerd tag). Then each patch of
# patches/k3s-offline/k3s whose fork (patches/k3s-offline/k3s/WHEN) was refused is applied to k3s.
# Writes <dir>/standins: each refused fork as path@version (empty when k3s builds with all its forks).
#
#   build/k3s-forks.sh <k3s tree> <dir for the local copies>
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
src=$(cd "${1:?k3s tree}" && pwd)
standins=${2:?dir for local copies}
srcdir=${K3S_SRC_DIR:-$repo/../shared/k3s-src}
mkdir -p "$standins"; standins=$(cd "$standins" && pwd)
cd "$src"
die() { echo "make k3s: $*" >&2; exit 1; }

# Which forks the module proxy serves today: one `go mod download` of every replace target, outside
# any module (a refused one answers with an Error and the others still download).
go mod edit -json > "$standins/go.mod.json"
python3 -c '
import json, sys
for r in json.load(open(sys.argv[1])).get("Replace") or []:
    n = r["New"]
    if n["Path"].startswith("github.com/k3s-io/") and n.get("Version"): print(n["Path"] + "@" + n["Version"])
' "$standins/go.mod.json" | sort -u > "$standins/forks.txt"
probe=$(mktemp -d)
(cd "$probe" && GOFLAGS=-mod=mod GOWORK=off go mod download -json $(cat "$standins/forks.txt") > "$standins/forks.json" 2>/dev/null) || true
rm -rf "$probe"

# The plan: one line per replace, "old target version kind note".
plan=$(python3 - "$repo/build/k3s-standins.overrides" "$standins/go.mod.json" "$standins/forks.json" "$standins/standins" <<'EOF'
import json, re, sys
mod = json.load(open(sys.argv[2]))
served, refused = {}, {}
dec = json.JSONDecoder(); text = open(sys.argv[3]).read(); i = 0
while True:
    while i < len(text) and text[i].isspace(): i += 1
    if i >= len(text): break
    d, i = dec.raw_decode(text, i)
    key = d["Path"] + "@" + d["Version"]
    if d.get("Error"): refused[key] = re.sub(r"(reading )?https?://\S+", "", d["Error"].splitlines()[0].replace(key + ":", "")).strip(" :")
    elif d.get("Dir"): served[key] = d["Dir"]
replaces = mod.get("Replace") or []
def fork_refused(prefix):  # "path@versionprefix"
    path, ver = prefix.split("@", 1)
    return any(k.startswith(path + "@" + ver) for k in refused if k.split("@")[0] == path)
overrides = {}
for line in open(sys.argv[1]):
    line = line.split("#", 1)[0].strip()
    if not line: continue
    trigger, path, version, *reason = line.split()
    if fork_refused(trigger): overrides[path] = (version, " ".join(reason) + f" (the fork {trigger}... is refused)")
def strip(v): return re.sub(r"-k3s[0-9.]*$", "", v)
with open(sys.argv[4], "w") as f:
    for r in replaces:
        key = r["New"]["Path"] + "@" + r["New"].get("Version", "")
        if key in refused: f.write(key + "\n")
seen = set()
for r in replaces:
    old, new = r["Old"]["Path"], r["New"]
    path, ver = new["Path"], new.get("Version", "")
    fork = f"{path} {ver}"
    if not path.startswith("github.com/k3s-io/"):
        if old in overrides:
            v, why = overrides[old]; seen.add(old)
            print(old, old, v, "module", f"k3s replaces it with {fork}; {why}")
        continue
    key = f"{path}@{ver}"
    if key not in refused:
        if key not in served:
            print(old, path, ver, "unknown", fork); continue
        if path == "github.com/k3s-io/kubernetes":
            print(old, "kubernetes-fork", ver, "local", fork); continue
        print(old, path, ver, "fork", fork); continue
    fork += " refused (" + refused[key].replace(" ", "_")[:80] + ")"
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
    if old not in seen and not any(r["Old"]["Path"] == old for r in replaces):
        print(old, old, v, "module", f"not replaced by k3s; {why}")
EOF
)

unpack() { # archive-name dest: the archive in ../shared/k3s-src or its current/ folder
  local archive
  archive=$(ls "$srcdir/$1" "$srcdir/current/$1" "$srcdir/../$1" 2>/dev/null | head -1)
  [ -n "$archive" ] || die "$1 not found in $srcdir: the stand-in for a k3s-io fork the proxy refuses (see ../shared/k3s-src/README.md)"
  rm -rf "$2"; mkdir -p "$2"
  tar -xzf "$archive" -C "$2" --strip-components=1
}
moddir() { go mod download -json "$1@$2" | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d.get("Dir") or ""); sys.exit(1 if d.get("Error") else 0)' || die "the module proxy does not serve $1@$2"; }
# kubernetes_copy version-dir: a writable copy of a k8s.io/kubernetes tree with the kubelet's GC filter
# (without it for K3S_WITHOUT_PINNING=1, make k3s's stock build).
kubernetes_copy() {
  local dir=$standins/kubernetes
  rm -rf "$dir"; cp -a "$1" "$dir"; chmod -R u+w "$dir"
  [ "${K3S_WITHOUT_PINNING:-}" = 1 ] || "$repo/build/apply-kubernetes-patches.sh" "$dir"
}
# depfix dir target version: patches/k3s-deps/<name>@<version>, when there is one, applied to dir (a
# writable copy of that fork) and its tests run: fixes of upstream bugs that k3s-pinning's use of
# k3s meets (the embedded registry's, issue 25), each with its regression test.
depfix() {
  local fixes p pkgs
  fixes=$repo/patches/k3s-deps/$(basename "$2")@$3
  [ -d "$fixes" ] || return 1
  for p in "$fixes"/*.patch; do
    (cd "$1" && GIT_CEILING_DIRECTORIES=$standins git apply "$p") || die "$(basename "$p") does not apply to $2 $3"
  done
  read -ra pkgs < "$fixes/TESTS"
  (cd "$1" && GOWORK=off GOFLAGS=-mod=mod go test -count=1 "${pkgs[@]}" >"$standins/depfix-$(basename "$2").log" 2>&1) || { cat "$standins/depfix-$(basename "$2").log" >&2; die "$2 $3 with patches/k3s-deps: its tests (${pkgs[*]}) fail"; }
  echo "fix:      $2 $3: patches/k3s-deps/$(basename "$fixes") applied, its tests pass (go test ${pkgs[*]})"
}

edits=()
echo "== the k3s-io forks: k3s's own where the module proxy serves them, an upstream stand-in where it refuses"
while read -r old target version kind note; do
  case "$kind:$target" in
    fork:*)
      echo "fork:     $old -> $target $version (served)"
      if [ -d "$repo/patches/k3s-deps/$(basename "$target")@$version" ]; then
        dir=$standins/$(basename "$target")
        rm -rf "$dir"; cp -a "$(moddir "$target" "$version")" "$dir"; chmod -R u+w "$dir"
        depfix "$dir" "$target" "$version"
        edits+=("-replace=$old=$dir")
      fi ;;
    unknown:*)
      die "$old: the module proxy said nothing of $note (go mod download gave neither a module nor an error)" ;;
    local:kubernetes-fork)
      kubernetes_copy "$(moddir github.com/k3s-io/kubernetes "$version")"
      # The fork's module path is k8s.io/kubernetes; the copy is replaced by directory.
      edits+=("-replace=$old=$standins/kubernetes")
      echo "fork:     $old -> github.com/k3s-io/kubernetes $version (served; local copy with patches/kubernetes applied)" ;;
    module:*)
      edits+=("-replace=$old=$target@$version")
      echo "stand-in: $old: $note -> $target $version" ;;
    local:kubernetes)
      kubernetes_copy "$(moddir k8s.io/kubernetes "$version")"
      for p in "$repo"/patches/k3s-offline/kubernetes/*.patch; do
        (cd "$standins/kubernetes" && GIT_CEILING_DIRECTORIES=$standins git apply "$p") || die "$(basename "$p") does not apply to k8s.io/kubernetes $version"
        echo "stand-in: patch $(basename "$p") applied to k8s.io/kubernetes $version"
      done
      edits+=("-replace=$old=$standins/kubernetes")
      echo "stand-in: $old: $note -> k8s.io/kubernetes $version (local copy, patches/kubernetes and patches/k3s-offline/kubernetes applied)" ;;
    local:cri-tools)
      dir=$standins/cri-tools
      rm -rf "$dir"; cp -a "$(moddir sigs.k8s.io/cri-tools "$version")" "$dir"; chmod -R u+w "$dir"
      # k3s calls crictl.Main(): the fork makes cmd/crictl a package; upstream's is package main.
      rm -f "$dir"/cmd/crictl/*_test.go
      sed -i 's/^package main$/package crictl/; s/^func main() {$/func Main() {/' "$dir"/cmd/crictl/*.go
      edits+=("-replace=$old=$dir")
      echo "stand-in: $old: $note -> sigs.k8s.io/cri-tools $version (local copy, cmd/crictl as package crictl with Main)" ;;
    local:cri-dockerd)
      dir=$standins/cri-dockerd
      rm -rf "$dir"; mkdir -p "$dir"; printf 'module github.com/Mirantis/cri-dockerd\n\ngo 1.22\n' > "$dir/go.mod"
      edits+=("-replace=$old=$dir")
      echo "stand-in: $old: $note -> an empty module (built with no_cri_dockerd: no cri-dockerd in this k3s)" ;;
    local:spegel)
      dir=$standins/spegel; unpack "spegel-$version.tar.gz" "$dir"
      depfix "$dir" "github.com/k3s-io/spegel" "$version" || true
      edits+=("-replace=$old=$dir")
      echo "stand-in: $old: $note -> spegel-$version.tar.gz (the same fork, from the archive)" ;;
    local:kube-router)
      dir=$standins/kube-router; unpack "kube-router-$version.tar.gz" "$dir"
      edits+=("-replace=$old=$dir")
      echo "stand-in: $old: $note -> github.com/cloudnativelabs/kube-router $version (upstream, from the archive)" ;;
    *) die "no stand-in for $old ($note)";;
  esac
done <<<"$plan"
[ ${#edits[@]} -eq 0 ] || go mod edit "${edits[@]}"
echo "== $(grep -c . "$standins/forks.txt") forks: $(( $(grep -c . "$standins/forks.txt") - $(grep -c . "$standins/standins" || true) )) served, $(grep -c . "$standins/standins" || true) stood in for"

# Modules other than the forks whose version k3s requires the proxy refuses too (seen: k3s-io's
# helm-controller v0.16.26 and rancher's dynamiclistener at a July 2026 commit, both required by
# release-1.34 at 75826e8af): each is replaced by the next release of the same minor that the
# proxy serves, found one at a time as loading the build's modules meets it.
for _ in $(seq 1 20); do
  err=$(GOFLAGS=-mod=mod go list -e -deps ./cmd/server 2>&1 >/dev/null | grep -m1 -E '^go: [^ ]+@[^ ]+: reading .*(403|404|410)' || true)
  [ -n "$err" ] || break
  mod=$(sed -E 's/^go: ([^ ]+)@([^ :]+): .*/\1/' <<<"$err") version=$(sed -E 's/^go: ([^ ]+)@([^ :]+): .*/\2/' <<<"$err")
  minor=$(cut -d. -f1-2 <<<"$version")
  override=$(awk -v key="$mod@$version" -v mod="$mod" '!/^#/ && NF >= 3 && index(key, $1) == 1 && $2 == mod {$1 = ""; $2 = ""; print; exit}' "$repo/build/k3s-standins.overrides")
  if [ -n "$override" ]; then
    read -r next why <<<"$override"
    echo "$mod@$version" >> "$standins/standins"
    adapt=$repo/patches/k3s-offline/$(basename "$mod")
    if [ -d "$adapt" ]; then
      # A stand-in that needs adapting to the line's kubernetes: a local copy with those patches.
      dir=$standins/$(basename "$mod")
      rm -rf "$dir"; cp -a "$( (cd "$standins" && GOWORK=off go mod download -json "$mod@$next") | python3 -c 'import json,sys; print(json.load(sys.stdin).get("Dir") or "")')" "$dir" || die "the module proxy does not serve $mod@$next"
      chmod -R u+w "$dir"
      for p in "$adapt"/*.patch; do
        (cd "$dir" && GIT_CEILING_DIRECTORIES=$standins git apply "$p") || die "$(basename "$p") does not apply to $mod $next"
      done
      go mod edit -replace="$mod=$dir"
      echo "stand-in: $mod: $version refused by the module proxy -> $next, local copy with patches/k3s-offline/$(basename "$mod") ($why)"
    else
      go mod edit -replace="$mod=$mod@$next"
      echo "stand-in: $mod: $version refused by the module proxy -> $next ($why)"
    fi
    continue
  fi
  # The first served version of the same minor after the refused one, by semver (a pseudo-version
  # v0.8.4-0.<date>-<commit> comes before the release v0.8.4).
  # (asked outside the k3s module, which cannot load the refused version)
  next=$( (cd "$standins" && GOWORK=off go list -m -versions "$mod") | PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=$repo/build python3 -c '
import sys
from semver import key
want, minor = sys.argv[1], sys.argv[2]
later = [v for v in sys.stdin.read().split()[1:] if v.startswith(minor + ".") and key(v) > key(want)]
print(min(later, key=key) if later else "")' "$version" "$minor") || die "cannot list the versions of $mod the module proxy serves"
  [ -n "$next" ] || die "the module proxy refuses $mod@$version, which k3s requires, and serves no later $minor.x"
  go mod edit -replace="$mod=$mod@$next"
  echo "$mod@$version" >> "$standins/standins"
  echo "stand-in: $mod: $version refused by the module proxy -> $next (the next release of $minor served)"
done

# A local copy whose go.mod needs a newer Go raises the tree's go directive (the go command would
# do it at its first write of go.mod); done here so that it is said, and is not taken for a change
# that adding k3s-pinning made.
have=$(go mod edit -json | python3 -c 'import json,sys; print(json.load(sys.stdin)["Go"])')
for d in "$standins"/*/; do
  [ -f "$d/go.mod" ] || continue
  need=$(sed -n 's/^go //p' "$d/go.mod")
  if [ -n "$need" ] && [ "$(printf '%s\n%s\n' "$have" "$need" | sort -V | tail -1)" != "$have" ]; then
    echo "go directive $have -> $need ($(sed -n 's/^module //p' "$d/go.mod") from $(basename "$d") requires it)"
    go mod edit -go="$need"; have=$need
  fi
done

# The offline patches to k3s, each for a fork that was refused (patches/k3s-offline/k3s/WHEN).
while read -r patch whens; do
  case "$patch" in ''|'#'*) continue;; esac
  for when in $whens; do
    grep -q "^${when%@*}@${when#*@}" "$standins/standins" || continue
    p=$repo/patches/k3s-offline/k3s/$patch
    git apply --check "$p" 2>/dev/null || die "$patch (for the refused fork $when) does not apply to this k3s tree"
    git am --quiet "$p"
    echo "stand-in: patch $patch applied to k3s (the fork $when is refused)"
    break
  done
done < "$repo/patches/k3s-offline/k3s/WHEN"
