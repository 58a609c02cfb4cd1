#!/usr/bin/env bash
# Runs kube-fence for real and shows it rejecting a stale write.
#
#   hack/run.sh             run on the cluster in KUBECONFIG, or — when none is given — on a local
#                           control plane it starts; demo; keep running until Ctrl-C
#   hack/run.sh --demo-only same, but stop everything after the demonstration
#
# The cluster's API server must run on this machine (`kube-fence run --local` registers its
# webhook by a 127.0.0.1 URL). For a remote cluster, install the Helm chart instead (docs/install.md).
set -euo pipefail
cd "$(dirname "$0")/.."
demo_only=false
[[ "${1:-}" == "--demo-only" ]] && demo_only=true

say() { printf '\033[1m[kube-fence %s]\033[0m %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
step() { printf '\n\033[1;34m==> %s\033[0m\n' "$*" >&2; }

say "building kube-fence"
cargo build --quiet --locked -p kube-fence -p kube-fence-testenv --bin kube-fence --bin kf-env
target=${CARGO_TARGET_DIR:-target}
kf="$target/debug/kube-fence"
kf_env="$target/debug/kf-env"
PATH="$("$kf_env" build):$PATH"   # kubectl and the control plane, built or cached (kf-env owns that)

work=$(mktemp -d "${TMPDIR:-/tmp}/kube-fence-run.XXXXXX")
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  if [[ -n "${KUBE_FENCE_ENV_DIR:-}" ]]; then "$kf_env" down || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if [[ -z "${KUBECONFIG:-}" ]]; then
  step "No KUBECONFIG given: starting a local control plane (etcd, kube-apiserver, kube-controller-manager)"
  export KUBE_FENCE_ENV_DIR="$work/control-plane"
  exports=$("$kf_env" up)
  eval "$exports"
else
  say "using the cluster in KUBECONFIG=$KUBECONFIG"
fi

step "Installing the CRDs (kubectl apply -f crds/)"
kubectl apply -f crds/ >&2
kubectl wait --for condition=established --timeout=60s crd/leases.kubefence.io >&2

step "Starting kube-fence (controller + webhook, local mode; log: $work/kube-fence.log)"
# --ready-file appears (written atomically) once the webhook serves and is registered and the
# controller runs; the webhook listens on a free port, so a second kube-fence does not collide.
"$kf" run --local --ready-file "$work/ready" >"$work/kube-fence.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 150); do
  [[ -s "$work/ready" ]] && break
  if ! kill -0 "${pids[0]}" 2>/dev/null; then cat "$work/kube-fence.log" >&2; say "kube-fence exited"; exit 1; fi
  sleep 0.2
done
[[ -s "$work/ready" ]] || { cat "$work/kube-fence.log" >&2; say "kube-fence did not become ready within 30s"; exit 1; }
say "kube-fence is ready: webhook at $(cat "$work/ready")"

ns=kube-fence-demo
kubectl create namespace "$ns" --dry-run=client -o yaml | kubectl apply -f - >/dev/null
kubectl -n "$ns" delete configmap shared-state --ignore-not-found >/dev/null
kubectl -n "$ns" delete flease demo --ignore-not-found >/dev/null

step "Worker A acquires lease 'demo' (3 s lease) and writes the guarded ConfigMap with its token"
token_a=$("$kf" lease acquire demo --holder worker-a --duration 3s -n "$ns")
say "worker A holds token $token_a"
kubectl -n "$ns" create configmap shared-state --from-literal=writer=worker-a --dry-run=client -o yaml \
  | kubectl label --local -f - kubefence.io/lease=demo -o yaml \
  | kubectl annotate --local -f - "kubefence.io/token=$token_a" -o yaml \
  | kubectl create -f - >&2

step "Worker A pauses (think: a long GC pause or SIGSTOP); its lease expires"
say "worker B asks for the lease and waits until A's lease has expired..."
token_b=$("$kf" lease acquire demo --holder worker-b --duration 30s --wait 30s -n "$ns")
say "worker B holds token $token_b (A had $token_a)"
kubectl -n "$ns" get flease demo >&2

step "Worker B writes with token $token_b"
kubectl -n "$ns" patch configmap shared-state --type merge \
  -p "{\"metadata\":{\"annotations\":{\"kubefence.io/token\":\"$token_b\"}},\"data\":{\"writer\":\"worker-b\"}}" >&2

step "Worker A wakes up and sends its delayed write with its old token $token_a"
if out=$(kubectl -n "$ns" patch configmap shared-state --type merge \
  -p "{\"metadata\":{\"annotations\":{\"kubefence.io/token\":\"$token_a\"}},\"data\":{\"writer\":\"worker-a\"}}" 2>&1); then
  say "UNEXPECTED: the stale write was admitted: $out"
  exit 1
fi
printf '%s\n' "$out" >&2
writer=$(kubectl -n "$ns" get configmap shared-state -o jsonpath='{.data.writer}')
say "rejected. The ConfigMap still says writer=$writer: worker A's stale write did not stick."

if $demo_only; then exit 0; fi
step "kube-fence keeps running (KUBECONFIG=$KUBECONFIG). Try: kubectl get flease -A. Ctrl-C stops everything."
wait "${pids[0]}"
