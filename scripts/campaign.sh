#!/usr/bin/env bash
# The long fault campaign (tests/it/campaign): the same seeded test as
# the CI smoke (30 s of faults), run for longer.
#
#   scripts/campaign.sh [secs] [seed]      # defaults: 600 s, a random seed
#
# Prints the histories checked, operations by outcome, nemesis events by kind and
# every violation (the test fails on any). Re-run a failing seed to reproduce the
# same fault schedule (timing still varies: it is a real system). Set
# FENCEGATE_CAMPAIGN_WORKERS (default 6) for more contention and
# FENCEGATE_CAMPAIGN_KEEP=1 to keep the logs of a passing run (a failing run always
# keeps them and prints where: origin.jsonl, w*.jsonl, nemesis.log, epochs.jsonl,
# fencegate.stderr).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
secs=${1:-600}
seed=${2:-$(( (RANDOM << 15) | RANDOM ))}
echo "campaign.sh: $secs s of faults, seed $seed" >&2
FENCEGATE_TEST_PYTHON=$(bash scripts/setup-s3server.sh)
export FENCEGATE_TEST_PYTHON FENCEGATE_CAMPAIGN_SECS=$secs FENCEGATE_CAMPAIGN_SEED=$seed
cargo test --locked --test it campaign::fault_campaign -- --exact --nocapture
