#!/usr/bin/env bash
# Measures how close kube-fence runs to its limits and prints one table (issue 9).
#
#   hack/bench.sh            full run (release build; 10,000 leases; about 15 minutes)
#   hack/bench.sh --quick    small sizes (a few minutes)
#   hack/bench.sh --help     every size that can be set (e.g. --leases 5000 --only scale)
#
# Loopback only and bounded. With KUBECONFIG set the bench uses that cluster (its API server
# must run on this machine: the webhook is registered by a 127.0.0.1 URL); without it the bench
# starts a local control plane of its own and removes it afterwards. It measures and reports;
# it never fails on a timing.
set -euo pipefail
cd "$(dirname "$0")/.."

exec cargo bench --locked --bench fence -- "$@"
