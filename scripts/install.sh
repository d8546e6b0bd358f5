#!/usr/bin/env bash
# Installs what Conveyor needs on a fresh machine: redis-server (when missing), a virtualenv
# at .venv with the pinned CPU torch first, then the project with its test and bench extras.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v redis-server >/dev/null 2>&1; then
    echo "installing redis-server"
    if command -v apt-get >/dev/null 2>&1; then
        SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
        $SUDO apt-get update -q && $SUDO apt-get install -y -q redis-server
    else
        echo "redis-server is missing and apt-get is not available: install Redis 6+ and retry" >&2
        exit 1
    fi
fi

PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip
# The CPU build: an unpinned torch would pull a multi-GB CUDA build.
.venv/bin/python -c "import torch" 2>/dev/null || $PIP install -q "torch==${TORCH_VERSION:-2.13.0}"
$PIP install -q -e ".[test,bench]"
