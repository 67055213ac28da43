#!/usr/bin/env bash
# The programs a node of make cluster-e2e needs beside k3s, which a k3s release carries in its data
# dir and make k3s's offline build does not: iptables (kube-proxy's Services, flannel's
# masquerading) and the CNI plugins k3s's flannel calls (flannel, bridge, host-local, loopback,
# portmap). Into the user cache, once; prints the directory: bin/ (iptables) and cni/ (the
# plugins), both for the nodes' PATH only.
#  - iptables: Debian's packages (bookworm's 1.8.9, nf_tables backend), unpacked with dpkg-deb into
#    the cache, not installed: the host's own netfilter is not the tests' to touch, and no other
#    test (a kubelet in the host's network namespace) may find an iptables. bin/ holds wrappers
#    that point the loader at the unpacked libraries; the nodes run them inside their own network
#    namespaces only.
#  - the CNI plugins: github.com/containernetworking/plugins v0.9.1 from the Go module proxy, the
#    last release with the flannel plugin (later releases left it to flannel-io/cni-plugin, which
#    the proxy refuses, as it refuses k3s-io/plugins, the build k3s bundles), static. They speak
#    CNI up to 0.4.0: the cluster's conflist (test/e2e/cluster_test.go) says 0.4.0.
set -euo pipefail
cache=${XDG_CACHE_HOME:-$HOME/.cache}/k3s-pinning/cluster-tools
cni_version=v0.9.1
cni_plugins="meta/flannel main/bridge ipam/host-local main/loopback meta/portmap"
debs="iptables libip4tc2 libip6tc2 libxtables12 libnetfilter-conntrack3 libnfnetlink0 libmnl0 libnftnl11"
applets="iptables iptables-save iptables-restore ip6tables ip6tables-save ip6tables-restore iptables-nft iptables-nft-save iptables-nft-restore ip6tables-nft ip6tables-nft-save ip6tables-nft-restore"

if [ ! -x "$cache/bin/iptables" ] || [ ! -x "$cache/cni/flannel" ] || [ "$(cat "$cache/VERSION" 2>/dev/null)" != "$cni_version $debs" ]; then
  tmp=$cache.tmp
  rm -rf "$tmp" && mkdir -p "$tmp/debs" "$tmp/root" "$tmp/bin" "$tmp/cni"
  # shellcheck disable=SC2086 # the package names
  if ! (cd "$tmp/debs" && apt-get download $debs >/dev/null 2>&1); then
    apt-get update -qq # a fresh machine may have no package lists yet
    (cd "$tmp/debs" && apt-get download $debs >/dev/null) || { echo "cluster-tools: apt-get download $debs failed" >&2; exit 1; }
  fi
  for deb in "$tmp"/debs/*.deb; do dpkg-deb -x "$deb" "$tmp/root"; done
  # The packages' library dir (usr/lib/<machine's multiarch triplet>), as it will be once moved.
  libxtables=$(find "$tmp/root" -name 'libxtables.so.*' | head -1)
  [ -n "$libxtables" ] || { echo "cluster-tools: no libxtables in the unpacked packages" >&2; exit 1; }
  lib=$cache/${libxtables#"$tmp"/}
  lib=${lib%/*}
  for applet in $applets; do
    printf '#!/bin/sh\nLD_LIBRARY_PATH=%s XTABLES_LIBDIR=%s/xtables exec %s/root/usr/sbin/xtables-nft-multi %s "$@"\n' \
      "$lib" "$lib" "$cache" "$applet" > "$tmp/bin/$applet"
    chmod 755 "$tmp/bin/$applet"
  done
  pkgs=()
  for p in $cni_plugins; do pkgs+=("github.com/containernetworking/plugins/plugins/$p@$cni_version"); done
  (cd "$tmp" && GOBIN=$tmp/cni CGO_ENABLED=0 GOWORK=off GOFLAGS=-mod=mod go install -trimpath "${pkgs[@]}")
  rm -rf "$tmp/debs"
  echo "$cni_version $debs" > "$tmp/VERSION"
  rm -rf "$cache" && mv "$tmp" "$cache"
fi
echo "$cache"
