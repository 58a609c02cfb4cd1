#!/usr/bin/env bash
# End-to-end on kind, for machines with a Docker engine (it cannot run where there is none):
# create a cluster, build and load the image, install the CRDs with kubectl and the chart with
# helm, run the end-to-end suite against it, delete the cluster.
#
#   hack/kind-e2e.sh              (needs: docker, kind, kubectl, helm, cargo)
#   KEEP_CLUSTER=1 hack/kind-e2e.sh   keep the cluster afterwards
set -euo pipefail
cd "$(dirname "$0")/.."

CLUSTER=${CLUSTER:-kube-fence-e2e}
IMAGE=${IMAGE:-kube-fence:e2e}
NAMESPACE=kube-fence
RELEASE=kube-fence
CHART=charts/kube-fence

say() { printf '[kind-e2e %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
for tool in docker kind kubectl helm cargo; do
  command -v "$tool" >/dev/null 2>&1 || { say "error: $tool is not installed"; exit 1; }
done
docker info >/dev/null 2>&1 || { say "error: no Docker engine answers (kind needs one)"; exit 1; }

cleanup() {
  if [[ -z "${KEEP_CLUSTER:-}" ]]; then
    say "deleting cluster $CLUSTER"
    kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
  fi
}
trap cleanup EXIT

say "creating cluster $CLUSTER"
kind create cluster --name "$CLUSTER" --wait 120s
kubeconfig=$(mktemp)
kind get kubeconfig --name "$CLUSTER" >"$kubeconfig"
export KUBECONFIG=$kubeconfig

say "building image $IMAGE"
docker build -t "$IMAGE" .
kind load docker-image "$IMAGE" --name "$CLUSTER"

say "installing CRDs and the chart"
kubectl apply -f crds/
kubectl wait --for condition=established --timeout=60s crd/leases.kubefence.io
helm install "$RELEASE" "$CHART" --namespace "$NAMESPACE" --create-namespace \
  --set image.repository="${IMAGE%:*}" --set image.tag="${IMAGE##*:}" --set image.pullPolicy=Never \
  --wait --timeout 180s
kubectl -n "$NAMESPACE" rollout status "deployment/$RELEASE" --timeout=120s

say "running the end-to-end suite against the installed kube-fence"
KUBE_FENCE_E2E_INSTALLED=1 cargo test --locked --test e2e -- --test-threads=2

say "uninstalling (the webhook configuration goes first)"
helm uninstall "$RELEASE" --namespace "$NAMESPACE" --wait
if kubectl get validatingwebhookconfiguration "$RELEASE" >/dev/null 2>&1; then
  say "error: the webhook configuration survived uninstall"; exit 1
fi
say "passed"
