#!/usr/bin/env bash
# Model-checks the protocol (SPEC §4–§6, §10, §11) with stateright: tests/model, its
# own crate and lockfile, built into target/model so the product's build cache is
# untouched. Every check is an exhaustive breadth-first search of its bounds
# (tests/model/tests/checks.rs prints states and seconds per check).
#
#   bash scripts/model.sh     # the CI bounds: 26 M states, ~1–1.5 min of search
#                             # on 2 cores after a ~1 min build; the queue's
#                             # model (tests/queue.rs, SPEC §11): 1.2 M, ~3 s
#   FENCEGATE_MODEL_LONG=1 bash scripts/model.sh
#       # longer: three instances, a store cut and 18 ticks for the crash check
#       # (47 M states, ~5 min); a crash added to the stall checks (17 M and
#       # 13 M) and to the two-lease check (7 M); a handover added to the
#       # late-or-lost row writes check (10 M); the queue with three owners
#       # and four messages (49 M, ~4 min) (~14 min in all)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../tests/model"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/../../target/model}
cargo test --locked --test checks --test queue -- --nocapture --test-threads 1 "$@"
