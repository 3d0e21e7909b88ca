#!/usr/bin/env bash
# A short, bounded fuzzing run of fencegate's parsers of untrusted bytes
# (tests/fuzz: X-Lease-Epoch, Idempotency-Key, the dedup record codec) with
# cargo-fuzz / libFuzzer. Not part of scripts/test.sh.
#
# Usage: scripts/fuzz.sh [seconds-per-target]        (default 30)
#   FUZZ_TARGETS="codec_decode ..."  only these targets
#   FUZZ_SANITIZER=address           ASan (default none: the targets are safe Rust,
#                                    and #![forbid(unsafe_code)] holds in fencegate)
# A crash stops the run, leaves the input in tests/fuzz/artifacts/<target>/ and
# exits non-zero; reproduce it with
#   cargo fuzz run --fuzz-dir tests/fuzz -s none -a <target> <file>
# The first build compiles the whole dependency tree with coverage
# instrumentation (minutes); later builds only fencegate.
# Stable toolchains: cargo-fuzz passes -Z flags only for sanitizers, which
# RUSTC_BOOTSTRAP=1 lets stable rustc accept (set here only when needed, since
# cargo rebuilds everything when it changes).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
secs=${1:-30}
sanitizer=${FUZZ_SANITIZER:-none}
fuzz_dir=tests/fuzz
if [ "$sanitizer" != none ]; then
    export RUSTC_BOOTSTRAP=1
fi

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "installing cargo-fuzz (once)..." >&2
    cargo install cargo-fuzz --locked
fi

targets=${FUZZ_TARGETS:-$(cargo fuzz list --fuzz-dir "$fuzz_dir")}
flags=(--fuzz-dir "$fuzz_dir" -s "$sanitizer" -a)
start=$(date +%s)
cargo fuzz build "${flags[@]}"
echo "build: $(($(date +%s) - start)) s"

summary=()
for t in $targets; do
    log=$(mktemp)
    mkdir -p "$fuzz_dir/corpus/$t"
    if ! cargo fuzz run "${flags[@]}" "$t" -- -max_total_time="$secs" -print_final_stats=1 >"$log" 2>&1; then
        cat "$log" >&2
        echo "FAIL: $t crashed; input saved under $fuzz_dir/artifacts/$t/" >&2
        exit 1
    fi
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n1)
    cov=$(grep -o 'cov: [0-9]*' "$log" | tail -n1 | cut -d' ' -f2)
    summary+=("$(printf '%-20s %12s executions in %ss, no crash (coverage %s)' "$t" "${runs:-?}" "$secs" "${cov:-?}")")
    rm -f "$log"
done
printf '%s\n' "${summary[@]}"
echo "total: $(($(date +%s) - start)) s"
