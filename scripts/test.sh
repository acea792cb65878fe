#!/usr/bin/env bash
# Runs every check and test of the workspace on a fresh machine:
# installs the pinned toolchain and the test assets (Python venv, tokenizer
# files, Envoy), then format, lints, golden-vector parity, wasm builds and
# the full test suite, then every fuzz target briefly. Safe to re-run:
# downloads are cached under .cache/.
set -euo pipefail
cd "$(dirname "$0")/.."
export REPO="$PWD"

# Each step prints its title, and the previous step's wall time, so a slow
# run says where the time went; the total is printed at the end.
SCRIPT_START=$SECONDS
STEP_START=$SECONDS
STEP_NAME=""
step() {
    if [ -n "$STEP_NAME" ]; then
        printf '    (%s: %ds)\n' "$STEP_NAME" $((SECONDS - STEP_START))
    fi
    STEP_NAME="$*"
    STEP_START=$SECONDS
    printf '\n==> %s\n' "$*"
}

step "toolchain (rust-toolchain.toml)"
rustup toolchain install --no-self-update >/dev/null
rustup show active-toolchain

step "python venv"
if [ ! -x .cache/venv/bin/python ]; then
    python3 -m venv .cache/venv
fi
.cache/venv/bin/pip install --quiet --disable-pip-version-check -r scripts/requirements-test.txt

for setup in scripts/setup-*.sh; do
    [ -e "$setup" ] || continue
    step "$setup"
    bash "$setup"
done

step "golden vectors: regenerate with the Python reference and compare"
.cache/venv/bin/python golden/generate.py --check golden/golden_vectors.json

step "cargo fmt --check"
cargo fmt --all --check

step "cargo clippy --all-targets -- -D warnings"
cargo clippy --workspace --all-targets -- -D warnings

step "wasm32-wasip1 builds (fingerprint, messages-only proto, filter)"
cargo build -p inference-cache-fingerprint --target wasm32-wasip1
cargo build -p inference-cache-proto --no-default-features --target wasm32-wasip1
if [ -f filter/Cargo.toml ] && grep -q cdylib filter/Cargo.toml; then
    cargo build -p inference-cache-filter --target wasm32-wasip1 --profile wasm
fi

step "cargo test --workspace"
cargo test --workspace --all-targets --no-fail-fast
cargo test --workspace --doc

step "fuzz targets, 10 s each (scripts/fuzz.sh)"
scripts/fuzz.sh 10

step "all checks passed"
printf '    (total: %ds)\n' $((SECONDS - SCRIPT_START))
