# Sourced by hack/kind-node-image.sh and hack/kind-e2e.sh (from the repository's root): the
# pinned versions (hack/versions.env), the cache, Go tools.
# shellcheck shell=bash

# shellcheck source=hack/versions.env
source hack/versions.env

kf_cache=${KUBE_FENCE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kube-fence}

# go_tool MODULE/PATH/TO/CMD VERSION: builds a Go command once into the cache, prints its path.
go_tool() {
  local pkg=$1 version=$2 name dir
  name=$(basename "$pkg")
  dir="$kf_cache/bin/$name-$version"
  if [[ ! -x "$dir/$name" ]]; then
    command -v go >/dev/null 2>&1 || { echo "error: Go is needed to build $name $version" >&2; return 1; }
    mkdir -p "$dir"
    GOTOOLCHAIN=${GOTOOLCHAIN:-local} GOFLAGS=-mod=mod CGO_ENABLED=0 GOBIN="$dir" \
      go install -trimpath -ldflags "-s -w" "$pkg@$version" >&2
  fi
  echo "$dir/$name"
}

kind_bin() { go_tool sigs.k8s.io/kind "$KIND_VERSION"; }

# kind's module source (the base image's files live in images/base/files).
kind_module_dir() {
  GOTOOLCHAIN=${GOTOOLCHAIN:-local} GOFLAGS=-mod=mod go mod download -json "sigs.k8s.io/kind@$KIND_VERSION" \
    | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p'
}
