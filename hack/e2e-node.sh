#!/usr/bin/env bash
# kube-fence installed for real on a local node, no Docker: a node (hack/test-node.sh), then the
# in-cluster suite (hack/e2e-install-and-test.sh: the images built and imported, the CRDs and
# the chart installed, the end-to-end suite, the leader-go Pods' pause cycles and the operations
# tests against the Pods, uninstall). Everything is torn down afterwards, also on failure.
# What differs from kind (hack/kind-e2e.sh) is only how the cluster is made and how an image
# gets into it: here `kf-env import` into the node's containerd.
#
#   hack/e2e-node.sh          (root; KUBE_FENCE_IMAGE_PROFILE=debug for a faster image build)
set -euo pipefail
cd "$(dirname "$0")/.."
exec hack/test-node.sh -- hack/e2e-install-and-test.sh -- cargo run --quiet --locked -p kube-fence-testenv -- import
