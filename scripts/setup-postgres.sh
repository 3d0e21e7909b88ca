#!/usr/bin/env bash
# Make sure PostgreSQL's server binaries (initdb, postgres) are installed for the
# tests (tests/common/postgres.rs starts a private server from them). Installs
# Debian's `postgresql` package when they are missing and this user may (root,
# apt-get). Prints "yes" when the binaries are there, "no" otherwise; progress and
# reasons go to stderr. Idempotent and quick when already installed.
set -euo pipefail

have() {
    command -v initdb >/dev/null 2>&1 && return 0
    command -v pg_config >/dev/null 2>&1 && [ -x "$(pg_config --bindir)/initdb" ] && return 0
    compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null
}

if have; then
    echo yes
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "setup-postgres: PostgreSQL is not installed and this user cannot apt-get install it; the PostgreSQL tests will be skipped (install Debian's postgresql package to run them)" >&2
    echo no
    exit 0
fi
echo "setup-postgres: installing Debian's postgresql package" >&2
export DEBIAN_FRONTEND=noninteractive
# The package starts a cluster of its own by default; the tests never use it.
mkdir -p /etc/postgresql-common
[ -f /etc/postgresql-common/createcluster.conf ] || echo "create_main_cluster = false" > /etc/postgresql-common/createcluster.conf
# Keep our createcluster.conf without a question (it is one of the package's conffiles).
{ apt-get update -qq && apt-get install -y -qq --no-install-recommends \
    -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold postgresql; } >&2
if have; then echo yes; else echo no; fi
