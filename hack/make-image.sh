#!/usr/bin/env bash
# Writes a container image holding one static binary as a docker-archive tarball (the format of
# `docker save`), without Docker: manifest.json, an image config, one layer. containerd takes it
# with `ctr -n k8s.io images import <tar>`, Docker with `docker load -i <tar>`. The output is
# reproducible: same binary and options, same bytes (fixed mtimes, owners and order). Env PATH is
# the default `docker build` gives a FROM scratch image, so the config matches the Dockerfile's.
#
# Usage: hack/make-image.sh --binary FILE --ref IMAGE:TAG --out TAR
#          [--path /name-in-image] [--user UID:GID] [--entrypoint JSON-ARRAY] [--cmd JSON-ARRAY]
#   --path        where the binary goes in the image (default: /<basename of FILE>)
#   --user        the config's User (default: 65532:65532, "nonroot")
#   --entrypoint  default: ["<path>"]
#   --cmd         default: none
set -euo pipefail
die() { printf '[make-image] error: %s\n' "$*" >&2; exit 1; }

binary="" ref="" out="" path="" user="65532:65532" entrypoint="" cmd=""
while [[ $# -gt 0 ]]; do
  case $1 in
    --binary) binary=$2 ;; --ref) ref=$2 ;; --out) out=$2 ;; --path) path=$2 ;;
    --user) user=$2 ;; --entrypoint) entrypoint=$2 ;; --cmd) cmd=$2 ;;
    *) die "unknown argument $1 (see the usage at the top of $0)" ;;
  esac
  shift 2 || die "$1 needs a value"
done
[[ -n $binary && -n $ref && -n $out ]] || die "--binary, --ref and --out are required"
[[ -f $binary ]] || die "no such file: $binary"
path=${path:-/$(basename "$binary")}
[[ $path == /* && $path != */ ]] || die "--path must be an absolute file path: $path"
entrypoint=${entrypoint:-[\"$path\"]}
# A dynamically linked binary would start a container that fails with "no such file or directory".
if command -v file >/dev/null 2>&1 && file -L "$binary" | grep -q 'dynamically linked'; then
  die "$binary is dynamically linked; an image with nothing else in it needs a static binary"
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/kube-fence-image.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/root$(dirname "$path")"
install -m 0755 "$binary" "$work/root$path"
tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner --format=posix \
  --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime \
  -C "$work/root" -cf "$work/layer.tar" "${path#/}"
layer_sha=$(sha256sum "$work/layer.tar" | cut -d' ' -f1)
mkdir -p "$work/out/$layer_sha"
mv "$work/layer.tar" "$work/out/$layer_sha/layer.tar"

cmd_json=""
[[ -n $cmd ]] && cmd_json=",\"Cmd\":$cmd"
printf '{"architecture":"amd64","os":"linux","created":"1970-01-01T00:00:00Z","config":{"User":"%s","Env":["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],"Entrypoint":%s%s},"rootfs":{"type":"layers","diff_ids":["sha256:%s"]},"history":[{"created":"1970-01-01T00:00:00Z","created_by":"hack/make-image.sh %s"}]}' \
  "$user" "$entrypoint" "$cmd_json" "$layer_sha" "$path" > "$work/config.json"
config_sha=$(sha256sum "$work/config.json" | cut -d' ' -f1)
mv "$work/config.json" "$work/out/$config_sha.json"
printf '[{"Config":"%s.json","RepoTags":["%s"],"Layers":["%s/layer.tar"]}]' "$config_sha" "$ref" "$layer_sha" > "$work/out/manifest.json"

mkdir -p "$(dirname "$out")"
tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$work/out" -cf "$out.tmp" .
mv "$out.tmp" "$out"
printf '[make-image] %s -> %s (config sha256:%s)\n' "$ref" "$out" "$config_sha" >&2
