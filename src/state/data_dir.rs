//! One `data_dir`, one set-up (SPEC §10): sled's twin of
//! [`super::postgres::set_up_record`]. A `data_dir` records, in sled, the
//! set-up it belongs to — the lease store's `{prefix}.set-up` id, with the
//! store and prefix for messages. A copy started under another prefix or
//! store (staging on last night's copy of production's volume) finds another
//! id, or none, and refuses to start: its marks, dedup records and queue are
//! another set-up's, and its queue would deliver that set-up's messages.

use std::sync::Arc;

use super::sled::SledState;
use super::StateError;
use crate::config::Config;
use crate::lease::LeaseStore;
use crate::set_up::{create_store_id, named_by_gate_objects, store_id, store_name};

/// What a `data_dir` records of its set-up.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Recorded {
    v: u32,
    /// The lease store's `{prefix}.set-up` id.
    set_up: String,
    /// `s3://{bucket}` or `dir:{path}` (for messages).
    store: String,
    prefix: String,
}

/// A `data_dir` found to be this set-up's, or free for it: what
/// [`hold`] records once the instance holds its guard.
#[derive(Debug)]
pub struct MayHold {
    recorded: bool,
    in_store: Option<String>,
}

fn refusal(cfg: &Config, why: String) -> StateError {
    StateError::OtherSetUp(format!(
        "this data_dir ({}) belongs to another fencegate set-up: {why}. Its marks, dedup records and queued messages are that set-up's: started here, its queue would deliver them again. Give this instance a data_dir of its own (an empty one)",
        cfg.server.data_dir.display()
    ))
}

/// Start-up, before the guard: whether `sled` (in `cfg.server.data_dir`) may
/// be this set-up's state. `instance_id`: the id kept in the `data_dir`.
pub async fn check(
    sled: &SledState,
    store: &Arc<dyn LeaseStore>,
    cfg: &Config,
    instance_id: &str,
) -> Result<MayHold, StateError> {
    let prefix = &cfg.store.prefix;
    let in_store = store_id(store, prefix).await?;
    match sled.set_up_record()? {
        Some(raw) => {
            let rec: Recorded = serde_json::from_slice(&raw).map_err(|e| StateError::Damaged {
                path: cfg.server.data_dir.clone(),
                detail: format!("the set-up record does not parse: {e}"),
            })?;
            if in_store.as_deref() != Some(rec.set_up.as_str()) {
                return Err(refusal(
                    cfg,
                    format!(
                        "it was recorded under set-up {} (lease store {}, prefix {:?}), and this instance's lease store ({}, prefix {prefix:?}) keeps {}",
                        rec.set_up,
                        rec.store,
                        rec.prefix,
                        store_name(cfg),
                        in_store.map_or("no set-up id".into(), |i| format!("set-up {i}")),
                    ),
                ));
            }
            Ok(MayHold {
                recorded: true,
                in_store,
            })
        }
        None => {
            // From before data_dirs recorded their set-up, or fresh: records
            // are this set-up's only if its own gate objects name this state.
            let state = format!("sled:{instance_id}");
            if sled.holds_records()? && !named_by_gate_objects(store, prefix, &state).await? {
                if cfg.claim_state {
                    tracing::warn!(%state, "--claim-state: this data_dir's records, which no set-up record or gate object attributes to this set-up, are claimed for it");
                } else {
                    return Err(refusal(
                        cfg,
                        format!(
                            "it holds marks, dedup records or queued messages but no set-up record, and no recent gate object of this lease store ({}, prefix {prefix:?}) names it ({state}): a copy of another set-up's data_dir. If these records are this set-up's, start once with `fencegate serve --claim-state`",
                            store_name(cfg)
                        ),
                    ));
                }
            }
            Ok(MayHold {
                recorded: false,
                in_store,
            })
        }
    }
}

/// Once the guard is held: records the set-up (creating the store's id when
/// absent), durably, if the `data_dir` had none.
pub async fn hold(
    may: MayHold,
    sled: &SledState,
    store: &Arc<dyn LeaseStore>,
    cfg: &Config,
    instance_id: &str,
) -> Result<(), StateError> {
    if may.recorded {
        return Ok(());
    }
    let id = match may.in_store {
        Some(id) => id,
        None => create_store_id(store, &cfg.store.prefix, instance_id).await?,
    };
    let rec = Recorded {
        v: 1,
        set_up: id,
        store: store_name(cfg),
        prefix: cfg.store.prefix.clone(),
    };
    let json = serde_json::to_vec(&rec).map_err(|e| StateError::Write(e.to_string()))?;
    sled.record_set_up(&json).await
}
