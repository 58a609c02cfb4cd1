#!/usr/bin/env bash
# Packs kube-fence as the krew plugin `fence` (kubectl fence): the archive krew installs from,
# kubectl-fence-<version>-x86_64-unknown-linux-gnu.tar.gz (the binary named kubectl-fence, and
# LICENSE; reproducible: sorted, owner 0, the commit's time), and fence.yaml, the krew manifest
# that names the archive by its release URL and its sha256 (what a krew-index pull request adds
# as plugins/fence.yaml). hack/release.sh calls it; tests/release.rs runs it and checks the
# manifest's checksum against the archive.
#
# Usage: hack/krew.sh BINARY VERSION OUT_DIR    (prints the manifest's path)
set -euo pipefail
cd "$(dirname "$0")/.."
die() { printf '[krew] error: %s\n' "$*" >&2; exit 1; }
[[ $# -eq 3 ]] || die "usage: $0 BINARY VERSION OUT_DIR"
bin=$1 version=$2 out=$3
[[ -x $bin ]] || die "$bin is not an executable"
[[ $version =~ ^[0-9]+\.[0-9]+\.[0-9]+(-[0-9A-Za-z.-]+)?$ ]] || die "'$version' is not a semantic version"
mkdir -p "$out"
target=x86_64-unknown-linux-gnu
archive=kubectl-fence-$version-$target.tar.gz
# The repository of [workspace.package] in Cargo.toml; releases are published there.
repository=$(awk '/^\[/{p = ($0 == "[workspace.package]")} p && /^repository *=/{gsub(/"/, "", $3); print $3; exit}' Cargo.toml)
[[ -n $repository ]] || die "no repository in Cargo.toml's [workspace.package]"

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
install -m 0755 "$bin" "$stage/kubectl-fence"
install -m 0644 LICENSE "$stage/LICENSE"
mtime=$(git log -1 --format=%ct 2>/dev/null || echo 0)
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime="@$mtime" -C "$stage" -cf - LICENSE kubectl-fence | gzip -n > "$out/$archive"
sha256=$(sha256sum "$out/$archive" | cut -d' ' -f1)

cat > "$out/fence.yaml" <<YAML
apiVersion: krew.googlecontainertools.github.com/v1alpha2
kind: Plugin
metadata:
  name: fence
spec:
  version: v$version
  homepage: $repository
  shortDescription: Fencing tokens for leases; write only with the newest
  description: |
    kube-fence's command line as a kubectl plugin: acquire, renew and release
    kube-fence Leases (each grant a strictly increasing fencing token), run a
    command while holding one (lease run), make fenced writes and deletes with
    a token, and show every fence and lease with the writes refused.
  caveats: |
    kubectl fence talks to the kube-fence controller and webhook: install them
    first (the Helm chart, see $repository).
    kubectl passes no flags to plugins: write them after the plugin's name,
    e.g. kubectl fence --context prod status -A.
  platforms:
  - selector:
      matchLabels:
        os: linux
        arch: amd64
    uri: $repository/releases/download/v$version/$archive
    sha256: $sha256
    bin: kubectl-fence
    files:
    - from: kubectl-fence
      to: .
    - from: LICENSE
      to: .
YAML
echo "$out/fence.yaml"
