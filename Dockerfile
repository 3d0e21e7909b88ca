# fencegate container image.
#
# Where the binary comes from is the build argument BINARY, a stage name:
#
# - `build` (the default) compiles it in a Rust image:
#
#     docker build --build-arg FENCEGATE_COMMIT=$(git rev-parse --short=12 HEAD) -t fencegate .
#
# - `prebuilt` takes one built on the host (`cargo build --release --locked --bin
#   fencegate`) from a build context holding `fencegate` and `container.toml`.
#   scripts/image.sh does this with podman, and when no base image can be pulled
#   it makes BASE_IMAGE from Debian's packages (mmdebstrap); see docs/deploy.md.
#
# The runtime base is the build argument BASE_IMAGE (Debian bookworm: the Rust
# image's glibc must not be newer than the base's).
#
#   docker run -p 8080:8080 -p 9090:9090 \
#     -v $PWD/fencegate.toml:/etc/fencegate/fencegate.toml:ro \
#     -v fencegate-data:/var/lib/fencegate fencegate
#
# The config must listen on 0.0.0.0 inside the container and keep its sled state
# under /var/lib/fencegate (a volume: the high-water marks must survive restarts).
ARG BASE_IMAGE=debian:bookworm-slim
ARG BINARY=build

# ---- build stage: dependencies cached in their own layer ----
FROM rust:1.95-slim-bookworm AS build
WORKDIR /src
# The commit for fencegate_build_info and --version (no .git in the context).
ARG FENCEGATE_COMMIT=unknown
ENV FENCEGATE_COMMIT=${FENCEGATE_COMMIT}
COPY Cargo.toml Cargo.lock ./
# Cargo.toml declares the benches: their files must exist for the manifest to
# load (tests/it/ops.rs checks every path the manifest names is copied).
COPY benches ./benches
RUN mkdir src && echo 'fn main() {}' > src/main.rs && touch src/lib.rs \
    && cargo build --release --locked --bin fencegate \
    && rm -rf src target/release/.fingerprint/fencegate-*
COPY src ./src
# Built into the binary (include_str!): the admin API's OpenAPI description.
COPY docs/openapi.json ./docs/openapi.json
COPY config ./config
RUN cargo build --release --locked --bin fencegate \
    && /src/target/release/fencegate check-config --config /src/config/container.toml

# ---- or: the binary built on the host (scripts/image.sh), at the same paths ----
FROM scratch AS prebuilt
COPY fencegate /src/target/release/fencegate
COPY container.toml /src/config/container.toml

# The stage named by BINARY (BuildKit and buildah build only the stages used).
FROM ${BINARY} AS binary

# ---- runtime stage: slim, non-root (numeric, so Kubernetes' runAsNonRoot can
# check it), CA certificates for https upstreams ----
FROM ${BASE_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates curl \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 fencegate \
    && useradd --system --uid 10001 --gid 10001 --home /var/lib/fencegate fencegate \
    && mkdir -p /etc/fencegate /var/lib/fencegate \
    && chown fencegate:fencegate /var/lib/fencegate
COPY --from=binary /src/target/release/fencegate /usr/local/bin/fencegate
COPY --from=binary /src/config/container.toml /etc/fencegate/fencegate.toml
USER 10001:10001
WORKDIR /var/lib/fencegate
VOLUME ["/var/lib/fencegate"]
EXPOSE 8080 9090
# Ready, not just alive: the store and the state answer (and, in a cluster,
# every shard has an owner it can reach); 503 from SIGTERM on.
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
    CMD ["curl", "-fsS", "http://127.0.0.1:9090/readyz"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/fencegate"]
CMD ["serve", "--config", "/etc/fencegate/fencegate.toml", "--log-format", "json"]
