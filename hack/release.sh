#!/usr/bin/env bash
# Builds a kube-fence release: the static binary, the container image tarball (no Docker), the
# kubectl plugin's archive and its krew manifest (fence.yaml, hack/krew.sh), the
# packaged Helm chart, the crates, the CRDs, and SHA256SUMS over all of them — every artifact
# named and stamped with one version, the one in Cargo.toml's [workspace.package]. The script
# refuses to run when the chart, the image tag default, CHANGELOG.md or the workspace's pins of
# its own crates disagree with it (tests/release.rs checks the same), or when the work tree has
# uncommitted changes (the artifacts must be a commit's).
#
# Usage: hack/release.sh [--out DIR] [--allow-dirty] | --check
#   --check        only check that the versions agree and print the version
#   --out          default: dist/<version>
#   --allow-dirty  build from a work tree with uncommitted changes (for trying the script)
#   KUBE_FENCE_IMAGE_REPOSITORY   default: the chart's image.repository (ghcr.io/kube-fence/kube-fence)
# Prints the output directory on stdout. Needs Rust and, when helm is not on PATH, Go (helm is
# taken from the control-plane cache: hack/build-control-plane.sh).
#
# Publishing is left to a human: `cargo publish --workspace`, pushing the image (`skopeo copy
# docker-archive:<tar> docker://<ref>` or `docker load` + `docker push`), `helm push` of the
# chart, and a GitHub release with the files and SHA256SUMS.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { printf '[release %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { say "error: $*"; exit 1; }

out="" allow_dirty=false check=false
while [[ $# -gt 0 ]]; do
  case $1 in
    --check) check=true; shift ;;
    --out) out=${2:?--out needs a directory}; shift 2 ;;
    --allow-dirty) allow_dirty=true; shift ;;
    *) die "unknown argument $1 (usage: $0 [--out DIR] [--allow-dirty] | --check)" ;;
  esac
done

# The one version: [workspace.package] version in Cargo.toml (every published crate inherits it).
version=$(awk '/^\[/{p = ($0 == "[workspace.package]")} p && /^version *=/{gsub(/"/, "", $3); print $3; exit}' Cargo.toml)
[[ $version =~ ^[0-9]+\.[0-9]+\.[0-9]+(-[0-9A-Za-z.-]+)?$ ]] || die "no semantic version in Cargo.toml's [workspace.package]: '$version'"
# The workspace's own crates, as [workspace.dependencies] pins them (`name = { path = ..., version = "=V" }`).
while read -r name pin; do
  [[ $pin == "=$version" ]] || die "[workspace.dependencies] pins $name at $pin, not =$version"
done < <(awk '/^\[/{p = ($0 == "[workspace.dependencies]")} p && /^kube-fence-[a-z-]* *= *\{ *path/{match($0, /version *= *"[^"]*"/); v = substr($0, RSTART, RLENGTH); sub(/version *= *"/, "", v); sub(/"$/, "", v); print $1, v}' Cargo.toml)
chart_version=$(sed -n 's/^version: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' charts/kube-fence/Chart.yaml)
app_version=$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' charts/kube-fence/Chart.yaml)
image_tag=$(awk '/^image:/{p=1; next} /^[^ #]/{p=0} p && /^ +tag:/{v=$2; gsub(/"/, "", v); print v; exit}' charts/kube-fence/values.yaml)
repository=$(awk '/^image:/{p=1; next} /^[^ #]/{p=0} p && /^ +repository:/{print $2; exit}' charts/kube-fence/values.yaml)
changelog=$(sed -n 's/^## \[\([0-9][^]]*\)\].*/\1/p' CHANGELOG.md | head -n1)
[[ $chart_version == "$version" ]] || die "Chart.yaml version $chart_version != Cargo.toml version $version"
[[ $app_version == "$version" ]] || die "Chart.yaml appVersion $app_version != Cargo.toml version $version"
[[ -z $image_tag || $image_tag == "$version" ]] || die "values.yaml image.tag $image_tag is neither empty (= appVersion) nor $version"
[[ $changelog == "$version" ]] || die "CHANGELOG.md's newest release is [$changelog], not [$version]: move Unreleased into a [$version] section"
if $check; then echo "$version"; exit 0; fi

if ! $allow_dirty && [[ -n $(git status --porcelain 2>/dev/null || echo "not a git work tree") ]]; then
  die "the work tree has uncommitted changes (or is not a git work tree); commit them, or pass --allow-dirty"
fi
commit=$(git rev-parse HEAD 2>/dev/null || echo unknown)

target_dir=${CARGO_TARGET_DIR:-target}
out=${out:-dist/$version}
mkdir -p "$out"
out=$(cd "$out" && pwd)
rm -f "$out"/kube-fence* "$out"/kubectl-fence* "$out"/fence.yaml "$out"/SHA256SUMS
ref=${KUBE_FENCE_IMAGE_REPOSITORY:-$repository}:$version
say "kube-fence $version from commit $commit into $out"

# 1. The static binary and the image that holds it (one cargo build, in hack/build-image.sh).
hack/build-image.sh --ref "$ref" --out "$out/kube-fence-$version-image.tar" >/dev/null
bin=$target_dir/x86_64-unknown-linux-gnu/release/kube-fence
reported=$("$bin" --version)
[[ $reported == "kube-fence $version" ]] || die "$bin --version says '$reported', not 'kube-fence $version'"
install -m 0755 "$bin" "$out/kube-fence-$version-x86_64-unknown-linux-gnu"
# The same binary as the krew plugin `fence`: its archive, and the manifest naming it by sha256.
hack/krew.sh "$bin" "$version" "$out" >/dev/null

# 2. The chart, versioned from Cargo.toml (the check above makes these flags restate Chart.yaml).
if command -v helm >/dev/null 2>&1; then helm=helm; else helm=$(hack/build-control-plane.sh)/helm; fi
"$helm" lint --strict charts/kube-fence >&2
"$helm" package charts/kube-fence --version "$version" --app-version "$version" --destination "$out" >&2
[[ -f $out/kube-fence-$version.tgz ]] || die "helm package did not write kube-fence-$version.tgz"

# 3. The crates (what `cargo publish --workspace` uploads; packaging builds each from the packaged
#    files alone, the workspace's own dependencies from the crates packaged with it).
crates=(kube-fence-api kube-fence-client kube-fence kube-fence-test-support)
cargo package --locked "${crates[@]/#/--package=}" >&2
for crate in "${crates[@]}"; do cp "$target_dir/package/$crate-$version.crate" "$out/"; done

# 4. The CRDs, for `kubectl apply -f` before `helm install` / `helm upgrade` (Helm never upgrades CRDs).
cp crds/kubefence.io_leases.yaml "$out/kube-fence-$version-crds.yaml"

(cd "$out" && sha256sum kube-fence* kubectl-fence* fence.yaml > SHA256SUMS && sha256sum --check --quiet SHA256SUMS)
say "done:"
(cd "$out" && ls -l kube-fence* kubectl-fence* fence.yaml SHA256SUMS >&2)
echo "$out"
