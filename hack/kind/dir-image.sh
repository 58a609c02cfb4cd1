#!/usr/bin/env bash
# Writes a directory tree as a one-layer container image, a docker-archive tarball (the format
# of `docker save`), without Docker — the multi-file sibling of hack/make-image.sh. `docker load`
# and `ctr images import` take it. Owners, modes, symlinks and device nodes are kept as they are
# in the tree (run as root); mtimes are fixed, so the same tree gives the same bytes.
#
# Usage: hack/kind/dir-image.sh --dir DIR --ref IMAGE:TAG --out TAR
#          [--entrypoint JSON-ARRAY] [--cmd JSON-ARRAY] [--user U] [--env 'K=V' ...]
#          [--stop-signal SIG]
set -euo pipefail
die() { printf '[dir-image] error: %s\n' "$*" >&2; exit 1; }

dir="" ref="" out="" entrypoint="" cmd="" user="" stop_signal=""
envs=("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
while [[ $# -gt 0 ]]; do
  case $1 in
    --dir) dir=$2 ;; --ref) ref=$2 ;; --out) out=$2 ;; --entrypoint) entrypoint=$2 ;;
    --cmd) cmd=$2 ;; --user) user=$2 ;; --env) envs+=("$2") ;; --stop-signal) stop_signal=$2 ;;
    *) die "unknown argument $1 (see the usage at the top of $0)" ;;
  esac
  shift 2 || die "$1 needs a value"
done
[[ -n $dir && -n $ref && -n $out ]] || die "--dir, --ref and --out are required"
[[ -d $dir ]] || die "no such directory: $dir"

work=$(mktemp -d "$(dirname "$out")/.dir-image.XXXXXX")
trap 'rm -rf "$work"' EXIT
tar --sort=name --mtime=@0 --numeric-owner --format=posix --xattrs --xattrs-include='security.capability' \
  --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime \
  -C "$dir" -cf "$work/layer.tar" .
layer_sha=$(sha256sum "$work/layer.tar" | cut -d' ' -f1)
mkdir -p "$work/out/$layer_sha"
mv "$work/layer.tar" "$work/out/$layer_sha/layer.tar"

json_str() { local s=${1//\\/\\\\}; s=${s//\"/\\\"}; printf '"%s"' "$s"; }
env_json=""
for e in "${envs[@]}"; do env_json+="${env_json:+,}$(json_str "$e")"; done
config="\"Env\":[$env_json]"
[[ -n $user ]] && config+=",\"User\":$(json_str "$user")"
[[ -n $entrypoint ]] && config+=",\"Entrypoint\":$entrypoint"
[[ -n $cmd ]] && config+=",\"Cmd\":$cmd"
[[ -n $stop_signal ]] && config+=",\"StopSignal\":$(json_str "$stop_signal")"
printf '{"architecture":"amd64","os":"linux","created":"1970-01-01T00:00:00Z","config":{%s},"rootfs":{"type":"layers","diff_ids":["sha256:%s"]},"history":[{"created":"1970-01-01T00:00:00Z","created_by":"hack/kind/dir-image.sh"}]}' \
  "$config" "$layer_sha" > "$work/config.json"
config_sha=$(sha256sum "$work/config.json" | cut -d' ' -f1)
mv "$work/config.json" "$work/out/$config_sha.json"
printf '[{"Config":"%s.json","RepoTags":["%s"],"Layers":["%s/layer.tar"]}]' "$config_sha" "$ref" "$layer_sha" > "$work/out/manifest.json"
tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$work/out" -cf "$out.tmp" .
mv "$out.tmp" "$out"
printf '[dir-image] %s -> %s (config sha256:%s)\n' "$ref" "$out" "$config_sha" >&2
