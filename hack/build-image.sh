#!/usr/bin/env bash
# Builds the kube-fence container image without Docker: the static kube-fence binary (glibc
# with crt-static, rustls — no OpenSSL, no libc at run time) in an otherwise empty image, written
# as a docker-archive tarball that `ctr -n k8s.io images import`, `kf-env import` and
# `docker load` all take.
#
# The image config (User, Entrypoint, Cmd, where the binary goes) is read from the final stage
# of the repo's Dockerfile, so the Dockerfile (for `docker build`) and this script describe the
# same image; the script fails if the Dockerfile has changed shape in a way it cannot follow.
#
# Usage: hack/build-image.sh [--debug] [--ref IMAGE:TAG] [--out TAR]
#   --debug   debug profile (faster to compile; a bigger, slower binary). Default: release, as
#             the Dockerfile builds it.
#   --ref     default: ghcr.io/kube-fence/kube-fence:<chart appVersion> (what the chart runs)
#   --out     default: target/image/kube-fence.tar
# Prints the tarball path on stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { printf '[build-image %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { say "error: $*"; exit 1; }

profile=release ref="" out=""
while [[ $# -gt 0 ]]; do
  case $1 in
    --debug) profile=debug; shift ;;
    --ref) ref=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    *) die "unknown argument $1 (usage: $0 [--debug] [--ref IMAGE:TAG] [--out TAR])" ;;
  esac
done
app_version=$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' charts/kube-fence/Chart.yaml)
ref=${ref:-ghcr.io/kube-fence/kube-fence:${app_version:?no appVersion in charts/kube-fence/Chart.yaml}}
target_dir=${CARGO_TARGET_DIR:-target}
out=${out:-$target_dir/image/kube-fence.tar}

# The image config, from the Dockerfile's final stage.
final=$(awk '/^FROM /{buf=""} {buf=buf $0 "\n"} END{printf "%s", buf}' Dockerfile)
user=$(sed -n 's/^USER[[:space:]]\+\([^[:space:]]\+\)[[:space:]]*$/\1/p' <<<"$final")
entrypoint=$(sed -n 's/^ENTRYPOINT[[:space:]]\+\(\[.*\]\)[[:space:]]*$/\1/p' <<<"$final")
cmd=$(sed -n 's/^CMD[[:space:]]\+\(\[.*\]\)[[:space:]]*$/\1/p' <<<"$final")
path=$(sed -n 's/^COPY[[:space:]]\+--from=[^[:space:]]\+[[:space:]]\+[^[:space:]]\+[[:space:]]\+\(\/[^[:space:]]\+\)[[:space:]]*$/\1/p' <<<"$final")
[[ $(grep -c '^FROM ' <<<"$final") -eq 1 && $final == *"FROM scratch"* ]] || die "the Dockerfile's final stage is no longer FROM scratch; update $0 to build the same image"
[[ $(grep -c '^COPY' <<<"$final") -eq 1 && -n $path ]] || die "the Dockerfile's final stage must COPY exactly one file (the binary) to an absolute path; update $0"
[[ -n $user && -n $entrypoint && -n $cmd ]] || die "could not read USER, ENTRYPOINT [..] and CMD [..] from the Dockerfile's final stage"
extra=$(grep -vE '^(FROM|COPY|USER|ENTRYPOINT|CMD|#|[[:space:]]*$)' <<<"$final" || true)
[[ -z $extra ]] || die "the Dockerfile's final stage has instructions $0 does not reproduce: $extra"
grep -q 'RUSTFLAGS="-C target-feature=+crt-static"' Dockerfile || die "the Dockerfile no longer builds with RUSTFLAGS=\"-C target-feature=+crt-static\"; keep $0 in step"

say "building the static kube-fence binary ($profile profile; release takes minutes on 2 cores)"
args=(build --locked --bin kube-fence --target x86_64-unknown-linux-gnu)
[[ $profile == release ]] && args+=(--release)
# kube_fence_build_info's git_commit and rustc labels (src/telemetry.rs); left out where unknown.
KUBE_FENCE_GIT_COMMIT=$(git rev-parse --short=12 HEAD 2>/dev/null || true)
KUBE_FENCE_RUSTC=$(rustc --version 2>/dev/null | cut -d' ' -f2 || true)
export KUBE_FENCE_GIT_COMMIT KUBE_FENCE_RUSTC
RUSTFLAGS="-C target-feature=+crt-static" cargo "${args[@]}" >&2
bin=$target_dir/x86_64-unknown-linux-gnu/$profile/kube-fence
[[ -x $bin ]] || die "cargo did not produce $bin"
if command -v file >/dev/null 2>&1; then
  # "statically linked" or "static-pie linked"; never "dynamically linked" (needs a loader)
  file -L "$bin" | grep -qE 'static(ally|-pie) linked' || die "$bin is not statically linked: $(file -L "$bin")"
fi
# It must run with nothing around it: no loader, no libraries.
"$bin" --help >/dev/null || die "$bin --help failed"

say "writing $ref to $out (User $user, Entrypoint $entrypoint, Cmd $cmd)"
hack/make-image.sh --binary "$bin" --path "$path" --ref "$ref" --user "$user" --entrypoint "$entrypoint" --cmd "$cmd" --out "$out"
echo "$out"
