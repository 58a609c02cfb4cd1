#!/usr/bin/env bash
# Builds examples/leader-go — an unmodified client-go leader-elected controller — from the Go
# module proxy (its go.mod pins k8s.io/client-go, api and apimachinery at one release) and
# prints the binary's path. Cached by the client-go version and a digest of the sources, like
# hack/build-control-plane.sh caches the control plane: a warm run takes a moment.
#
# Usage: hack/build-leader-go.sh [--image]
#   --image  also package it as an image (hack/make-image.sh) and print the tarball's path on a
#            second line and its ref, localhost/kube-fence/leader-go:<version>, on a third
#   KUBE_FENCE_CACHE   cache root (default: ${XDG_CACHE_HOME:-$HOME/.cache}/kube-fence)
set -euo pipefail
cd "$(dirname "$0")/.."
say() { printf '[leader-go build %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

image=false
for arg in "$@"; do
  case $arg in
    --image) image=true ;;
    *) echo "usage: $0 [--image]" >&2; exit 2 ;;
  esac
done
src=examples/leader-go
client_go=$(awk '$1 == "k8s.io/client-go" { print $2 }' "$src/go.mod")
digest=$(cat "$src/go.mod" "$src/go.sum" "$src/main.go" | sha256sum | cut -c1-12)
version="client-go-$client_go-$digest"
cache=${KUBE_FENCE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kube-fence}
bin="$cache/bin/leader-go-$version/leader-go"
if [[ ! -x $bin ]]; then
  command -v go >/dev/null 2>&1 || { say "error: Go is not installed (need Go >= 1.26)"; exit 1; }
  say "building $src ($version)"
  mkdir -p "$(dirname "$bin")"
  (cd "$src" && GOTOOLCHAIN=${GOTOOLCHAIN:-local} CGO_ENABLED=0 GOFLAGS=-mod=mod go build -trimpath -ldflags=-s -o "$bin.tmp" .)
  mv "$bin.tmp" "$bin"
fi
echo "$bin"
if $image; then
  tar="$(dirname "$bin")/leader-go-image.tar"
  ref="localhost/kube-fence/leader-go:$version"
  [[ -f $tar ]] || hack/make-image.sh --binary "$bin" --ref "$ref" --out "$tar"
  echo "$tar"
  echo "$ref"
fi
