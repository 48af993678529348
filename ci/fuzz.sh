#!/usr/bin/env bash
# Bounded coverage-guided fuzzing of the codecs and the broker engine (rust/fuzz, cargo-fuzz +
# libFuzzer), on the stable toolchain. Every target runs for FUZZ_SECONDS from the checked-in
# corpus; new interesting inputs go to a temporary directory, never into the repository. Exits
# non-zero on a crash, a panic or a hang, printing the input that did it and how to replay it.
#
# Environment:
#   FUZZ_SECONDS   seconds per target (default 60)
#   FUZZ_TARGETS   space-separated targets (default: every target in rust/fuzz/Cargo.toml)
#   FUZZ_JOBS      targets run at once (default: the number of CPUs)
#   FUZZ_KEEP      directory to copy the grown corpora into (default: none, they are dropped)
#   FUZZ_TARGET_DIR  cargo's build directory (default: rust/fuzz/target)
#
# Stable Rust is enough: with `--sanitizer none` cargo-fuzz needs no -Z flag, it only adds
# LLVM's sancov instrumentation, and libfuzzer-sys builds libFuzzer with the C++ compiler.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
FUZZ_DIR=$ROOT/rust/fuzz
FUZZ_SECONDS=${FUZZ_SECONDS:-60}
FUZZ_JOBS=${FUZZ_JOBS:-$(nproc)}
# Kept after the run (git-ignored): a crash's input must outlive the temporary directory.
CRASH_DIR=$ROOT/build/fuzz-crashes

started=$SECONDS
log() { printf '[fuzz %3ds] %s\n' $((SECONDS - started)) "$*"; }

# --locked: the dependency versions cargo-fuzz was released with, not whatever is newest
# today; 0.13 is the series this script and docs/fuzzing.md were written for.
if ! cargo fuzz --version >/dev/null 2>&1; then
    log "installing cargo-fuzz"
    cargo install --locked --quiet --version '~0.13' cargo-fuzz
fi

cd "$FUZZ_DIR"
if [[ -n ${FUZZ_TARGETS:-} ]]; then
    read -r -a targets <<<"$FUZZ_TARGETS"
else
    mapfile -t targets < <(cargo fuzz list)
fi
((${#targets[@]})) || {
    echo "no fuzz targets found in $FUZZ_DIR" >&2
    exit 1
}

# -O: optimized with debug assertions and overflow checks, as cargo-fuzz does by default.
build_flags=(--sanitizer none -O)
target_dir=${FUZZ_TARGET_DIR:-$FUZZ_DIR/target}
log "building ${targets[*]}"
cargo fuzz build "${build_flags[@]}" --target-dir "$target_dir" >/dev/null
bin_dir=$target_dir/$(rustc -vV | sed -n 's/^host: //p')/release

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# One target: its own corpus copy and artifact directory; status and log in $work.
fuzz_one() {
    local target=$1
    local grown=$work/corpus/$target seeds=$FUZZ_DIR/corpus/$target
    mkdir -p "$grown" "$work/artifacts/$target"
    local corpora=("$grown")
    [[ -d $seeds ]] && corpora+=("$seeds")
    # -timeout: one input running longer than 10 s is a hang, reported like a crash.
    # -rss_limit_mb: an input that makes the engine hold gigabytes is a bug too.
    set +e
    "$bin_dir/$target" "${corpora[@]}" \
        -max_total_time="$FUZZ_SECONDS" -timeout=10 -rss_limit_mb=2048 \
        -artifact_prefix="$work/artifacts/$target/" -print_final_stats=1 \
        >"$work/$target.log" 2>&1
    echo $? >"$work/$target.status"
}

log "fuzzing for ${FUZZ_SECONDS}s each, $FUZZ_JOBS at a time"
running=0
for target in "${targets[@]}"; do
    if ((running >= FUZZ_JOBS)); then
        wait -n || true
        running=$((running - 1))
    fi
    fuzz_one "$target" &
    running=$((running + 1))
done
wait

failed=0
for target in "${targets[@]}"; do
    status=$(cat "$work/$target.status" 2>/dev/null || echo missing)
    logfile=$work/$target.log
    # libFuzzer's last status line, e.g. "#1220839 DONE cov: 2411 ft: 9190 corp: 843/70Kb ...".
    last=$(grep -E '^#[0-9]+' "$logfile" | tail -n 1 || true)
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$logfile")
    rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$logfile")
    printf '%-16s exit %s  %s execs (%s/s)  %s\n' "$target" "$status" "${execs:-?}" \
        "${rate:-?}" "$(grep -oE 'cov: [0-9]+ ft: [0-9]+ corp: [0-9]+' <<<"$last" || true)"
    if [[ $status != 0 ]]; then
        failed=1
        mkdir -p "$CRASH_DIR"
        echo "---- $target failed; the end of its log:" >&2
        tail -n 40 "$logfile" >&2
        for input in "$work/artifacts/$target"/*; do
            [[ -f $input ]] || continue
            cp "$input" "$CRASH_DIR/"
            kept=$CRASH_DIR/$(basename "$input")
            echo "crashing input: $kept" >&2
            echo "reproduce: (cd rust/fuzz && cargo fuzz run ${build_flags[*]} $target $kept)" >&2
        done
    fi
    if [[ -n ${FUZZ_KEEP:-} ]]; then
        mkdir -p "$FUZZ_KEEP/$target"
        cp -r "$work/corpus/$target/." "$FUZZ_KEEP/$target/"
    fi
done

log "done"
exit "$failed"
