#!/usr/bin/env bash
# The operator page in a real browser (issue 16): headless Chromium driven by
# Playwright against a real fencegate with in-doubt keys
# (tests/browser/operator-page.test.mjs). Installs what it needs: Debian's
# chromium (as root, with apt-get) when /usr/bin/chromium is missing, and the
# pinned npm packages of tests/browser (npm ci). Screenshots go to
# target/browser/; `--update-screenshot` also replaces docs/admin.md's
# tests/browser/operator-page.png.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [ ! -x /usr/bin/chromium ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null
fi
(cd tests/browser && npm ci --no-audit --no-fund --loglevel=error)
cargo build --locked --bin fencegate

export FENCEGATE_BIN="$PWD/target/debug/fencegate" ARTIFACTS="$PWD/target/browser"
if [ "${1:-}" = --update-screenshot ]; then
    export SCREENSHOT="$PWD/tests/browser/operator-page.png"
fi
cd tests/browser
# --test-force-exit: once the test is done, a stray handle (a browser a failed
# step left open) must not keep node, and CI, waiting; `timeout` bounds the rest.
timeout --kill-after=10 600 node --test --test-force-exit operator-page.test.mjs
