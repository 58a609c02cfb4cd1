#!/usr/bin/env bash
# Node mode from the shell: a real single-node Kubernetes (kubelet, containerd, kube-proxy, in a
# network namespace of its own with no route out) for tests that need Pods and Services.
#
#   hack/test-node.sh                 run the node tests (testenv/tests/node.rs; they start and
#                                     stop their own nodes and check the host is left as it was)
#   hack/test-node.sh -- CMD [ARG..]  bring a node up, build the kube-fence image without Docker
#                                     (hack/build-image.sh) and import it, run CMD with the
#                                     exports below, then tear the node down (also on Ctrl-C
#                                     or failure)
#
# CMD sees: KUBECONFIG, PATH (kubectl, helm, ...), CONTAINERD_ADDRESS + CONTAINERD_NAMESPACE
# (so `ctr images import X.tar` loads more images), KUBE_FENCE_IMAGE (the imported image ref;
# install the chart with --set image.repository=${KUBE_FENCE_IMAGE%:*}
# --set image.tag=${KUBE_FENCE_IMAGE##*:} --set image.pullPolicy=Never).
#   KUBE_FENCE_IMAGE_PROFILE=debug   build the image's binary in the debug profile (faster)
# Needs root. Missing Debian packages are installed with apt-get; a machine that cannot run the
# node (kernel features) fails with the reason.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { printf '[test-node %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

hack/node-prereqs.sh   # a no-op when this boot's machine is already prepared
if [[ $# -eq 0 ]]; then
  say "running the node tests"
  exec cargo test --locked -p kube-fence-testenv --test node -- --test-threads 1
fi
[[ $1 == -- ]] || { echo "usage: $0 [-- CMD [ARG..]]" >&2; exit 2; }
shift

image_args=(--ref localhost/kube-fence/kube-fence:dev)
[[ ${KUBE_FENCE_IMAGE_PROFILE:-release} == debug ]] && image_args+=(--debug)
tarball=$(hack/build-image.sh "${image_args[@]}")

export KUBE_FENCE_ENV_DIR
KUBE_FENCE_ENV_DIR=$(mktemp -d "${TMPDIR:-/tmp}/kube-fence-node-env.XXXXXX")
kf_env=(cargo run --quiet --locked -p kube-fence-testenv --)
trap '"${kf_env[@]}" down || true' EXIT INT TERM
exports=$("${kf_env[@]}" up --node)   # builds or finds the node binaries too
eval "$exports"
"${kf_env[@]}" import "$tarball"
export KUBE_FENCE_IMAGE=localhost/kube-fence/kube-fence:dev
say "node up (KUBECONFIG=$KUBECONFIG), image $KUBE_FENCE_IMAGE imported; running: $*"
"$@"
