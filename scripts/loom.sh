#!/usr/bin/env bash
# Model-checks the gate's state machine (src/gate/core.rs, `Core`) with loom: every
# interleaving of a request at epoch e, a raise to e', a drain abort and a late
# request. Builds into its own target dir so the normal build cache is untouched.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export RUSTFLAGS="--cfg fencegate_loom ${RUSTFLAGS:-}"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/loom}
export LOOM_MAX_PREEMPTIONS=${LOOM_MAX_PREEMPTIONS:-3}
cargo test --locked --lib gate::loom_tests -- --nocapture "$@"
