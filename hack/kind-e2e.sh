#!/usr/bin/env bash
# End-to-end on kind: a kind cluster, then the in-cluster suite (hack/e2e-install-and-test.sh,
# the same as on the node: the images built without Docker, the CRDs and the chart installed,
# the end-to-end suite and the operations tests against the installed Pods, uninstall), the
# images loaded with `kind load image-archive`; the cluster is deleted afterwards — also on
# failure — and the host restored (a run that cannot restore it fails).
#
#   hack/kind-e2e.sh
#
# Docker: a Docker engine that answers is used as it is. Where none answers (and always with
# KIND_E2E_OWN_DOCKERD=1), Debian's dockerd (apt-get install docker.io) is started for the run
# and stopped afterwards, leaving the host as it found it (see hack/kind/engine.sh).
#
# Node image:
#   default                    kind's published node image for its version; if it cannot be
#                              pulled (no registry reachable), the local one below
#   KIND_NODE_IMAGE=REF        this image
#   KIND_NODE_IMAGE=local      the node image made here without any registry, for the project's
#                              Kubernetes version (hack/kind-node-image.sh, cached; cold: long)
#
# Tools: kind (on PATH, else built from the Go module proxy at the version hack/versions.env
# pins), kubectl and helm (on PATH, else hack/build-control-plane.sh's), cargo.
#   KEEP_CLUSTER=1                   keep the cluster (and a dockerd this script started) afterwards;
#                                    `hack/kind-e2e.sh --down` deletes it and stops that dockerd
#   KUBE_FENCE_IMAGE_PROFILE=debug   faster image build (debug binary)
set -euo pipefail
cd "$(dirname "$0")/.."
source hack/kind/common.sh
source hack/kind/engine.sh

CLUSTER=${CLUSTER:-kube-fence-e2e}

say() { printf '[kind-e2e %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { say "error: $*"; exit 1; }
started=$(date +%s)

command -v cargo >/dev/null 2>&1 || die "cargo is not installed"
if ! command -v kubectl >/dev/null 2>&1 || ! command -v helm >/dev/null 2>&1; then
  PATH=$(hack/build-control-plane.sh | tail -1):$PATH
fi
kind=$(command -v kind || true)
[[ -n $kind ]] || kind=$(kind_bin)
kept_kubeconfig=$kf_cache/kind/$CLUSTER.kubeconfig

if [[ ${1:-} == --down ]]; then
  if ! engine_adopt; then
    docker info >/dev/null 2>&1 || die "no Docker engine answers, and no dockerd of an earlier run is left"
    KF_REAL_DOCKER=$(command -v docker)
    engine_privileged
  fi
  say "deleting cluster $CLUSTER"
  "$kind" delete cluster --name "$CLUSTER" >&2
  rm -f "$kept_kubeconfig"
  engine_down
  exit 0
fi
[[ $# -eq 0 ]] || die "usage: $0 [--down]"
say "kind $("$kind" version | cut -d' ' -f2), kubectl and helm: $(command -v kubectl), $(command -v helm)"

work=$(mktemp -d "${TMPDIR:-/tmp}/kind-e2e.XXXXXX")
cluster_made=false
finished=false   # set at the very end: a run stopped by a signal is not reported as passed
cleanup() {
  local rc=$?
  if $cluster_made && [[ -z ${KEEP_CLUSTER:-} ]]; then
    say "deleting cluster $CLUSTER"
    "$kind" delete cluster --name "$CLUSTER" >/dev/null 2>&1 || say "warning: could not delete cluster $CLUSTER"
  fi
  if [[ -n ${KEEP_CLUSTER:-} ]]; then
    if $cluster_made; then
      cp "$kubeconfig" "$kept_kubeconfig" 2>/dev/null || true
      say "KEEP_CLUSTER: cluster $CLUSTER kept, KUBECONFIG=$kept_kubeconfig; remove it with: hack/kind-e2e.sh --down"
    fi
    if $engine_owned; then
      say "KEEP_CLUSTER: dockerd keeps running (DOCKER_HOST=$DOCKER_HOST) until hack/kind-e2e.sh --down"
    fi
  elif ! engine_down; then
    [[ $rc -ne 0 ]] || rc=1   # a run that leaves the host changed fails
  fi
  rm -rf "$work"
  if $finished && [[ $rc -eq 0 ]]; then say "passed in $(( $(date +%s) - started )) s"
  elif $finished || [[ $rc -ne 0 ]]; then say "failed (exit $rc) after $(( $(date +%s) - started )) s"
  else say "stopped before the end (by a signal) after $(( $(date +%s) - started )) s"; fi
  exit "$rc"
}
trap cleanup EXIT

engine_up

# The node image: kind's default unless told, the local one if the default cannot be pulled.
node_image=${KIND_NODE_IMAGE:-}
if [[ -z $node_image ]]; then
  default_image=$(sed -n 's/^const Image = "\(.*\)"$/\1/p' "$(kind_module_dir)/pkg/apis/config/defaults/image.go" 2>/dev/null || true)
  if [[ -n $default_image ]] && { docker image inspect "$default_image" >/dev/null 2>&1 || docker pull "$default_image" >&2; }; then
    node_image=$default_image
  else
    say "kind's node image ${default_image:-?} cannot be pulled here: using the local node image"
    node_image=local
  fi
fi
local_image=false
if [[ $node_image == local ]]; then
  local_image=true
  node_image=$(hack/kind-node-image.sh --print-ref)
  if ! docker image inspect "$node_image" >/dev/null 2>&1; then
    tarball=$(hack/kind-node-image.sh)
    say "loading $node_image into Docker"
    docker load -i "$tarball" >&2
  fi
  # The local image has no CoreDNS image and carries the project's etcd (hack/kind-node-image.sh).
  etcd_version=$ETCD_VERSION # hack/versions.env (by common.sh)
fi
say "node image: $node_image"

config=$work/kind.yaml
{
  echo "kind: Cluster"
  echo "apiVersion: kind.x-k8s.io/v1alpha4"
  echo "nodes:"
  echo "- role: control-plane"
  echo "kubeadmConfigPatches:"
  if $local_image; then
    cat <<YAML
- |
  kind: ClusterConfiguration
  etcd:
    local:
      imageRepository: localhost/kf
      imageTag: ${etcd_version#v}
- |
  kind: InitConfiguration
  skipPhases: [preflight, addon/coredns]
YAML
  fi
  # Kubernetes >= 1.35 kubelets refuse cgroup v1 unless told otherwise.
  if [[ $(stat -fc %T /sys/fs/cgroup) != cgroup2fs ]]; then
    cat <<YAML
- |
  kind: KubeletConfiguration
  failCgroupV1: false
YAML
  fi
} > "$config"
grep -q '^- |' "$config" || sed -i '/^kubeadmConfigPatches:$/d' "$config"

kubeconfig=$work/kubeconfig
export KUBECONFIG=$kubeconfig
say "creating cluster $CLUSTER"
cluster_made=true
retain=()
[[ -n ${KEEP_CLUSTER:-} ]] && retain=(--retain)   # keep the node of a failed create, to look into
"$kind" create cluster --name "$CLUSTER" --image "$node_image" --config "$config" --kubeconfig "$kubeconfig" --wait 180s "${retain[@]}"
kubectl get nodes -o wide >&2

# The in-cluster suite, as on the node: only how an image gets in differs.
hack/e2e-install-and-test.sh -- "$kind" load image-archive --name "$CLUSTER"
finished=true
