#!/usr/bin/env bash
# Prints the path of promtool (github.com/prometheus/prometheus/cmd/promtool at PROMTOOL_VERSION of
# hack/versions.env), built once from the Go module proxy into the cache
# (~/.cache/kube-fence/bin/promtool-VERSION/), as the other Go tools are (hack/kind/common.sh).
# tests/monitoring.rs runs it to check the chart's PrometheusRule (`promtool check rules`,
# `promtool test rules`).
#
#   hack/build-promtool.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=hack/kind/common.sh
source hack/kind/common.sh
go_tool github.com/prometheus/prometheus/cmd/promtool "$PROMTOOL_VERSION"
