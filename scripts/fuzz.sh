#!/usr/bin/env bash
# Runs every cargo-fuzz target in fuzz/ for SECONDS each (default 10) and
# prints, per target, the executions, the new inputs found and the crashes.
# Exits non-zero when any target crashes, hangs or fails to run.
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]
#
# Installs cargo-fuzz from crates.io when missing. cargo-fuzz passes
# nightly-only flags; on the pinned stable toolchain RUSTC_BOOTSTRAP=1 lets
# them through. No sanitizer: the workspace denies unsafe code, so
# AddressSanitizer would mostly halve the speed; panics, aborts, timeouts
# and out-of-memory are all caught without it.
#
# The seed corpora in fuzz/corpus/<target>/ are read, never written: new
# inputs go to fuzz/target/corpus/<target>/ (git-ignored, kept between runs)
# and crash reproducers to fuzz/artifacts/<target>/ (git-ignored). Replay one
# with: RUSTC_BOOTSTRAP=1 cargo fuzz run --sanitizer none <target> <file>
set -euo pipefail
cd "$(dirname "$0")/.."

SECONDS_EACH="${1:-10}"
shift || true
TARGETS=("$@")
if [ ${#TARGETS[@]} -eq 0 ]; then
    TARGETS=(subscriber_decode engine_metrics filter_body policy_yaml prompt_template index_ops)
fi
export RUSTC_BOOTSTRAP=1
FUZZ_FLAGS=(--sanitizer none)

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "==> installing cargo-fuzz"
    cargo install cargo-fuzz --locked
fi

echo "==> building fuzz targets"
build_start=$SECONDS
cargo fuzz build "${FUZZ_FLAGS[@]}"
echo "    (build: $((SECONDS - build_start))s)"

# Targets run side by side, one per core (FUZZ_JOBS to change): each is a
# single-threaded libFuzzer process with its own corpus, log and artifacts.
JOBS="${FUZZ_JOBS:-$(nproc 2>/dev/null || echo 1)}"

# Runs one target; writes its exit status and wall time to fuzz/target/<target>.result.
run_target() {
    local target="$1" work="fuzz/target/corpus/$1" log="fuzz/target/$1.log"
    local start=$SECONDS status=0
    mkdir -p "$work" "fuzz/artifacts/$target"
    cargo fuzz run "${FUZZ_FLAGS[@]}" "$target" "$work" "fuzz/corpus/$target" -- \
        -max_total_time="$SECONDS_EACH" -timeout=10 -rss_limit_mb=2048 \
        -print_final_stats=1 >"$log" 2>&1 || status=$?
    echo "$status $((SECONDS - start))" >"fuzz/target/$target.result"
}

running=0
for target in "${TARGETS[@]}"; do
    if [ "$running" -ge "$JOBS" ]; then
        wait -n || true
        running=$((running - 1))
    fi
    echo "==> $target for ${SECONDS_EACH}s (log: fuzz/target/$target.log)"
    rm -f "fuzz/target/$target.result"
    run_target "$target" &
    running=$((running + 1))
done
wait || true

failed=0
summary=()
for target in "${TARGETS[@]}"; do
    log="fuzz/target/$target.log"
    status=1
    elapsed="?"
    if [ -f "fuzz/target/$target.result" ]; then
        read -r status elapsed <"fuzz/target/$target.result"
    fi
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" 2>/dev/null | tail -n 1)
    found=$(sed -n 's/^stat::new_units_added: *//p' "$log" 2>/dev/null | tail -n 1)
    if [ "$status" -eq 0 ]; then
        crashes=0
    else
        crashes=1
        failed=1
        echo "==> $target FAILED (exit $status); last lines of the log:"
        tail -n 30 "$log" 2>/dev/null | sed 's/^/    | /'
        grep -h 'Test unit written to' "$log" 2>/dev/null | sed 's/^/    /' || true
    fi
    line=$(printf '%-18s %12s execs  %5s new  %s crash  %4ss' \
        "$target" "${execs:-?}" "${found:-?}" "$crashes" "$elapsed")
    summary+=("$line")
done

echo
echo "==> summary (${SECONDS_EACH}s per target, $JOBS at a time)"
printf '%s\n' "${summary[@]}"
exit "$failed"
