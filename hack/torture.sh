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
#
# The HA topology (issue 36; needs root): three etcd members, two kube-apiservers and two
# kube-fence replicas, each control-plane component in a network namespace of its own
# (`kf-env up --ha`), a nemesis cutting links and killing members; every fault healed before the
# next. Traffic stays on loopback and inside those namespaces; they are removed on every exit
# (and a crashed run's are removed at the next start).
#
#   hack/torture.sh --ha                  # the long run: KF_HA_FAULTS faults (default 2,000)
#   hack/torture.sh --ha --short          # 20 faults, then the planted fault (webhook unregistered):
#                                         # the checker must report the stale writes it lets through
#
# HA sizes: KF_HA_{FAULTS,WORKERS,LEASES,OBJECTS,LEASE_SECONDS,HOLD_MIN_MS,HOLD_MAX_MS,
# PAUSE_PERCENT,MAX_SECONDS,ELECTED_PODS}, KF_TORTURE_SEED.
set -euo pipefail
cd "$(dirname "$0")/.."

ha=false short=false
args=()
for a in "$@"; do
  case $a in
    --ha) ha=true ;;
    --short) short=true ;;
    *) args+=("$a") ;;
  esac
done
if $short && ! $ha; then echo "torture.sh: --short goes with --ha" >&2; exit 2; fi

if $ha; then
  [[ $(id -u) -eq 0 ]] || { echo "torture.sh: --ha needs root (network namespaces)" >&2; exit 1; }
  export KF_TORTURE_REPORT="${KF_TORTURE_REPORT:-${TMPDIR:-/tmp}/kube-fence-torture-ha.md}"
  started=$(date +%s)
  if $short; then
    cargo test --locked --test faults -- --ignored --exact faults_ha_short --nocapture ${args[@]+"${args[@]}"}
    cargo test --locked --test faults -- --ignored --exact faults_ha_unfenced --nocapture ${args[@]+"${args[@]}"}
  else
    cargo test --locked --test faults -- --ignored --exact faults_ha_long --nocapture ${args[@]+"${args[@]}"}
  fi
  echo "table written to $KF_TORTURE_REPORT; $(( $(date +%s) - started )) s" >&2
  exit 0
fi

export KF_TORTURE_REPORT="${KF_TORTURE_REPORT:-${TMPDIR:-/tmp}/kube-fence-torture.md}"
cargo test --locked --test faults -- --ignored --exact faults_long --nocapture ${args[@]+"${args[@]}"}
echo "table written to $KF_TORTURE_REPORT" >&2
