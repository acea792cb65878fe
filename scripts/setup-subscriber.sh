#!/usr/bin/env bash
# Provides the Python interpreter of the KV-event subscriber's tests and
# bench: the venv at $REPO/.cache/venv that the other test tools share
# (created when missing), with pyzmq and msgpack installed when it cannot
# import them yet, pinned to $PYZMQ_VERSION and $MSGPACK_VERSION (default
# 27.1.0 and 1.1.2); an interpreter that imports them already is left as it
# is, so a re-run changes nothing. With them, subscriber/tests/kv_publisher.py
# stands in for a vLLM engine: it publishes byte-exact KV-event batches over
# ZMQ, answers replay requests, sends the ingest bench's load, and writes the
# decoder's test fixtures. scripts/test.sh runs it with the other setup
# scripts. Prints the interpreter's path as its last line of standard output
# (pip's output goes to standard error).
#
#   scripts/setup-subscriber.sh
#   PYTHON=$(scripts/setup-subscriber.sh | tail -n1)
#
# The tests look for the interpreter at $KV_EVENTS_PYTHON, else
# .cache/venv/bin/python.
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
