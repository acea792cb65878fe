#!/usr/bin/env bash
# Provides what cli/tests/container_image.rs needs to build the container
# image's static binary: the x86_64-unknown-linux-musl Rust target and a musl
# C compiler (`musl-gcc`, Debian `musl-tools`) for ring's C code.
# Idempotent.
set -euo pipefail

rustup target add x86_64-unknown-linux-musl >/dev/null

if ! command -v musl-gcc >/dev/null 2>&1; then
    if [[ "$(id -u)" == 0 ]]; then
        apt-get install -y --no-install-recommends musl-tools >/dev/null \
            || { apt-get update >/dev/null && apt-get install -y --no-install-recommends musl-tools >/dev/null; }
    elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        sudo apt-get install -y --no-install-recommends musl-tools >/dev/null \
            || { sudo apt-get update >/dev/null && sudo apt-get install -y --no-install-recommends musl-tools >/dev/null; }
    else
        echo "setup-musl: musl-gcc is missing; install Debian's musl-tools" >&2
        exit 1
    fi
fi
command -v musl-gcc
