#!/usr/bin/env bash
# The worker client packages (clients/python, clients/typescript) tested against
# the real parts: the S3 test server, fencegate and a recording origin, which
# clients/testkit/testkit.py starts for each suite. Sets up first: the repo's venv
# (scripts/setup-s3server.sh) with the Python client pip-installed into it, and
# `npm ci` in clients/typescript. Run by scripts/test.sh after the cargo tests.
#
# fencegate: $FENCEGATE_BIN, default target/debug/fencegate (cargo build makes it;
# under $CARGO_TARGET_DIR when that is set).
set -euo pipefail
start=$SECONDS
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"; echo "clients-test.sh: wall time $((SECONDS - start))s" >&2' EXIT
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$(pwd)
step() { echo "=== clients-test.sh: $* ($((SECONDS - start)) s)" >&2; }

export FENCEGATE_BIN=${FENCEGATE_BIN:-${CARGO_TARGET_DIR:-$REPO/target}/debug/fencegate}
if [ ! -x "$FENCEGATE_BIN" ]; then
    echo "clients-test.sh: no fencegate binary at $FENCEGATE_BIN: run 'cargo build', or set FENCEGATE_BIN" >&2
    exit 2
fi
command -v node >/dev/null && command -v npm >/dev/null || {
    echo "clients-test.sh: node and npm are needed (Node 18 or later)" >&2
    exit 2
}

step "Python: the venv, and pip install ./clients/python"
PY=$(bash scripts/setup-s3server.sh)
export FENCEGATE_TEST_PYTHON=$PY
"$PY" -m pip install --quiet --disable-pip-version-check --no-input --force-reinstall --no-deps ./clients/python
"$PY" -m pip check --disable-pip-version-check >/dev/null # its dependency (boto3 >= 1.35) is there

step "Python: tests (against the installed package)"
(cd clients/python/tests && "$PY" -m unittest -v 2>&1)

step "TypeScript: npm ci"
(cd clients/typescript && npm ci --no-audit --no-fund --loglevel=error)
# dist/ is committed (what `npm install ./clients/typescript` gets): it must be
# exactly what src/ compiles to.
(cd clients/typescript && npx tsc -p tsconfig.json --outDir "$scratch/dist")
if ! diff -r "$scratch/dist" clients/typescript/dist >&2; then
    echo "clients-test.sh: clients/typescript/dist is not what src/ compiles to: run 'npm run build' there and commit dist/" >&2
    exit 1
fi

step "TypeScript: installs into another project (npm install --install-links), CommonJS and ESM"
mkdir "$scratch/app"
(
    cd "$scratch/app"
    echo '{"name":"app","version":"1.0.0","private":true}' > package.json
    npm install --no-audit --no-fund --loglevel=error --install-links "$REPO/clients/typescript"
    node -e 'const c = require("fencegate-client"); if (typeof c.LeaseClient !== "function") process.exit(1)'
    echo 'import { GatewayClient } from "fencegate-client"; if (typeof GatewayClient !== "function") process.exit(1);' > esm.mjs
    node esm.mjs
)

step "TypeScript: tests (against dist/, through the package's own name)"
(cd clients/typescript && npx tsc -p tsconfig.test.json && node --test .test-build/test/all.test.js)
step "done"
