#!/usr/bin/env bash
# Installs the receivers' own verifiers for the signed-delivery tests
# (tests/it/webhooks.rs): `npm ci` in tests/egress (the `standardwebhooks` npm
# package, pinned by its package-lock.json). The Python one (`standardwebhooks`
# from PyPI) is in scripts/requirements-test.txt. Idempotent: a marker holds the
# lock file's hash, so a re-run with an unchanged lock does no npm work.
set -euo pipefail
DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/../tests/egress" && pwd)
MARKER=$DIR/node_modules/.fencegate-lock.sha256
want=$(sha256sum "$DIR/package-lock.json" | cut -d' ' -f1)
if [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$want" ]; then
    exit 0
fi
command -v npm >/dev/null || {
    echo "setup-egress-tests: npm is needed (Node 18 or later)" >&2
    exit 2
}
echo "setup-egress-tests: npm ci in $DIR" >&2
(cd "$DIR" && npm ci --no-audit --no-fund --loglevel=error >&2)
echo "$want" > "$MARKER"
