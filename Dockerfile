# The inference-cache binary (serve, subscribe, replay, demo) as a static
# musl executable in an otherwise empty image: no shell, no libc, no package
# manager at run time; runs as uid/gid 65532.
#
#   docker build -t ghcr.io/inference-cache/inference-cache:0.1.0 .
#   docker run --rm -p 9090:9090 ghcr.io/inference-cache/inference-cache:0.1.0 serve --admin-addr 0.0.0.0:8080
#
# cli/tests/container_image.rs builds the final stage's root filesystem
# from this file (the same static binary at the same path) and runs it.
FROM rust:1.95-bookworm AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends musl-tools \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# rust-toolchain.toml pins the toolchain; add the musl target to it.
RUN rustup target add x86_64-unknown-linux-musl
# The C code of ring and mimalloc needs a musl C compiler.
ENV CC_x86_64_unknown_linux_musl=musl-gcc
RUN cargo build --release --locked --target x86_64-unknown-linux-musl \
        -p inference-cache --bin inference-cache \
 && cp target/x86_64-unknown-linux-musl/release/inference-cache /inference-cache

FROM scratch
COPY --from=build /inference-cache /inference-cache
USER 65532:65532
# gRPC, admin HTTP (server), subscriber /metrics.
EXPOSE 9090 8080 9091
ENTRYPOINT ["/inference-cache"]
CMD ["serve", "--admin-addr", "0.0.0.0:8080"]
