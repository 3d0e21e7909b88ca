#!/usr/bin/env bash
# Builds the container image from the Dockerfile with podman, then runs it:
# `fencegate demo` inside it, and `serve` as its non-root user with a mounted
# config and data volume, answering /livez and /readyz, stopped by SIGTERM (exit
# 0, state flushed into the volume). Issue 30 §3; docs/deploy.md, "The container image".
#
#   scripts/image.sh            build and run (CI: .ci/run)
#   scripts/image.sh --build    build only
#
# - Tools: podman, buildah and friends from Debian (installed with apt-get when
#   missing, as root).
# - The binary: `cargo build --release --locked --bin fencegate` on the host,
#   copied in through the Dockerfile's `prebuilt` stage (no Rust image needed).
# - The base: $FENCEGATE_BASE_IMAGE when set (e.g. docker.io/library/debian:bookworm-slim
#   on a machine that can pull), else localhost/fencegate-base:bookworm, made once
#   from Debian's packages with mmdebstrap and imported (no registry needed).
# - If containers cannot run here with podman's defaults, the script says exactly
#   what failed and retries with runc and rlimits within this process's limits (a
#   private containers.conf); if that fails too, it keeps the image and checks
#   what needs no container: its filesystem, user, entrypoint and command.
#
# Work files: target/image/. Each step prints its time; the total is the last line.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$(pwd)
start=$SECONDS
step() { echo "=== image: $* ($((SECONDS - start)) s)"; }
fail() { echo "image.sh: $*" >&2; exit 1; }
BUILD_ONLY=no
[ "${1:-}" = "--build" ] && BUILD_ONLY=yes

IMAGE=${FENCEGATE_IMAGE:-localhost/fencegate:dev}
BASE=${FENCEGATE_BASE_IMAGE:-localhost/fencegate-base:bookworm}
WORK=$REPO/target/image
# Names of what this script starts, so that it removes only its own.
RUN_ID=fencegate-image-$$
mkdir -p "$WORK"

step "tools"
need=()
for t in podman:podman buildah:buildah mmdebstrap:mmdebstrap runc:runc crun:crun \
    iptables:iptables newuidmap:uidmap slirp4netns:slirp4netns fuse-overlayfs:fuse-overlayfs; do
    command -v "${t%%:*}" >/dev/null 2>&1 || need+=("${t#*:}")
