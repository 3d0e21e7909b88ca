#!/usr/bin/env bash
# The one test command: sets up the S3 test server's venv and PostgreSQL, builds,
# then runs every stage (each whatever the one before did) and ends with a
# summary of each stage's result and time; any failure fails it.
# Extra arguments go to `cargo test`, e.g. `scripts/test.sh fencing -- --nocapture`.
# The test harness starts `$FENCEGATE_TEST_PYTHON scripts/s3server.py --port 0` per test.
set -euo pipefail
start=$SECONDS
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# Every temporary directory of the run (tests, servers, scripts: ~1 GB each for
# some) goes under one of its own, removed when the run ends: a test process
# killed mid-run (a timeout, a cancelled CI job) cannot remove its own, and they
# filled a shared machine's disk once. A directory left by a run that was itself
# killed is removed by the next run.
tmp_root=${TMPDIR:-/tmp}
for old in "$tmp_root"/fencegate-test.*; do
    [ -d "$old" ] || continue
    kill -0 "${old##*.}" 2>/dev/null || rm -rf "$old"
done
run_tmp="$tmp_root/fencegate-test.$$"
mkdir -p "$run_tmp"
# Sticky and open to all, as /tmp is: the test PostgreSQL runs as `postgres`.
chmod 1777 "$run_tmp"
export TMPDIR=$run_tmp
trap 'rm -rf "$run_tmp"; echo "test.sh: wall time $((SECONDS - start))s" >&2' EXIT

FENCEGATE_TEST_PYTHON=$(bash scripts/setup-s3server.sh)
export FENCEGATE_TEST_PYTHON
# PostgreSQL for the shared-state tests: installed when missing (root + apt-get);
# once it is there, its tests must run, not skip.
if [ "$(bash scripts/setup-postgres.sh)" = yes ]; then
    export FENCEGATE_TEST_REQUIRE_POSTGRES=1
fi
# The receivers' verifiers (npm) for the signed-delivery tests.
bash scripts/setup-egress-tests.sh
# Same as `-- --test-threads 4`, but leaves "$@" free to carry its own `--`.
export RUST_TEST_THREADS=${RUST_TEST_THREADS:-4}

cargo build --locked --all-targets
if [ $# -gt 0 ]; then
    cargo test --locked --all-targets "$@"
    exit
fi
# Every stage runs, whatever the one before it did; a summary of what ran,
# passed and failed (with times) ends the run, and any failure fails it.
results=()
failed=0
stage() {
    local name=$1 t0=$SECONDS
    shift
    echo "=== test.sh: $name" >&2
    if "$@"; then
        results+=("ok    $(printf '%4d' $((SECONDS - t0))) s  $name")
    else
        results+=("FAIL  $(printf '%4d' $((SECONDS - t0))) s  $name")
        failed=1
    fi
}
# The benches run too: the load bench's smoke mode (a few seconds, no timing
# assertions) and the criterion benches once each, so the benches cannot rot.
# The fault campaigns (one instance, then a cluster) run on their own afterwards: each measures a live system for
# 30 s, and sharing two cores with the database-killing tests starves it.
stage "unit and integration tests" \
    cargo test --locked --lib --bins --tests -- --skip campaign::fault_campaign --skip cluster_fault_campaign
stage "benches (smoke)" cargo test --locked --benches
stage "fault campaign, one instance" cargo test --locked --test it campaign::fault_campaign -- --exact
stage "fault campaign, a cluster" \
    cargo test --locked --test it campaign::cluster::cluster_fault_campaign -- --exact
# The worker client packages (clients/python, clients/typescript) against the
# binary just built: the S3 test server, fencegate and a recording origin.
stage "worker clients (scripts/clients-test.sh)" bash scripts/clients-test.sh
# The Kubernetes manifests against Kubernetes' schemas, offline (their agreement
# with the binary is tests/it/kubernetes.rs, above).
stage "Kubernetes manifests (scripts/k8s-validate.sh)" bash scripts/k8s-validate.sh
# The admin API's OpenAPI description: validated, then schemathesis against a
# live fencegate on sled and on PostgreSQL (scripts/openapi-live.py).
stage "the admin API's description, fuzzed (scripts/openapi-test.sh)" bash scripts/openapi-test.sh
# The alerting rules: promtool's check and unit tests (the metrics they and the
# dashboard query are tests/it/monitoring.rs, above).
stage "alerting rules (scripts/alerts-test.sh)" bash scripts/alerts-test.sh
echo "test.sh: summary" >&2
printf '  %s\n' "${results[@]}" >&2
if [ "$failed" != 0 ]; then
    echo "test.sh: FAILED (a stage above)" >&2
    exit 1
fi
