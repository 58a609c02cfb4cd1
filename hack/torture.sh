#!/usr/bin/env bash
# The long proof under faults (issue 8): many workers, pauses past the lease, clock-skewed
# clients, the controller killed and doubled, the webhook, kube-apiserver and etcd restarted —
# then the recorded history is checked. Prints a table (also written to $KF_TORTURE_REPORT).
#
#   hack/torture.sh                       # >= 10,000 accepted writes, >= 1,000 pause cycles
#   KF_TORTURE_WRITES=2000 KF_TORTURE_PAUSES=200 hack/torture.sh    # smaller
#
# Sizes: KF_TORTURE_{WORKERS,LEASES,OBJECTS,EQUAL_ROUNDS,LEASE_SECONDS,WRITES,PAUSES,
# FAULT_ROUNDS,MAX_SECONDS,PAUSE_PERCENT,SKEW_PERCENT,FAULT_GAP_SECONDS,SEED}.
# It starts a control plane of its own on loopback (whatever KUBECONFIG says) because it kills
# kube-apiserver and etcd; all traffic stays on 127.0.0.1.
set -euo pipefail
cd "$(dirname "$0")/.."

export KF_TORTURE_REPORT="${KF_TORTURE_REPORT:-${TMPDIR:-/tmp}/kube-fence-torture.md}"
cargo test --locked --test faults -- --ignored --exact faults_long --nocapture "$@"
echo "table written to $KF_TORTURE_REPORT" >&2
