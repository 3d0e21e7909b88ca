#!/usr/bin/env bash
# Make (or reuse) the Python venv for scripts/s3server.py and print its python path.
# Idempotent: a marker in the venv holds the hash of requirements-test.txt, so a
# re-run with unchanged requirements does no pip work. Progress goes to stderr;
# stdout is only the venv python's path. Venv: ${FENCEGATE_VENV:-<repo>/.venv}.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${FENCEGATE_VENV:-$REPO/.venv}
REQ=$REPO/scripts/requirements-test.txt
MARKER=$VENV/.fencegate-requirements.sha256
PY=$VENV/bin/python
want=$(sha256sum "$REQ" | cut -d' ' -f1)

if [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$want" ] && "$PY" -c pass 2>/dev/null; then
    echo "$PY"
    exit 0
fi

echo "setup-s3server: preparing $VENV" >&2
if ! "$PY" -c pass 2>/dev/null; then
    rm -rf "$VENV"
    # Debian's own python3 lacks ensurepip unless python3-venv is installed;
    # then make the venv without pip and install into it with the outer pip.
    python3 -m venv "$VENV" >&2 || { rm -rf "$VENV"; python3 -m venv --without-pip "$VENV" >&2; }
fi
if "$PY" -m pip --version >/dev/null 2>&1; then
    pip=("$PY" -m pip)
else
    pip=(python3 -m pip --python "$PY")
fi
"${pip[@]}" install --quiet --disable-pip-version-check --no-input -r "$REQ" >&2
echo "$want" > "$MARKER"
echo "$PY"
