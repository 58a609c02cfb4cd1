#!/usr/bin/env bash
# Makes a kind node image for the pinned Kubernetes version from nothing a container registry
# serves, for machines that reach no registry (kind's published images are kindest/node:*):
#
#   - the root filesystem: Debian packages (debootstrap from the Debian mirror apt already uses),
#     laid out as kind's own base image lays it out (kind's images/base/files, from the kind module
#     on the Go module proxy): systemd, containerd + runc (Debian's), CNI plugins, iptables;
#     crictl built from the Go module proxy;
#   - kubeadm, kubelet, kubectl: the project's own build (hack/build-control-plane.sh --kind);
#   - the images a single-node cluster runs, made locally and imported into the node's containerd
#     (nothing is ever pulled): kube-apiserver, kube-controller-manager, kube-scheduler, kube-proxy
#     (registry.k8s.io/<name>:<version>, the names kubeadm asks for; this build of that version),
#     etcd (localhost/kf/etcd:<project etcd version>) and pause (localhost/kf/pause:1.0, the node
#     mode's, the containerd sandbox image).
#
# Differences from a published node image, all for "no registry" (hack/kind-e2e.sh sets the
# matching kind config when it uses this image):
#   - no CoreDNS image: clusters skip kubeadm's addon/coredns phase;
#   - etcd is the project's pinned etcd, so kubeadm is told its image (etcd.local.image*);
#   - no kindnetd image: the default CNI is a static ptp + host-local conflist for the first node's
#     Pod CIDR (10.244.0.0/24), so the image is for single-node clusters;
#   - no local-path-provisioner image: the "standard" StorageClass has no provisioner.
#
# Usage: hack/kind-node-image.sh [--print-ref]
#   Prints the image as a docker-archive tarball path (`docker load -i` it), cached by version
#   and by the content of the scripts that make it (~/.cache/kube-fence/kind/). Needs root
#   (debootstrap, chroot), Go, and the Debian mirror. No Docker engine needed.
set -euo pipefail
cd "$(dirname "$0")/.."
source hack/kind/common.sh
say() { printf '[kind-node-image %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { say "error: $*"; exit 1; }

# KUBE_VERSION, ETCD_VERSION, KIND_VERSION, CRICTL_VERSION, DEBIAN_SUITE: hack/versions.env (by common.sh).
SUITE=$DEBIAN_SUITE
REF=localhost/kube-fence/kind-node:$KUBE_VERSION
ETCD_IMAGE=localhost/kf/etcd:${ETCD_VERSION#v}
PAUSE_IMAGE=localhost/kf/pause:1.0
POD_CIDR=10.244.0.0/24

if [[ ${1:-} == --print-ref ]]; then echo "$REF"; exit 0; fi
[[ $# -eq 0 ]] || die "usage: $0 [--print-ref]"

# The cache key: the versions and what the scripts do (comments and blank lines left out).
key=$( { echo "$KUBE_VERSION $ETCD_VERSION $KIND_VERSION $CRICTL_VERSION $SUITE"
  sed -e '/^[[:space:]]*#/d' -e '/^[[:space:]]*$/d' "$0" hack/kind/common.sh hack/kind/dir-image.sh hack/make-image.sh
  cat testenv/images/pause/main.go; } | sha256sum | cut -c1-12)
outdir="$kf_cache/kind"
out="$outdir/node-$KUBE_VERSION-$key.tar"
if [[ -f $out ]]; then say "cached: $out ($REF)"; echo "$out"; exit 0; fi

[[ $(id -u) -eq 0 ]] || die "needs root (debootstrap and chroot)"
for tool in debootstrap go unshare; do
  command -v "$tool" >/dev/null 2>&1 || die "$tool is not installed (apt-get install debootstrap; Go >= 1.26)"
done
mkdir -p "$outdir"
exec 9>"$outdir/build.lock"
if ! flock -n 9; then say "another node image build is running; waiting for it"; flock 9; fi
if [[ -f $out ]]; then say "cached: $out"; echo "$out"; exit 0; fi

started=$(date +%s)
work=$(mktemp -d "$outdir/work.XXXXXX")
trap 'rm -rf "$work"' EXIT
rootfs=$work/rootfs

# The mirror apt uses on this machine (first non-security Debian source).
mirror=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null \
  | sed -nE 's/^[[:space:]]*(URIs:|deb( \[[^]]*\])?)[[:space:]]+([^[:space:]]+).*/\3/p' | grep -v security | sed -n 1p || true)
[[ -n $mirror ]] || die "no Debian mirror found in the apt sources"

# kind's base image: debian + these packages (images/base/Dockerfile), with Debian's containerd,
# runc and CNI plugins in place of the ones kind compiles; nfs/iscsi/fuse-overlayfs left out.
packages=systemd,conntrack,iptables,nftables,iproute2,ethtool,util-linux,mount,kmod,libseccomp2,pigz
packages+=,bash,ca-certificates,jq,procps,containerd,runc,containernetworking-plugins
say "debootstrap $SUITE (minbase + $packages)"
debootstrap --variant=minbase --include="$packages" "$SUITE" "$rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 \
  || { tail -20 "$work/debootstrap.log" >&2; die "debootstrap failed (log above)"; }
say "debootstrap done in $(( $(date +%s) - started )) s"

in_root() { chroot "$rootfs" /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$@"; }

say "laying out kind $KIND_VERSION's base image files"
kind_dir=$(kind_module_dir)
files="$kind_dir/images/base/files"
[[ -d $files ]] || die "kind's base image files are not in $kind_dir"
install -d -m 0755 "$rootfs/kind/bin" "$rootfs/LICENSES" "$rootfs/etc/containerd" "$rootfs/etc/default" \
  "$rootfs/etc/sysctl.d" "$rootfs/etc/systemd/system/kubelet.service.d" "$rootfs/kind/manifests"
install -m 0755 "$files"/usr/local/bin/* "$rootfs/usr/local/bin/"
install -m 0644 "$files"/kind/README.txt "$rootfs/kind/"
install -m 0755 "$files"/kind/bin/* "$rootfs/kind/bin/"
install -m 0644 "$files"/LICENSES/* "$rootfs/LICENSES/"
install -m 0644 "$files"/etc/crictl.yaml "$rootfs/etc/"
install -m 0644 "$files"/etc/containerd/* "$rootfs/etc/containerd/"
install -m 0644 "$files"/etc/default/* "$rootfs/etc/default/"
install -m 0644 "$files"/etc/sysctl.d/* "$rootfs/etc/sysctl.d/"
install -m 0644 "$files"/etc/systemd/system/*.service "$files"/etc/systemd/system/*.slice "$rootfs/etc/systemd/system/"
install -m 0644 "$files"/etc/systemd/system/kubelet.service.d/* "$rootfs/etc/systemd/system/kubelet.service.d/"
# Debian's containerd lives in /usr/bin; kind's unit and scripts run /usr/local/bin/containerd.
ln -sf /usr/bin/containerd "$rootfs/usr/local/bin/containerd"
mkdir -p "$rootfs/opt/cni" && ln -sfn /usr/lib/cni "$rootfs/opt/cni/bin"
install -m 0755 "$(go_tool sigs.k8s.io/cri-tools/cmd/crictl "$CRICTL_VERSION")" "$rootfs/usr/local/bin/crictl"
# The sandbox image is the node mode's pause, imported below.
sed -i "s|^\([[:space:]]*sandbox_image = \).*|\1\"$PAUSE_IMAGE\"|" "$rootfs/etc/containerd/config.toml"
grep -q "sandbox_image = \"$PAUSE_IMAGE\"" "$rootfs/etc/containerd/config.toml" || die "could not set sandbox_image in kind's containerd config"
# The RUN steps of kind's base Dockerfile.
in_root bash -euc '
  ctr oci spec | jq ".hooks.createContainer[.hooks.createContainer| length] |= . + {\"path\": \"/kind/bin/mount-product-files.sh\"}" \
    | jq "del(.process.rlimits)" > /etc/containerd/cri-base.json
  find /lib/systemd/system/sysinit.target.wants/ -name systemd-tmpfiles-setup.service -delete
  rm -f /lib/systemd/system/multi-user.target.wants/* /etc/systemd/system/*.wants/* \
    /lib/systemd/system/local-fs.target.wants/* /lib/systemd/system/sockets.target.wants/*udev* \
    /lib/systemd/system/sockets.target.wants/*initctl* /lib/systemd/system/basic.target.wants/*
  echo "ReadKMsg=no" >> /etc/systemd/journald.conf
  ln -sf /usr/lib/systemd/systemd /sbin/init
  systemctl enable kubelet.service containerd.service undo-mount-hacks.service
  systemctl mask systemd-binfmt.service
  mkdir -p /etc/kubernetes/manifests
  apt-get clean
  rm -rf /var/lib/apt/lists/* /var/log/*.log /var/cache/debconf/*-old
  : > /etc/resolv.conf; : > /etc/hostname
' >&2

say "Kubernetes $KUBE_VERSION binaries (hack/build-control-plane.sh --kind; waits for a running build)"
bindir=$(hack/build-control-plane.sh --kind | tail -1)
for b in kubeadm kubelet kubectl; do install -m 0755 "$bindir/$b" "$rootfs/usr/bin/$b"; done
printf '%s' "$KUBE_VERSION" > "$rootfs/kind/version"

say "making the images (no registry)"
images=$work/images
mkdir -p "$images"
for c in kube-apiserver kube-controller-manager kube-scheduler; do
  hack/make-image.sh --binary "$bindir/$c" --path "/usr/local/bin/$c" --ref "registry.k8s.io/$c:$KUBE_VERSION" \
    --user 0:0 --out "$images/$c.tar"
done
hack/make-image.sh --binary "$bindir/etcd" --path /usr/local/bin/etcd --ref "$ETCD_IMAGE" --user 0:0 --out "$images/etcd.tar"
GOTOOLCHAIN=${GOTOOLCHAIN:-local} GOFLAGS=-mod=mod CGO_ENABLED=0 \
  go -C testenv/images/pause build -trimpath -ldflags "-s -w" -o "$work/pause" .
hack/make-image.sh --binary "$work/pause" --path /pause --ref "$PAUSE_IMAGE" --user 65535:65535 --out "$images/pause.tar"
# kube-proxy runs iptables: its image holds kube-proxy and the node's iptables (nf_tables backend),
# with every file of the packages it needs, taken from the node's root filesystem.
proxy=$work/kube-proxy
mkdir -p "$proxy/usr/local/bin" "$proxy/usr/lib" "$proxy/usr/lib64" "$proxy/usr/sbin" "$proxy/usr/bin" "$proxy/run" "$proxy/tmp" "$proxy/etc"
for d in lib lib64 sbin bin; do ln -sfn "usr/$d" "$proxy/$d"; done
# Paths as dpkg lists them go through the merged-/usr links; resolve the directory part.
# shellcheck disable=SC2016
in_root bash -euc 'for p in libc6 libgcc-s1 iptables libip4tc2 libip6tc2 libxtables12 libnftnl11 libmnl0 \
    libnetfilter-conntrack3 libnfnetlink0 conntrack; do dpkg -L "$p"; done; echo /etc/ld.so.cache' | sort -u \
  | while read -r f; do
      [[ -L "$rootfs$f" || -f "$rootfs$f" ]] || continue
      [[ -L "$rootfs$f" && -d "$rootfs$f" ]] && continue
      d=$(readlink -f "$rootfs$(dirname "$f")")
      printf '%s/%s\n' "${d#"$rootfs"/}" "$(basename "$f")"
    done | sort -u > "$work/proxy-files"
tar -C "$rootfs" -cf - --no-recursion -T "$work/proxy-files" | tar -C "$proxy" -xf -
for t in iptables iptables-save iptables-restore ip6tables ip6tables-save ip6tables-restore; do
  ln -sf xtables-nft-multi "$proxy/usr/sbin/$t"
done
install -m 0755 "$bindir/kube-proxy" "$proxy/usr/local/bin/kube-proxy"
chroot "$proxy" /usr/sbin/iptables-save --version >/dev/null || die "iptables does not run in the kube-proxy image"
hack/kind/dir-image.sh --dir "$proxy" --ref "registry.k8s.io/kube-proxy:$KUBE_VERSION" --out "$images/kube-proxy.tar" \
  --entrypoint '["/usr/local/bin/kube-proxy"]'

say "importing the images into the node's containerd"
mkdir -p "$rootfs/tmp/kf-images"
cp "$images"/*.tar "$rootfs/tmp/kf-images/"
# containerd runs in the node's root filesystem, in a mount and PID namespace of its own: it ends
# with the shell, and nothing it mounts outlives it.
# shellcheck disable=SC2016
unshare --mount --pid --fork --mount-proc="$rootfs/proc" chroot "$rootfs" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin bash -euc '
  containerd >/tmp/containerd.log 2>&1 &
  for _ in $(seq 1 50); do [[ -S /run/containerd/containerd.sock ]] && break; sleep 0.2; done
  ctr version >/dev/null
  for t in /tmp/kf-images/*.tar; do
    ctr -n k8s.io images import --all-platforms --no-unpack "$t" >/dev/null
  done
  for ref in $(ctr -n k8s.io images list -q); do
    ctr -n k8s.io images label "$ref" io.cri-containerd.pinned=pinned >/dev/null
  done
  ctr -n k8s.io images list -q
  kill %1; wait || true
' >&2 || die "importing the images failed"
rm -rf "$rootfs/tmp/kf-images" "$rootfs/tmp/containerd.log" "$rootfs/run/containerd"

say "writing the CNI config and kind's default manifests"
mkdir -p "$rootfs/etc/cni/net.d"
cat > "$rootfs/etc/cni/net.d/10-kind-local.conflist" <<JSON
{
  "cniVersion": "1.0.0",
  "name": "kind-local",
  "plugins": [
    {"type": "ptp", "ipMasq": false, "mtu": 1500,
     "ipam": {"type": "host-local", "dataDir": "/run/cni-ipam-state",
              "ranges": [[{"subnet": "$POD_CIDR"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
JSON
# kind applies these after kubeadm init; nothing in them names an image.
cat > "$rootfs/kind/manifests/default-cni.yaml" <<'YAML'
# The CNI of this locally made node image is a static conflist in /etc/cni/net.d (no kindnetd
# image is available without a registry); kind applies this file, so it only records that.
apiVersion: v1
kind: ConfigMap
metadata:
  name: kind-local-cni
  namespace: kube-system
data:
  cni: /etc/cni/net.d/10-kind-local.conflist (ptp + host-local, single node)
YAML
cat > "$rootfs/kind/manifests/default-storage.yaml" <<'YAML'
# No local-path-provisioner image without a registry: a default StorageClass without a provisioner.
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata:
  name: standard
  annotations:
    storageclass.kubernetes.io/is-default-class: "true"
provisioner: kubernetes.io/no-provisioner
volumeBindingMode: WaitForFirstConsumer
YAML

say "writing $REF"
hack/kind/dir-image.sh --dir "$rootfs" --ref "$REF" --out "$out" --env container=docker \
  --entrypoint '["/usr/local/bin/entrypoint","/sbin/init"]' --stop-signal 'SIGRTMIN+3'
say "done in $(( $(date +%s) - started )) s: $out ($(du -h "$out" | cut -f1))"
echo "$out"
