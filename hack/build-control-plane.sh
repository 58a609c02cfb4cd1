#!/usr/bin/env bash
# Builds the real Kubernetes control plane kube-fence tests against — etcd, kube-apiserver,
# kube-controller-manager, kubectl and helm — from pinned Go module versions, the way
# controller-runtime's envtest does, but without downloading prebuilt binaries (none can be
# downloaded here). Binaries are cached by version; a warm run takes a second.
#
# This script is the one place that builds them; everything else asks kf-env for them
# (`kf-env build [--node]` prints the directory, `kube_fence_testenv::binaries()` in Rust, and
# `kf-env up` exports it as KUBE_FENCE_BIN_DIR and on PATH), so a test run calls it once.
#
# Usage: hack/build-control-plane.sh [--node] [--kind] [--print-dir]
#   --node             also build the node components kf-env's node mode runs (kubelet,
#                      kube-scheduler, kube-proxy; ~10 min cold, seconds when cached). The plain
#                      control plane never needs them, so a plain build never waits for them.
#   --kind             --node plus kubeadm, for the kind node image (hack/kind-node-image.sh)
#   KUBE_FENCE_CACHE   cache root (default: ${XDG_CACHE_HOME:-$HOME/.cache}/kube-fence)
#
# The k8s.io/kubernetes module cannot be `go install`ed: its go.mod points every staging module
# at ./staging with v0.0.0 replace directives. A throwaway wrapper module replaces each of them
# with the published staging version of the same release.
set -euo pipefail

# KUBE_VERSION, STAGING_VERSION, ETCD_VERSION, HELM_VERSION
# shellcheck source=hack/versions.env
source "$(dirname "${BASH_SOURCE[0]}")/versions.env"

cache=${KUBE_FENCE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kube-fence}
bindir="$cache/bin/k8s-$KUBE_VERSION-etcd-$ETCD_VERSION-helm-$HELM_VERSION"

node=false
kind=false
print_dir=false
for arg in "$@"; do
  case $arg in
    --node) node=true ;;
    --kind) node=true; kind=true ;;
    --print-dir) print_dir=true ;;
    *) echo "usage: $0 [--node] [--kind] [--print-dir]" >&2; exit 2 ;;
  esac
done
if $print_dir; then echo "$bindir"; exit 0; fi

