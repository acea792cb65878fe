#!/usr/bin/env bash
# Runs every check and test of the workspace on a fresh machine:
# installs the pinned toolchain and the test assets (Python venv, tokenizer
# files, Envoy), then format, lints, golden-vector parity, wasm builds and
# the full test suite, then every fuzz target briefly. Safe to re-run:
# downloads are cached under .cache/.
set -euo pipefail
cd "$(dirname "$0")/.."
export REPO="$PWD"
# A run from scratch gains nothing from incremental compilation, which only
# adds work and disk; set CARGO_INCREMENTAL=1 to keep it.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"

# Each step prints its title, and the previous step's wall time and CPU time
# (user + system of its processes: on a shared machine the wall time grows
# with the load, the CPU time much less), so a slow run says where the time
# went; the total and the load average are printed at the end.
TICKS=$(getconf CLK_TCK 2>/dev/null || echo 100)
cpu_seconds() {
    local stat
    read -r -a stat </proc/$$/stat 2>/dev/null || { echo 0; return; }
    # Fields 16 and 17: CPU time of the waited-for children, in clock ticks
    # (the command name in field 2 has no spaces: it is bash).
    echo $(((stat[15] + stat[16]) / TICKS))
}
SCRIPT_START=$SECONDS
SCRIPT_CPU=$(cpu_seconds)
STEP_START=$SECONDS
STEP_CPU=$SCRIPT_CPU
STEP_NAME=""
step() {
    local cpu
    cpu=$(cpu_seconds)
    if [ -n "$STEP_NAME" ]; then
        printf '    (%s: %ds, cpu %ds)\n' "$STEP_NAME" $((SECONDS - STEP_START)) $((cpu - STEP_CPU))
    fi
    STEP_NAME="$*"
    STEP_START=$SECONDS
    STEP_CPU=$cpu
    printf '\n==> %s\n' "$*"
}
printf 'load average at the start: %s\n' "$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null)"

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

# One build covers all three: the filter links the fingerprint and the
# messages-only proto (no default features), and its `wasm` profile is the
# one the Envoy and wasmtime tests load, so they find it already built.
step "wasm32-wasip1 build (fingerprint, messages-only proto, filter)"
cargo build -p inference-cache-fingerprint -p inference-cache-proto \
    -p inference-cache-filter --no-default-features \
    --target wasm32-wasip1 --profile wasm

step "cargo test --workspace: build"
cargo test --workspace --all-targets --no-run --message-format=json-render-diagnostics \
    >.cache/test-build.json

# The test binaries mostly wait (on the servers, Envoys, NATS and engines
# they start), so three run at once, each exactly as `cargo test` runs it;
# the Envoy binary's timing checks get the machine to themselves afterwards.
step "cargo test --workspace: run (three binaries at a time, then Envoy's alone; doc tests)"
.cache/venv/bin/python scripts/run-test-binaries.py .cache/test-build.json \
    --jobs 3 --alone envoy --first demo_e2e --first integration \
    --also "cargo test --workspace --doc"

step "fuzz targets, 10 s each (scripts/fuzz.sh)"
scripts/fuzz.sh 10

step "all checks passed"
printf '    (total: %ds, cpu %ds; load average at the end: %s)\n' \
    $((SECONDS - SCRIPT_START)) $(($(cpu_seconds) - SCRIPT_CPU)) \
    "$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null)"
