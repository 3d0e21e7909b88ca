#!/usr/bin/env bash
# The long fault campaigns (tests/it/campaign): the same seeded tests as the CI
# smoke (30 s of faults), run for longer.
#
#   scripts/campaign.sh [secs] [seed]                # one instance (default 600 s, a random seed)
#   scripts/campaign.sh cluster [secs] [seed]        # three cluster instances (SPEC §10.2)
#   scripts/campaign.sh cluster-weak [secs] [seed]   # the same against a build without
#                                                    # self-fencing at the deadline: must FAIL
#
# cluster-weak fails every run with an `[R1 epoch order]` violation on lease l4:
# the campaign's directed step sends a late worker's poll to an owner cut off from
# the store after its successor forwarded a newer epoch, and the weakened owner
# forwards it (cut from the store and the database; tests/it/campaign/cluster.rs, module doc); it also reports
# `[R2 drain]` on the busy shard's upload leases (never aborted). CI runs
# `cluster-weak 15 7` and requires the R1 violation (.ci/run).
#
# Besides the random faults, each campaign plays directed steps for issue 25:
# the cluster's busy shard (held uploads on four leases of the cut-off owner's
# shard), a single instance and an instance of another shard count started
# against the cluster's prefix while shard 0 is free (each followed by a
# split-brain probe), a forged gate object whose `advertise` is a recording
# listener (anything relayed there is a `[forged gate relay]` violation); the
# single instance's clone step (a copy of its data_dir started beside it,
# running and SIGSTOPped). Refused starts (exit 2) are the expected outcome and
# are logged. FENCEGATE_TEST_BIN=<path> runs another fencegate binary (an older
# build) under the same campaign.
#
# Both campaigns also have a queued route (SPEC §11, tests/it/campaign/queue.rs)
# with its own two workers, judged by Q1-Q4 after the queue drained
# (tests/it/campaign/checker/queued.rs): the single instance's r4 on lease l4
# (the queue's failpoints armed by its kills, the clone step's fork of the
# queue), the cluster's r36 on lease l36 (in the directed step's shard: a
# takeover of the queue in every run; one database, no fork).
#
# Prints the histories checked, operations by outcome, nemesis events by kind and
# every violation (the test fails on any). Re-run a failing seed to reproduce the
# same fault schedule (timing still varies: it is a real system). Set
# FENCEGATE_CAMPAIGN_WORKERS (default 6) for more contention and
# FENCEGATE_CAMPAIGN_KEEP=1 to keep the logs of a passing run (a failing run always
# keeps them and prints where: origin.jsonl, w*.jsonl, nemesis.log, epochs.jsonl,
# the fencegate stderr files).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mode=single
case "${1:-}" in
    cluster|cluster-weak) mode=$1; shift ;;
esac
secs=${1:-600}
seed=${2:-$(( (RANDOM << 15) | RANDOM ))}
echo "campaign.sh: $mode, $secs s of faults, seed $seed" >&2
FENCEGATE_TEST_PYTHON=$(bash scripts/setup-s3server.sh)
export FENCEGATE_TEST_PYTHON FENCEGATE_CAMPAIGN_SECS=$secs FENCEGATE_CAMPAIGN_SEED=$seed
if [ "$mode" != single ] && [ "$(bash scripts/setup-postgres.sh)" = yes ]; then
    export FENCEGATE_TEST_REQUIRE_POSTGRES=1  # a cluster needs PostgreSQL: never skip
fi
case $mode in
    single)
        cargo test --locked --test it campaign::fault_campaign -- --exact --nocapture ;;
    cluster)
        cargo test --locked --test it campaign::cluster::cluster_fault_campaign -- --exact --nocapture ;;
    cluster-weak)
        # The weakened binary (src/cluster/mod.rs, `weakened`): built with the
        # failpoints feature and copied aside, since the test build replaces it.
        cargo build --locked --features failpoints --bin fencegate
        weak_dir=$(mktemp -d)
        trap 'rm -rf "$weak_dir"' EXIT  # ~65 MB a run
        weak=$weak_dir/fencegate-weak
        cp target/debug/fencegate "$weak"
        echo "campaign.sh: a weakened build (no self-fencing at the deadline)" >&2
        FENCEGATE_TEST_BIN=$weak FENCEGATE_WEAKEN=no_self_fence \
            cargo test --locked --test it campaign::cluster::cluster_fault_campaign -- --exact --nocapture ;;
esac