done
if [ ${#need[@]} -gt 0 ]; then
    [ "$(id -u)" = 0 ] || fail "missing ${need[*]}: install them (apt-get install ${need[*]})"
    echo "installing ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # netavark/aardvark-dns: podman's bridge network; catatonit: its init.
    apt-get install -y -qq --no-install-recommends "${need[@]}" netavark aardvark-dns \
        catatonit containers-storage >/dev/null
fi
podman --version

step "binary: cargo build --release --locked --bin fencegate"
t0=$SECONDS
# The commit for --version and fencegate_build_info (read by src/main.rs only).
FENCEGATE_COMMIT=${FENCEGATE_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)} \
    cargo build --release --locked --bin fencegate
echo "release build: $((SECONDS - t0)) s"
BIN=$REPO/target/release/fencegate

step "base image $BASE"
if podman image exists "$BASE"; then
    echo "present"
elif [ -n "${FENCEGATE_BASE_IMAGE:-}" ]; then
    podman pull "$BASE"
else
    # Debian bookworm, minimal: what debian:bookworm-slim holds that the
    # Dockerfile uses (apt, useradd) plus CA certificates; no documentation.
    t0=$SECONDS
    rm -f "$WORK/base.tar"
    mmdebstrap --quiet --mode=root --variant=minbase \
        --include=ca-certificates,passwd \
        --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/doc/*' \
        --dpkgopt='path-include=/usr/share/doc/*/copyright' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        --dpkgopt='path-exclude=/usr/share/info/*' \
        --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
        bookworm "$WORK/base.tar" http://deb.debian.org/debian
    podman import --change 'CMD ["/bin/bash"]' "$WORK/base.tar" "$BASE" >/dev/null
    rm -f "$WORK/base.tar"
    echo "made with mmdebstrap in $((SECONDS - t0)) s"
fi

step "can containers run here?"
# Podman's defaults first. On failure, say what failed and try again with
# rlimits this process may set (a container cannot raise them without
# CAP_SYS_RESOURCE), then also with runc instead of crun (crun refuses cgroups in
# hybrid mode: v1 controllers beside a v2 hierarchy that holds one).
probe() { timeout 120 podman run --rm --network none "$BASE" /bin/true 2>&1; }
conf=$WORK/containers.conf
with_conf() { # runtime
    cat >"$conf" <<EOF
# Written by scripts/image.sh: podman's defaults failed on this machine.
[containers]
default_ulimits = ["nofile=$(ulimit -Hn):$(ulimit -Hn)", "nproc=4096:4096"]
[engine]
runtime = "$1"
EOF
    export CONTAINERS_CONF=$conf
}
RUNS=no
if out=$(probe); then
    RUNS=yes
    echo "yes, with podman's defaults"
else
    echo "podman's defaults: $out"
    for runtime in crun runc; do
        with_conf "$runtime"
        if out=$(probe); then
            RUNS=yes
            echo "yes, with $runtime and rlimits within this process's ($conf)"
            break
        fi
        echo "$runtime with rlimits within this process's: $out"
    done
    if [ "$RUNS" = no ]; then
        unset CONTAINERS_CONF
        echo "no: containers cannot run on this machine (above); building with chroot isolation"
    fi
fi

step "build $IMAGE (BINARY=prebuilt, BASE_IMAGE=$BASE)"
ctx=$WORK/context
rm -rf "$ctx" && mkdir -p "$ctx"
cp Dockerfile "$ctx/"
# The release profile keeps line tables (~120 MB of the ~140 MB binary): the
# image gets the binary without them; its symbols stay, for backtraces.
objcopy --strip-debug "$BIN" "$ctx/fencegate"
cp config/container.toml "$ctx/container.toml"
isolation=()
[ "$RUNS" = yes ] || isolation=(--isolation chroot)
t0=$SECONDS
old_id=$(podman image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null || true)
dangling_before=$(podman images -q --no-trunc --filter dangling=true | sort)
# Docker's format keeps the HEALTHCHECK (OCI's has none). (--layers=false would
# leave no intermediate images, but buildah 1.28 then fails after tagging on
# the `FROM ${BINARY} AS binary` stage: "identifier is not an image".)
podman build "${isolation[@]}" --format docker --pull=never \
    --build-arg BASE_IMAGE="$BASE" --build-arg BINARY=prebuilt \
    -t "$IMAGE" "$ctx"
# Remove what this build left behind: the image it replaced, its stages' images.
new_id=$(podman image inspect --format '{{.Id}}' "$IMAGE")
if [ -n "$old_id" ] && [ "$old_id" != "$new_id" ]; then
    podman rmi "$old_id" >/dev/null 2>&1 || true
fi
comm -13 <(echo "$dangling_before") <(podman images -q --no-trunc --filter dangling=true | sort) |
    xargs -r podman rmi >/dev/null 2>&1 || true
echo "image build: $((SECONDS - t0)) s; $(podman image inspect --format '{{.Size}}' "$IMAGE") bytes"

step "the image's user, entrypoint, command and files"
inspect() { podman image inspect --format "$1" "$IMAGE"; }
[ "$(inspect '{{.Config.User}}')" = "10001:10001" ] || fail "user is $(inspect '{{.Config.User}}')"
[ "$(inspect '{{json .Config.Entrypoint}}')" = '["/usr/local/bin/fencegate"]' ] ||
    fail "entrypoint is $(inspect '{{json .Config.Entrypoint}}')"
inspect '{{json .Config.Cmd}}'
inspect '{{json .Config.ExposedPorts}} {{json .Config.Volumes}} {{.Config.StopSignal}}'
mnt=$(podman image mount "$IMAGE")
trap 'podman image unmount "$IMAGE" >/dev/null 2>&1 || true' EXIT
cmp "$mnt/usr/local/bin/fencegate" "$ctx/fencegate" || fail "the image's binary is not the one just built"
cmp "$mnt/etc/fencegate/fencegate.toml" config/container.toml
[ -s "$mnt/etc/ssl/certs/ca-certificates.crt" ] || fail "no CA certificates"
grep -q '^fencegate:x:10001:10001:' "$mnt/etc/passwd" || fail "no fencegate user 10001"
[ "$(stat -c %u:%g "$mnt/var/lib/fencegate")" = 10001:10001 ] || fail "/var/lib/fencegate not the user's"
# The binary runs on the image's own libraries (glibc of the base).
chroot "$mnt" /usr/local/bin/fencegate --version
chroot "$mnt" /usr/local/bin/fencegate check-config --config /etc/fencegate/fencegate.toml >/dev/null
podman image unmount "$IMAGE" >/dev/null
trap - EXIT
echo "ok"

if [ "$BUILD_ONLY" = yes ]; then
    step "done (build only)"
    exit 0
fi
if [ "$RUNS" = no ]; then
    step "done: image built and inspected; not run (containers cannot run here, above)"
    exit 0
fi

cleanup() {
    podman rm -f --time 0 "$RUN_ID-serve" >/dev/null 2>&1 || true
}
trap cleanup EXIT

step "fencegate demo inside the image (read-only root)"
demo=$(timeout 120 podman run --rm --read-only --name "$RUN_ID-demo" "$IMAGE" demo 2>&1) ||
    { echo "$demo"; fail "demo failed"; }
echo "$demo" | grep '^OK:' || { echo "$demo"; fail "demo did not end with OK"; }

step "fencegate serve: mounted config and data volume, non-root, read-only root"
run=$WORK/run
rm -rf "$run" && mkdir -p "$run/data"
chown 10001:10001 "$run/data"
cat >"$run/fencegate.toml" <<'EOF'
# scripts/image.sh: the admin listener open to the host (with a token), the
# state and the dir lease store on the data volume.
[server]
listen = "0.0.0.0:8080"
admin_listen = "0.0.0.0:9090"
admin_token = "image-test-admin-token"
data_dir = "/var/lib/fencegate/state"
log_format = "json"
shutdown_delay_ms = 1000

[store]
kind = "dir"
path = "/var/lib/fencegate/leases"

[[route]]
name = "example"
path_prefix = "/example/"
upstream = "http://upstream.invalid/"
lease = "example"
EOF
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
pport=$(free_port)
aport=$(free_port)
# No timer for the image's HEALTHCHECK (podman's needs systemd): it is run once
# below. (podman 4.3 still logs that it cannot reach systemd for it: harmless.)
podman run -d --name "$RUN_ID-serve" --read-only --health-interval disable \
    -p "127.0.0.1:$pport:8080" -p "127.0.0.1:$aport:9090" \
    -v "$run/fencegate.toml:/etc/fencegate/fencegate.toml:ro" \
    -v "$run/data:/var/lib/fencegate" \
    "$IMAGE" >/dev/null
ready=no
for _ in $(seq 1 300); do
    if curl -fsS "http://127.0.0.1:$aport/readyz" >/dev/null 2>&1; then
        ready=yes
        break
    fi
    [ "$(podman inspect --format '{{.State.Running}}' "$RUN_ID-serve")" = true ] || break
    sleep 0.1
done
if [ "$ready" != yes ]; then
    podman logs "$RUN_ID-serve" >&2 || true
    fail "serve did not become ready"
fi
echo "readyz: $(curl -fsS "http://127.0.0.1:$aport/readyz" | tr -d ' \n')"
echo "livez:  $(curl -fsS "http://127.0.0.1:$aport/livez" | tr -d ' \n')"
# The image's HEALTHCHECK (curl /readyz inside the container).
podman healthcheck run "$RUN_ID-serve" || fail "the image's HEALTHCHECK failed"
echo "HEALTHCHECK: healthy"
pid=$(podman inspect --format '{{.State.Pid}}' "$RUN_ID-serve")
uid=$(awk '/^Uid:/ {print $2}' "/proc/$pid/status")
[ "$uid" = 10001 ] || fail "serve runs as uid $uid"
echo "serve runs as uid $uid (pid $pid on the host)"
# The proxy answers too: a request without X-Lease-Epoch is refused by
# fencegate itself (428 epoch_missing, SPEC §7), never forwarded.
err=$(curl -s -o /dev/null -w '%{http_code} %header{x-fencegate-error}' -X POST "http://127.0.0.1:$pport/example/x")
[ "$err" = "428 epoch_missing" ] || fail "the proxy answered \"$err\" to a request without X-Lease-Epoch"
echo "proxy: $err for a request without X-Lease-Epoch"

step "SIGTERM: exit 0, state flushed in the volume"
podman stop --time 30 "$RUN_ID-serve" >/dev/null
code=$(podman inspect --format '{{.State.ExitCode}}' "$RUN_ID-serve")
logs=$(podman logs "$RUN_ID-serve" 2>&1)
[ "$code" = 0 ] || { echo "$logs"; fail "exit code $code after SIGTERM"; }
echo "$logs" | grep -q 'durable state flushed' || { echo "$logs"; fail "no flush"; }
echo "$logs" | grep -q 'still serving for the shutdown delay' || { echo "$logs"; fail "no shutdown delay"; }
[ "$(stat -c %u "$run/data/state")" = 10001 ] || fail "state not written by uid 10001"
echo "exit 0; $(find "$run/data" -type f | wc -l) files in the volume, owned by $(stat -c %u:%g "$run/data/state")"
step "done"
