//! `[dedup]` (SPEC §9): how long a finished key is kept.

use super::*;

/// `[dedup]`: how long finished dedup records are kept (SPEC §6).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DedupConfig {
    /// Retention of dedup records, human-readable ("24h", "90m").
    #[serde(deserialize_with = "duration::human")]
    pub ttl: Duration,
    /// How often expired records are swept.
    #[serde(deserialize_with = "duration::human")]
    pub sweep_interval: Duration,
}

impl Default for DedupConfig {
    fn default() -> Self {
        DedupConfig {
            ttl: Duration::from_secs(24 * 3600),
            sweep_interval: Duration::from_secs(60),
        }
    }
}
