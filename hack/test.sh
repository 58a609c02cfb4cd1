#!/usr/bin/env bash
# Runs every kube-fence test against a real Kubernetes control plane.
#
#   hack/test.sh [extra cargo test args]
#
# With KUBECONFIG set, the tests use that cluster (kind, a real cluster). Without it, one local
# control plane (etcd + kube-apiserver + kube-controller-manager, built from pinned Go modules on
# first use) is started for the whole run and removed afterwards, also on Ctrl-C or failure.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '[test %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# The node tests (testenv/tests/node.rs) and the in-cluster suite run a real kubelet node: they
# need root and Debian's containerd/runc/CNI plugins. Prepared here, once; everything after only
# checks that it was (and fails clearly if the machine can't).
hack/node-prereqs.sh

say "building kube-fence and its tests"
cargo build --workspace --all-targets --locked

# kf-env is the one owner of the control plane: it builds (or finds cached) every binary the
# run needs, once, and starts the cluster. Tests and scripts below find the binaries through
# KUBE_FENCE_BIN_DIR and PATH instead of building again.
kf_env=(cargo run --quiet --locked -p kube-fence-testenv --)
bindir=$("${kf_env[@]}" build --node)
export KUBE_FENCE_BIN_DIR=$bindir PATH="$bindir:$PATH"
# promtool, for the chart's PrometheusRule (tests/monitoring.rs): built once from its Go module.
KUBE_FENCE_PROMTOOL=$(hack/build-promtool.sh)
export KUBE_FENCE_PROMTOOL
# dashboard-check, for the chart's Grafana dashboard (tests/monitoring.rs): Grafana's dashboard
# schema (the Grafana Foundation SDK's Go types), built once from its Go module.
KUBE_FENCE_DASHBOARD_CHECK=$(hack/build-dashboard-check.sh)
export KUBE_FENCE_DASHBOARD_CHECK

if [[ -z "${KUBECONFIG:-}" ]]; then
  export KUBE_FENCE_ENV_DIR
  KUBE_FENCE_ENV_DIR=$(mktemp -d "${TMPDIR:-/tmp}/kube-fence-test-env.XXXXXX")
  trap '"${kf_env[@]}" down || true' EXIT INT TERM
  exports=$("${kf_env[@]}" up)
  eval "$exports"
  say "using the local control plane: KUBECONFIG=$KUBECONFIG"
else
  say "using the cluster in KUBECONFIG=$KUBECONFIG"
fi

say "running the test suite"
# --no-fail-fast: a failing test binary does not hide the results of the others (the run still fails).
cargo test --workspace --all-targets --locked --no-fail-fast "$@"
say "running the documentation examples"
cargo test --workspace --doc --locked

# The HA topology (3 etcd members, 2 API servers, 2 kube-fence replicas, a nemesis): a short
# fault run, then the same with the webhook unregistered, which must report stale writes.
say "running the short HA fault run (hack/torture.sh --ha --short)"
hack/torture.sh --ha --short

# kube-fence installed for real: the chart on a real node, its Pods called through their Service.
say "running the in-cluster suite on a real node (hack/e2e-node.sh)"
KUBE_FENCE_IMAGE_PROFILE=${KUBE_FENCE_IMAGE_PROFILE:-debug} hack/e2e-node.sh
