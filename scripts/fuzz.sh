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

failed=0
summary=()
for target in "${TARGETS[@]}"; do
    work="fuzz/target/corpus/$target"
    mkdir -p "$work" "fuzz/artifacts/$target"
    log="fuzz/target/$target.log"
    echo "==> $target for ${SECONDS_EACH}s (log: $log)"
    start=$SECONDS
    status=0
    cargo fuzz run "${FUZZ_FLAGS[@]}" "$target" "$work" "fuzz/corpus/$target" -- \
        -max_total_time="$SECONDS_EACH" -timeout=10 -rss_limit_mb=2048 \
        -print_final_stats=1 >"$log" 2>&1 || status=$?
    elapsed=$((SECONDS - start))
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
    found=$(sed -n 's/^stat::new_units_added: *//p' "$log" | tail -n 1)
    if [ "$status" -eq 0 ]; then
        crashes=0
    else
        crashes=1
        failed=1
        echo "    FAILED (exit $status); last lines of the log:"
        tail -n 30 "$log" | sed 's/^/    | /'
        grep -h 'Test unit written to' "$log" | sed 's/^/    /' || true
    fi
    line=$(printf '%-18s %12s execs  %5s new  %s crash  %4ss' \
        "$target" "${execs:-?}" "${found:-?}" "$crashes" "$elapsed")
    echo "    $line"
    summary+=("$line")
done

echo
echo "==> summary (${SECONDS_EACH}s per target)"
printf '%s\n' "${summary[@]}"
exit "$failed"
