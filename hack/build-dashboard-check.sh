#!/usr/bin/env bash
# Prints the path of dashboard-check (hack/dashboard-check/main.go: a Grafana dashboard checked
# against Grafana's dashboard schema, as github.com/grafana/grafana-foundation-sdk/go at
# GRAFANA_FOUNDATION_SDK_VERSION of hack/versions.env has it), built once from the Go module proxy
# into the cache (~/.cache/kube-fence/bin/dashboard-check-VERSION-DIGEST/), like promtool
# (hack/build-promtool.sh). Its module (go.mod, go.sum) is made at build time from the pinned
# version, checked against the Go checksum database. tests/monitoring.rs runs it on the chart's
# dashboard.
#
#   hack/build-dashboard-check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=hack/kind/common.sh
source hack/kind/common.sh
src=hack/dashboard-check
sdk=github.com/grafana/grafana-foundation-sdk/go
digest=$(sha256sum "$src/main.go" | cut -c1-12)
dir="$kf_cache/bin/dashboard-check-$GRAFANA_FOUNDATION_SDK_VERSION-$digest"
if [[ ! -x "$dir/dashboard-check" ]]; then
  command -v go >/dev/null 2>&1 || { echo "error: Go is needed to build dashboard-check" >&2; exit 1; }
  work=$(mktemp -d "${TMPDIR:-/tmp}/dashboard-check.XXXXXX")
  trap 'rm -rf "$work"' EXIT
  cp "$src/main.go" "$work/"
  mkdir -p "$dir"
  (
    cd "$work"
    export GOTOOLCHAIN=${GOTOOLCHAIN:-local} GOFLAGS=-mod=mod CGO_ENABLED=0
    go mod init kube-fence.dev/dashboard-check >&2
    go mod edit -require="$sdk@$GRAFANA_FOUNDATION_SDK_VERSION"
    go build -trimpath -ldflags "-s -w" -o "$dir/dashboard-check.tmp" . >&2
  )
  mv "$dir/dashboard-check.tmp" "$dir/dashboard-check"
fi
echo "$dir/dashboard-check"
