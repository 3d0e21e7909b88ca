#!/usr/bin/env bash
# Installs a pinned requirements file into the repository's venv (the S3 test
# server's, made by setup-s3server.sh) once per version of the file, and prints
# the venv's python. Usage: PY=$(bash scripts/venv-install.sh scripts/requirements-X.txt)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REQ=$1
PY=$(bash scripts/setup-s3server.sh)
MARKER=$(dirname "$PY")/../.fencegate-$(basename "$REQ" .txt).sha256
want=$(sha256sum "$REQ" | cut -d' ' -f1)
if [ ! -f "$MARKER" ] || [ "$(cat "$MARKER")" != "$want" ]; then
    if "$PY" -m pip --version >/dev/null 2>&1; then
        pip=("$PY" -m pip)
    else
        pip=(python3 -m pip --python "$PY")
    fi
    "${pip[@]}" install --quiet --disable-pip-version-check --no-input -r "$REQ" >&2
    echo "$want" >"$MARKER"
fi
echo "$PY"
