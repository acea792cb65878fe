#!/usr/bin/env bash
# Installs the Python side of the KV-event subscriber tests: pyzmq and msgpack
# into the shared venv at $REPO/.cache/venv. The test publisher
# (subscriber/tests/kv_publisher.py) uses them to emit byte-exact vLLM KV-event
# batches. Idempotent. Prints the venv's python on its last line.
#
#   scripts/setup-subscriber.sh
#   PYTHON=$(scripts/setup-subscriber.sh | tail -n1)
#
# Tests look for the interpreter at $KV_EVENTS_PYTHON, else .cache/venv/bin/python.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$REPO/.cache/venv"
PYZMQ_VERSION="${PYZMQ_VERSION:-27.1.0}"
MSGPACK_VERSION="${MSGPACK_VERSION:-1.1.2}"

mkdir -p "$REPO/.cache"
if [[ ! -x "$VENV/bin/python" ]]; then
    python3 -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c 'import zmq, msgpack' >/dev/null 2>&1; then
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
        "pyzmq==$PYZMQ_VERSION" "msgpack==$MSGPACK_VERSION" >&2
fi
"$VENV/bin/python" -c 'import zmq, msgpack' >&2
echo "$VENV/bin/python"
