#!/usr/bin/env bash
# The PostgreSQL failover runs (issue 27, section 2; tests/it/failover.rs): a
# primary and a standby from pg_basebackup, fencegate given both hosts, 16 workers
# of keyed load, the primary killed with -9 mid-load and the standby promoted.
#   - synchronous standby: asserts nothing lost, nothing delivered twice, the
#     outage answered 503 with Retry-After;
#   - asynchronous standby (once in step, once after falling behind): prints the
#     done records lost and the keys delivered twice, asserts neither.
# ~20 s after the build. scripts/test.sh runs them too (with the other tests,
# figures not shown); this runs them alone, one at a time, figures printed.
#
#   bash scripts/failover.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
FENCEGATE_TEST_PYTHON=$(bash scripts/setup-s3server.sh)
export FENCEGATE_TEST_PYTHON
if [ "$(bash scripts/setup-postgres.sh)" = yes ]; then
    export FENCEGATE_TEST_REQUIRE_POSTGRES=1
fi
# One run at a time: the timings printed are the outage's, not the neighbour's.
cargo test --locked --test it failover:: -- --nocapture --test-threads 1 "$@"
