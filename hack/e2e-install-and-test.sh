#!/usr/bin/env bash
# The in-cluster suite, one path for every cluster it runs on: what is built, what is installed
# and which tests run with which settings. hack/e2e-node.sh (the real node) and hack/kind-e2e.sh
# (kind) make the cluster and say how an image gets into it; everything else is here, so a test
# added to tests/e2e.rs, tests/e2e/ or tests/operations.rs runs on both.
#
#   hack/e2e-install-and-test.sh -- LOAD-COMMAND [ARG..]
#
# LOAD-COMMAND ARG.. TARBALL puts a docker-archive image into the cluster's node, where Pods run
# it with imagePullPolicy Never (the node: `kf-env import`; kind: `kind load image-archive`).
# Needs KUBECONFIG, and kubectl, helm and cargo on PATH.
#
#   built      the kube-fence image (hack/build-image.sh; KUBE_FENCE_IMAGE_PROFILE=debug: the
#              debug binary, faster to build), the leader-go image (hack/build-leader-go.sh
#              --image), the Rust examples the tests run as processes (cargo build --examples)
#   installed  the CRDs (crds/), the chart as release kube-fence in namespace kube-fence, its
#              image the one built here, image.pullPolicy=Never, logFormat=text
#   run        tests/e2e.rs against the installed Pods (KUBE_FENCE_E2E_INSTALLED=1,
#              KF_STATUS_PAUSE_ROUNDS=20, 2 test threads); the leader-go Pods' pause cycles
#              (tests/e2e/leader.rs, LEADER_GO_CYCLES=20) where the node's containerd reports
#              host process ids (CONTAINERD_ADDRESS set, as on the node); tests/operations.rs
#              (--ignored, 1 thread); the documentation's in-cluster blocks (tests/docs.rs,
#              --ignored), the last of which uninstalls the release
#   checked    helm uninstall leaves no webhook configuration; no Pod in the cluster tried to
#              pull an image (every image was loaded, nothing reaches a registry)
# On failure it stops where it failed: the caller tears the cluster down.
set -euo pipefail
cd "$(dirname "$0")/.."

NAMESPACE=kube-fence
RELEASE=kube-fence
CHART=charts/kube-fence
IMAGE=localhost/kube-fence/kube-fence:e2e