say() { printf '[control-plane build %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { say "error: $*"; exit 1; }

want=(etcd kube-apiserver kube-controller-manager kubectl helm)
node_bins=(kubelet kube-scheduler kube-proxy)
if $node; then want+=("${node_bins[@]}"); fi
if $kind; then want+=(kubeadm); fi
missing=()
for b in "${want[@]}"; do [[ -x "$bindir/$b" ]] || missing+=("$b"); done
if [[ ${#missing[@]} -eq 0 ]]; then say "cached: $bindir"; echo "$bindir"; exit 0; fi

command -v go >/dev/null 2>&1 || die "Go is not installed (need Go >= 1.26 on PATH to build the control plane from the Go module proxy)"
export GOTOOLCHAIN=${GOTOOLCHAIN:-local}
export GOFLAGS=-mod=mod
export CGO_ENABLED=0
proxy=$(go env GOPROXY)
first_proxy=${proxy%%,*}
if [[ "$first_proxy" == http* ]]; then
  curl -fsS --max-time 20 -o /dev/null "$first_proxy/k8s.io/kubernetes/@v/$KUBE_VERSION.info" \
    || die "the Go module proxy $first_proxy does not answer for k8s.io/kubernetes@$KUBE_VERSION (GOPROXY=$proxy)"
fi

mkdir -p "$bindir"
# One build at a time per cache: a second caller waits, then finds the binaries cached.
exec 9>"$cache/build.lock"
if ! flock -n 9; then say "another build is running; waiting for it"; flock 9; fi
missing=()
for b in "${want[@]}"; do [[ -x "$bindir/$b" ]] || missing+=("$b"); done
if [[ ${#missing[@]} -eq 0 ]]; then say "cached: $bindir"; echo "$bindir"; exit 0; fi
work=$(mktemp -d "${TMPDIR:-/tmp}/kube-fence-build.XXXXXX")
trap 'rm -rf "$work"' EXIT
say "building ${missing[*]} into $bindir (cold: ~20 min on 2 cores; Go module and build caches are reused)"

version_ldflags() { # $1 = gitVersion, $2 = major, $3 = minor
  local f=""
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    f+=" -X $p.gitVersion=$1 -X $p.gitMajor=$2 -X $p.gitMinor=$3"
  done
  echo "-s -w$f"
}

need() { [[ ! -x "$bindir/$1" ]]; }

if need etcd; then
  say "etcd $ETCD_VERSION: resolving modules"
  mkdir -p "$work/etcd" && cd "$work/etcd"
  go mod init kube-fence/build/etcd >/dev/null 2>&1
  go get "go.etcd.io/etcd/server/v3@$ETCD_VERSION" >/dev/null
  say "etcd $ETCD_VERSION: compiling"
  go build -trimpath -ldflags "-s -w" -o "$bindir/etcd.tmp" go.etcd.io/etcd/server/v3
  mv "$bindir/etcd.tmp" "$bindir/etcd"
  say "etcd: done"
fi

k8s_bins=()
k8s_all=(kube-apiserver kube-controller-manager kubectl)
if $node; then k8s_all+=("${node_bins[@]}"); fi
if $kind; then k8s_all+=(kubeadm); fi
for b in "${k8s_all[@]}"; do need "$b" && k8s_bins+=("$b"); done
if [[ ${#k8s_bins[@]} -gt 0 ]]; then
  say "kubernetes $KUBE_VERSION: resolving modules (wrapper module with staging replaces)"
  mkdir -p "$work/k8s" && cd "$work/k8s"
  go mod init kube-fence/build/kubernetes >/dev/null 2>&1
  upstream_mod=$(go mod download -json "k8s.io/kubernetes@$KUBE_VERSION" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p')
  [[ -f "$upstream_mod" ]] || die "could not download k8s.io/kubernetes@$KUBE_VERSION"
  grep -E '^godebug' "$upstream_mod" >> go.mod || true
  # every staging module required at v0.0.0 gets the published version of this release
  awk '$1 ~ /^k8s\.io\// && $2 == "v0.0.0" {print $1}' "$upstream_mod" | sort -u | while read -r m; do
    echo "replace $m => $m $STAGING_VERSION" >> go.mod
  done
  # tools.go pulls in exactly the commands this run builds, so `go mod tidy` resolves their
  # dependencies (kube-proxy alone adds moby/ipvs, knftables, google/nftables, mdlayher/*).
  {
    printf '//go:build tools\npackage tools\n\nimport (\n'
    for b in "${k8s_bins[@]}"; do
      case $b in kubectl) printf '\t_ "k8s.io/kubernetes/cmd/kubectl"\n' ;; *) printf '\t_ "k8s.io/kubernetes/cmd/%s/app"\n' "$b" ;; esac
    done
    printf ')\n'
  } > tools.go
  go get "k8s.io/kubernetes@$KUBE_VERSION" >/dev/null 2>&1 || go get "k8s.io/kubernetes@$KUBE_VERSION"
  go mod tidy >/dev/null 2>&1 || go mod tidy
  minor=${KUBE_VERSION#v1.}; minor=${minor%%.*}
  flags=$(version_ldflags "$KUBE_VERSION" 1 "$minor")
  for b in "${k8s_bins[@]}"; do
    say "kubernetes $KUBE_VERSION: compiling $b (kube-apiserver or kubelet alone take ~10 min cold)"
    go build -trimpath -ldflags "$flags" -o "$bindir/$b.tmp" "k8s.io/kubernetes/cmd/$b"
    mv "$bindir/$b.tmp" "$bindir/$b"
    say "$b: done"
  done
fi

if need helm; then
  say "helm $HELM_VERSION: compiling"
  GOBIN="$work/gobin" go install -trimpath -ldflags "-s -w" "helm.sh/helm/v4/cmd/helm@$HELM_VERSION"
  mv "$work/gobin/helm" "$bindir/helm"
  say "helm: done"
fi

say "all binaries in $bindir"
echo "$bindir"
