#!/usr/bin/env bash
# Makes sure this machine can run kf-env's node mode (`kf-env up --node`): the Debian packages
# the node uses (containerd, runc, the CNI plugins, iptables, socat, conntrack) are installed with
# apt-get when missing, and the kernel features the node needs are there. Anything that cannot
# be fixed from here fails with a message saying what is missing — never a silent skip.
#
# This script owns that job. On success it records so in $stamp (under /run: kernel features
# and packages are checked once per boot, and again whenever this script changes); kf-env and the
# node tests only check that record (--check), so a test run installs and probes once.
#
# Usage: hack/node-prereqs.sh            prepare and check (a no-op when already done this boot)
#        hack/node-prereqs.sh --check    only say whether it was done; never installs anything
set -euo pipefail

say() { printf '[node prereqs %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { say "error: $*"; exit 1; }

stamp=/run/kube-fence-node-prereqs.ok
self_sum=$(sha256sum "${BASH_SOURCE[0]}" | cut -d' ' -f1)
done_already() { [[ -f $stamp && $(cat "$stamp" 2>/dev/null) == "$self_sum" ]]; }
case ${1:-} in
  --check)
    done_already || die "this machine has not been prepared for the node this boot: run hack/node-prereqs.sh (as root; installs containerd, runc, the CNI plugins and checks the kernel)"
    exit 0 ;;
  "") ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac
if done_already; then say "ok: already prepared this boot ($stamp)"; exit 0; fi

[[ $(id -u) -eq 0 ]] || die "node mode needs root (network namespaces, mounts, containerd, kubelet); run as root"

# command -> Debian package
declare -A pkg_of=(
  [containerd]=containerd [ctr]=containerd [runc]=runc [socat]=socat
  [iptables]=iptables [conntrack]=conntrack [nsenter]=util-linux [ip]=iproute2 [openssl]=openssl
)
missing=()
for cmd in "${!pkg_of[@]}"; do
  command -v "$cmd" >/dev/null 2>&1 || PATH=$PATH:/usr/sbin:/sbin command -v "$cmd" >/dev/null 2>&1 || missing+=("${pkg_of[$cmd]}")
done
[[ -x /usr/lib/cni/bridge && -x /usr/lib/cni/host-local && -x /usr/lib/cni/loopback ]] || missing+=(containernetworking-plugins)
if [[ ${#missing[@]} -gt 0 ]]; then
  mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
  command -v apt-get >/dev/null 2>&1 || die "missing packages ${missing[*]} and no apt-get to install them"
  say "installing Debian packages for the node: ${missing[*]} (apt-get; one time, ~30 s)"
  apt-get update -qq >&2 || die "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2 \
    || die "apt-get install ${missing[*]} failed"
fi

# Kernel features. They must be built in or loadable; we cannot load modules here, so test the
# features themselves in a throwaway network namespace rather than reading a config file.
probe=kfprobe$$
cleanup() { ip netns del "$probe" 2>/dev/null || true; }
trap cleanup EXIT
ip netns add "$probe" || die "cannot create a network namespace (need CAP_SYS_ADMIN and CONFIG_NET_NS)"
in_ns() { ip netns exec "$probe" "$@"; }
in_ns ip link add kfprobebr type bridge 2>/dev/null || die "the kernel has no bridge support (CONFIG_BRIDGE)"
in_ns ip link add kfprobev0 type veth peer name kfprobev1 2>/dev/null || die "the kernel has no veth support (CONFIG_VETH)"
[[ -e /proc/sys/net/bridge/bridge-nf-call-iptables ]] || in_ns test -e /proc/sys/net/bridge/bridge-nf-call-iptables \
  || die "the kernel has no bridge netfilter (CONFIG_BRIDGE_NETFILTER; /proc/sys/net/bridge/bridge-nf-call-iptables is missing): Service traffic between pods on the bridge would not be NATed"
in_ns iptables -t nat -N KF-PROBE 2>/dev/null || die "iptables cannot create a nat chain (CONFIG_NF_TABLES / CONFIG_NFT_NAT / CONFIG_IP_NF_NAT): $(in_ns iptables -t nat -N KF-PROBE 2>&1 || true)"
in_ns iptables -t nat -A KF-PROBE -m comment --comment probe -m statistic --mode random --probability 0.5 -j MASQUERADE 2>/dev/null \
  || die "iptables lacks a match/target kube-proxy uses (comment, statistic, MASQUERADE): $(in_ns iptables -t nat -A KF-PROBE -m comment --comment probe -m statistic --mode random --probability 0.5 -j MASQUERADE 2>&1 || true)"
in_ns iptables -t filter -A INPUT -m conntrack --ctstate INVALID -m addrtype --dst-type LOCAL -m mark --mark 0x4000/0x4000 -j DROP 2>/dev/null \
  || die "iptables lacks conntrack/addrtype/mark matching (CONFIG_NETFILTER_XT_MATCH_*): $(in_ns iptables -t filter -A INPUT -m conntrack --ctstate INVALID -j DROP 2>&1 || true)"
grep -qw overlay /proc/filesystems || die "the kernel has no overlay filesystem (CONFIG_OVERLAY_FS); containerd's snapshotter needs it"
[[ -d /sys/fs/cgroup/memory || -f /sys/fs/cgroup/cgroup.controllers ]] || die "no memory cgroup mounted at /sys/fs/cgroup; the kubelet needs cgroups"
echo "$self_sum" > "$stamp"
say "ok: packages installed, kernel features present"