say() { printf '[e2e %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { say "error: $*"; exit 1; }
[[ ${1:-} == -- && $# -ge 2 ]] || die "usage: $0 -- LOAD-COMMAND [ARG..] (it is run as LOAD-COMMAND ARG.. TARBALL)"
shift
load=("$@")
[[ -n ${KUBECONFIG:-} ]] || die "KUBECONFIG is not set: which cluster?"
for tool in kubectl helm cargo; do command -v "$tool" >/dev/null 2>&1 || die "$tool is not on PATH"; done

work=$(mktemp -d "${TMPDIR:-/tmp}/kf-e2e.XXXXXX")
trap 'rm -rf "$work"' EXIT

say "building the image $IMAGE, the leader-go image and the examples"
profile_args=()
[[ ${KUBE_FENCE_IMAGE_PROFILE:-release} == debug ]] && profile_args=(--debug)
image_tar=$(hack/build-image.sh "${profile_args[@]}" --ref "$IMAGE" --out "$work/kube-fence.tar")
mapfile -t leader_go < <(hack/build-leader-go.sh --image)   # binary, image tarball, image ref
[[ ${#leader_go[@]} -eq 3 ]] || die "hack/build-leader-go.sh --image printed ${#leader_go[@]} lines, not 3"
cargo build --locked --examples
# The delegated Job's worker (tests/e2e/delegation.rs) as an image of its own: a static build, as
# the kube-fence image is (same target and flags, so the dependencies are built once).
profile_dir=debug
[[ ${KUBE_FENCE_IMAGE_PROFILE:-release} == debug ]] || profile_dir=release
release_args=()
[[ $profile_dir == release ]] && release_args=(--release)
RUSTFLAGS="-C target-feature=+crt-static" cargo build --locked "${release_args[@]}" --target x86_64-unknown-linux-gnu --example delegated_writer >&2
export DELEGATED_WRITER_IMAGE=localhost/kube-fence/delegated-writer:dev
hack/make-image.sh --binary "${CARGO_TARGET_DIR:-target}/x86_64-unknown-linux-gnu/$profile_dir/examples/delegated_writer" \
  --ref "$DELEGATED_WRITER_IMAGE" --out "$work/delegated-writer.tar" >&2

say "loading the images: ${load[*]} TARBALL"
"${load[@]}" "$image_tar" >&2
"${load[@]}" "${leader_go[1]}" >&2
"${load[@]}" "$work/delegated-writer.tar" >&2
export LEADER_GO_IMAGE=${leader_go[2]}

say "installing the CRDs and the chart"
kubectl apply -f crds/ >&2
kubectl wait --for condition=established --timeout=60s crd/leases.kubefence.io >&2
installed=$(date +%s)
helm install "$RELEASE" "$CHART" --namespace "$NAMESPACE" --create-namespace \
  --set image.repository="${IMAGE%:*}" --set image.tag="${IMAGE##*:}" --set image.pullPolicy=Never \
  --set logFormat=text --set 'webhook.exemptUsers={system:serviceaccount:kube-system:generic-garbage-collector,system:serviceaccount:kube-system:namespace-controller,leader-go-setup}' --wait --timeout 180s >&2
kubectl -n "$NAMESPACE" rollout status "deployment/$RELEASE" --timeout=120s >&2
say "installed and ready in $(( $(date +%s) - installed )) s"
kubectl -n "$NAMESPACE" get pods -o wide >&2

export KUBE_FENCE_E2E_INSTALLED=1 KUBE_FENCE_E2E_RELEASE="$NAMESPACE/$RELEASE"
say "running the end-to-end suite against the installed Pods"
# The status pause test: 20 SIGSTOP/SIGCONT rounds here, the full 100 in the local suite.
KF_STATUS_PAUSE_ROUNDS=${KF_STATUS_PAUSE_ROUNDS:-20} cargo test --locked --test e2e -- --test-threads 2 --nocapture
if [[ -n ${CONTAINERD_ADDRESS:-} ]]; then
  say "running the leader-go pause cycles (2 replicas, image $LEADER_GO_IMAGE): labelled objects, then everything with the writer opted in"
  # 20 cycles each here; the 100-cycle figures of docs/fence-an-existing-operator.md were measured with LEADER_GO_CYCLES=100.
  LEADER_GO_CYCLES=${LEADER_GO_CYCLES:-20} cargo test --locked --test e2e \
    leader::a_paused_leader_pod -- --ignored --test-threads 1 --nocapture
  say "running the delegated Job's pause cycles (image $DELEGATED_WRITER_IMAGE)"
  KF_DELEGATION_NODE_CYCLES=${KF_DELEGATION_NODE_CYCLES:-20} cargo test --locked --test e2e \
    delegation::a_paused_delegated_job_pod_on_the_node_is_fenced -- --ignored --exact --nocapture
else
  say "leader-go and delegated-Job pause cycles not run: they signal the container's host process, found through the node's containerd (CONTAINERD_ADDRESS), which this cluster does not give"
fi
say "running the operations tests"
cargo test --locked --test operations -- --ignored --test-threads 1 --nocapture

# The documentation's blocks marked in-cluster (tests/docs.rs), in page order: docs/install.md
# checks that the release fences, upgrades it and, last, uninstalls it.
say "running the documentation's in-cluster blocks"
cargo test --locked --test docs in_cluster_blocks_run_against_the_installed_chart -- --ignored --exact --nocapture
say "uninstalling (the webhook configuration goes first)"
if helm status "$RELEASE" --namespace "$NAMESPACE" >/dev/null 2>&1; then
  helm uninstall "$RELEASE" --namespace "$NAMESPACE" --wait >&2
fi
if kubectl get validatingwebhookconfiguration "$RELEASE" >/dev/null 2>&1; then
  die "the webhook configuration survived uninstall"
fi
# Every Pod ran from a loaded image or was never meant to run (tests that need only a Pod object
# keep it unscheduled): an attempted pull means a test or the chart would reach for a registry.
if kubectl get events -A -o jsonpath='{range .items[*]}{.reason}{" "}{.message}{"\n"}{end}' | grep -E '^(Pulling|Failed|ErrImagePull|BackOff) .*(pull|image)' >&2; then
  die "an image pull was attempted in the cluster (events above)"
fi
say "passed"
