# kube-fence: one static binary (rustls, no OpenSSL) in an empty image, run as non-root.
#   docker build -t kube-fence:dev .
# The same image is built without Docker by hack/build-image.sh from the same static binary
# (RUSTFLAGS below): it reads USER, ENTRYPOINT, CMD and the COPY destination from the final stage
# and refuses to run if that stage gains anything it does not reproduce. Keep the two in step.
FROM docker.io/library/rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN RUSTFLAGS="-C target-feature=+crt-static" \
    cargo build --release --locked --bin kube-fence --target x86_64-unknown-linux-gnu \
 && cp target/x86_64-unknown-linux-gnu/release/kube-fence /kube-fence

FROM scratch
COPY --from=build /kube-fence /kube-fence
# 65532 = "nonroot" in distroless images; no shell, no package manager, nothing to escalate to.
USER 65532:65532
ENTRYPOINT ["/kube-fence"]
CMD ["run"]
