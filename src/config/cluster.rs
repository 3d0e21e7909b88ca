//! `[cluster]` (SPEC §9, §10): the members of a set-up and their shards.

use super::*;

/// `[cluster]`: this instance's place among several (SPEC §10.2).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterConfig {
    /// Unique among the instances, stable across restarts: the holder of its gate
    /// leases. `${NAME}` is read from the environment at load (one file for every
    /// member, e.g. a Kubernetes pod's name).
    pub instance_id: String,
    /// URL of this instance's proxy listener, as peers reach it; `${NAME}` is read
    /// from the environment at load (e.g. built from a pod's IP).
    pub advertise: String,
    /// The same on every instance; changing it needs every instance stopped.
    #[serde(default = "default_shards")]
    pub shards: u32,
    /// Shared secret between instances; `${NAME}` is read from the environment.
    /// Never logged, never forwarded upstream.
    pub peer_token: String,
}

/// The most shards `[cluster] shards` allows (four digits in a gate lease's name).
pub const MAX_SHARDS: u32 = 9999;

fn default_shards() -> u32 {
    16
}

impl ClusterConfig {
    /// The peer token with `${NAME}` read from the environment.
    pub fn resolved_peer_token(&self) -> Result<String, String> {
        from_env("[cluster] peer_token", &self.peer_token)
    }
}

impl Config {
    pub(super) fn validate_cluster(&self) -> Result<(), String> {
        let Some(c) = &self.cluster else {
            return Ok(());
        };
        if self.state.kind != StateKind::Postgres {
            return Err("[cluster] needs [state] kind = \"postgres\": every instance must see the same marks and dedup records".into());
        }
        if c.instance_id.is_empty()
            || c.instance_id.len() > 64
            || !c
                .instance_id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        {
            return Err(format!(
                "[cluster] instance_id {:?} must be 1-64 characters of [A-Za-z0-9._-]",
                c.instance_id
            ));
        }
        let uri: Uri = c
            .advertise
            .parse()
            .map_err(|_| format!("[cluster] advertise {:?} is not a URL", c.advertise))?;
        if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.authority().is_none() {
            return Err(format!(
                "[cluster] advertise {:?} must be an http:// or https:// URL of this instance's proxy listener",
                c.advertise
            ));
        }
        if !(1..=MAX_SHARDS).contains(&c.shards) {
            return Err(format!(
                "[cluster] shards ({}) must be between 1 and 9999",
                c.shards
            ));
        }
        if c.resolved_peer_token()?.len() < 16 {
            return Err("[cluster] peer_token must be at least 16 characters".into());
        }
        Ok(())
    }
}
