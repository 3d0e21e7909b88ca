#!/usr/bin/env bash
# The admin API's OpenAPI description (docs/openapi.json, served at
# GET /v1/openapi.json): validated as OpenAPI 3.1 by openapi-spec-validator,
# then schemathesis (`st run`) fuzzes a live fencegate against it, once with its
# state on sled and once on PostgreSQL (scripts/openapi-live.py starts the
# fencegate, its store, origins and database, and fills every listing: done and
# in-doubt dedup keys, pending, failed and delivered queued messages). Checks:
# no 5xx, every status documented, every body and content type as documented.
# Both tools are pinned in scripts/requirements-openapi.txt and installed into
# the test venv. Exits non-zero on any failure.
#
#   bash scripts/openapi-test.sh [--examples N]   (default 100 per operation)
#
# The binary: $FENCEGATE_BIN, else `cargo build --bin fencegate` (debug).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
start=$SECONDS
EXAMPLES=100
while [ $# -gt 0 ]; do
    case $1 in
        --examples) EXAMPLES=$2; shift 2 ;;
        *) echo "openapi-test: unknown argument $1" >&2; exit 2 ;;
    esac
done

PY=$(bash scripts/venv-install.sh scripts/requirements-openapi.txt)
BIN_DIR=$(dirname "$PY")

echo "=== openapi-test: openapi-spec-validator docs/openapi.json"
"$BIN_DIR/openapi-spec-validator" docs/openapi.json

if [ "$(bash scripts/setup-postgres.sh)" != yes ]; then
    echo "openapi-test: PostgreSQL's server binaries are needed (scripts/setup-postgres.sh could not install them)" >&2
    exit 1
fi

if [ -z "${FENCEGATE_BIN:-}" ]; then
    cargo build --quiet --bin fencegate
    target=$(cargo metadata --format-version 1 --no-deps | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
    FENCEGATE_BIN=$target/debug/fencegate
fi

# The checks: a 5xx fails; so does a status, a content type or a body the
# description does not give for that operation. One worker and a fixed seed:
# the same cases every run, and wrong-token pacing (per client address) is
# never reached (schemathesis sends the right token throughout). /login is
# described but not fuzzed: its wrong tokens would count as guesses and pace
# the rest of the run.
ST_ARGS=(
    --checks not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance
    --max-examples "$EXAMPLES"
    --seed 45
    --workers 1
    --max-redirects 0
    --exclude-path /login
    --request-timeout 10
    --suppress-health-check all
    --generation-database none
)
for backend in sled postgres; do
    echo "=== openapi-test: schemathesis against a live fencegate on $backend ($((SECONDS - start)) s)"
    "$PY" scripts/openapi-live.py --bin "$FENCEGATE_BIN" --backend "$backend" -- "${ST_ARGS[@]}"
done
echo "openapi-test: ok ($((SECONDS - start)) s)"
