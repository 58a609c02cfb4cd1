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
#   hack/torture.sh --ha --short          # 20 faults, then the planted fault (webhook unregistered,
#                                         # the PostgreSQL arbiter's check dropped): the checker
#                                         # must report the stale writes it lets through
#
# The long run in chunks (>= 2,000 faults take 5-9 h): each chunk is a complete run of its own
# (its own control plane, seed 36000 + N, history and check); its JSON result and table go under
# KF_HA_CHUNK_DIR (default docs/proof/ha-runs), and --sum adds the results of every chunk there.
#
#   hack/torture.sh --ha --chunk 7        # chunk 7: KF_HA_FAULTS faults (default 200 in a chunk)
#   hack/torture.sh --ha --sum [DIR]      # the combined table; fails on any violation in any chunk;
#                                         # for docs/proof/ha-runs, rewrites the long run's tables
#
# HA sizes: KF_HA_{FAULTS,WORKERS,LEASES,OBJECTS,LEASE_SECONDS,HOLD_MIN_MS,HOLD_MAX_MS,
# PAUSE_PERCENT,MAX_SECONDS,ELECTED_PODS,DELEGATED_PAIRS,ARBITER_HOLDERS}, KF_TORTURE_SEED.
set -euo pipefail
cd "$(dirname "$0")/.."

ha=false short=false chunk="" sum=false sum_dir=""
args=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --ha) ha=true ;;
    --short) short=true ;;
    --chunk) chunk=${2:?--chunk N}; shift ;;
    --sum) sum=true; if [[ $# -gt 1 && $2 != -* ]]; then sum_dir=$2; shift; fi ;;
    *) args+=("$1") ;;
  esac
  shift
done
if { $short || [[ -n $chunk ]] || $sum; } && ! $ha; then echo "torture.sh: --short, --chunk and --sum go with --ha" >&2; exit 2; fi
if [[ -n $chunk && ! $chunk =~ ^[0-9]+$ ]]; then echo "torture.sh: --chunk takes a number" >&2; exit 2; fi

if $sum; then
  export KF_HA_CHUNK_DIR=${sum_dir:-${KF_HA_CHUNK_DIR:-docs/proof/ha-runs}}
  export KF_TORTURE_REPORT="${KF_TORTURE_REPORT:-$KF_HA_CHUNK_DIR/sum.md}"
  # The committed chunks: the long run's tables in README.md, docs/proof.md and this directory
  # are rewritten from them first (a test checks they agree in every run), whatever the sum says.
  if [[ $(realpath -m "$KF_HA_CHUNK_DIR") == $(realpath -m docs/proof/ha-runs) ]]; then
    KUBE_FENCE_WRITE_HA_DOCS=1 cargo test --locked --test faults -- --exact committed_ha_documents_are_the_sum_of_the_committed_chunks
    echo "the long run's tables rewritten: README.md, docs/proof.md, docs/proof/ha-runs/" >&2
  fi
  cargo test --locked --test faults -- --ignored --exact faults_ha_sum --nocapture ${args[@]+"${args[@]}"}
  echo "table written to $KF_TORTURE_REPORT" >&2
  exit 0
fi

if $ha; then
  [[ $(id -u) -eq 0 ]] || { echo "torture.sh: --ha needs root (network namespaces)" >&2; exit 1; }
  # The host programs the topology runs (socat, ip, ...): installed when missing, once a boot.
  hack/node-prereqs.sh
  export KF_TORTURE_REPORT="${KF_TORTURE_REPORT:-${TMPDIR:-/tmp}/kube-fence-torture-ha.md}"
  started=$(date +%s)
  if [[ -n $chunk ]]; then
    dir=${KF_HA_CHUNK_DIR:-docs/proof/ha-runs}
    mkdir -p "$dir"
    name=$(printf 'chunk-%04d' "$chunk")
    export KF_TORTURE_SEED=$((36000 + 10#$chunk)) KF_HA_FAULTS=${KF_HA_FAULTS:-200}
    export KF_HA_RESULT="$dir/$name.json" KF_TORTURE_REPORT="$dir/$name.md"
    KF_HA_COMMIT=$(git rev-parse HEAD 2>/dev/null || echo unknown)
    export KF_HA_COMMIT
    cargo test --locked --test faults -- --ignored --exact faults_ha_long --nocapture ${args[@]+"${args[@]}"}
  elif $short; then
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
