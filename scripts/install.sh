#!/usr/bin/env bash
# Installs what Conveyor needs on a fresh machine: redis-server and g++ (when missing), a
# virtualenv at .venv with the pinned CPU torch first, then the project with its test and
# bench extras. With --peers: only what `make bench-peers` needs beyond that.
set -euo pipefail
cd "$(dirname "$0")/.."

# apt_install PACKAGE WHY: install a Debian package, or say what to do without apt-get.
apt_install() {
    echo "installing $1"
    if command -v apt-get >/dev/null 2>&1; then
        SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
        $SUDO apt-get update -q && $SUDO apt-get install -y -q "$1"
    else
        echo "$1 is missing and apt-get is not available: $2" >&2
        exit 1
    fi
}

# `make bench-peers`: vLLM's CPU docs ask for tcmalloc preloaded (the bench preloads it when
# it is there, and runs vLLM slower without it).
if [ "${1:-}" = "--peers" ]; then
    ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal ||
        apt_install libgoogle-perftools4 "install gperftools' tcmalloc for vLLM and retry"
    exit 0
fi

command -v redis-server >/dev/null 2>&1 || apt_install redis-server "install Redis 6+ and retry"
# g++ builds the workers' CPU attention kernel (without it they fall back to plain torch)
command -v g++ >/dev/null 2>&1 || apt_install g++ "install a C++ compiler and retry"

PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip
# The CPU build: an unpinned torch would pull a multi-GB CUDA build.
.venv/bin/python -c "import torch" 2>/dev/null || $PIP install -q "torch==${TORCH_VERSION:-2.13.0}"
$PIP install -q -e ".[test,bench]"
