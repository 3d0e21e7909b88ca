#!/usr/bin/env bash
# Checks the alerting rules (deploy/prometheus): `promtool check rules` and their
# unit tests, `promtool test rules`. Installs Debian's `prometheus` package (which
# ships promtool) when promtool is missing and this user may (root, apt-get);
# otherwise fails saying so. Called by scripts/test.sh. That every metric the
# rules and the dashboard query is one a live fencegate exports is
# tests/it/monitoring.rs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if ! command -v promtool >/dev/null 2>&1; then
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        echo "alerts-test: promtool is not installed and this user cannot apt-get install it (install Debian's prometheus package)" >&2
        exit 1
    fi
    echo "alerts-test: installing Debian's prometheus package (for promtool)" >&2
    export DEBIAN_FRONTEND=noninteractive
    # Installed for promtool only: its service is not started here.
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus; } >&2
    if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet prometheus 2>/dev/null; then
        systemctl stop prometheus >&2 || true
    fi
fi
cd deploy/prometheus
promtool check rules fencegate-alerts.yml
promtool test rules fencegate-alerts.test.yml
