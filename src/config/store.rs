//! `[store]` (SPEC §9): where epoch objects live (S3 or a directory).

use super::*;

/// `[store] kind`: which lease store backend holds the epoch objects (SPEC §2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum StoreKind {
    /// S3 or an S3-compatible server.
    S3,
    /// A local directory (one machine; tests and demos).
    #[default]
    Dir,
}

/// `[store]`: the lease store and how often and how patiently it is read (SPEC §2, §4).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreConfig {
    /// Which backend.
    pub kind: StoreKind,
    /// S3 bucket (required for `s3`).
    pub bucket: Option<String>,
    /// Key prefix for epoch objects: empty or ending in `/`.
    pub prefix: String,
    /// S3-compatible endpoint URL; absent: AWS.
    pub endpoint: Option<String>,
    /// S3 region used for signing.
    pub region: String,
    /// Path-style addressing, which many S3-compatible servers need.
    pub force_path_style: bool,
    /// Directory of the `dir` backend.
    pub path: PathBuf,
    /// How often each lease's epochs are listed, to learn of newer epochs (SPEC §4 rule
    /// 3).
    #[serde(alias = "refresh_interval", deserialize_with = "duration::ms")]
    pub refresh_interval_ms: u64,
    /// How long a contender waits past an epoch's expiry before taking the lease (SPEC
    /// §2).
    #[serde(alias = "grace", deserialize_with = "duration::ms")]
    pub grace_ms: u64,
    /// Bound on each store request; beyond it the store counts as unreachable.
    #[serde(alias = "timeout", deserialize_with = "duration::ms")]
    pub timeout_ms: u64,
    /// TTL of the instance guard's (and a cluster's) gate leases (SPEC §10).
    #[serde(deserialize_with = "duration::human")]
    pub gate_ttl: Duration,
    /// An instance stops forwarding this long before its gate lease ends.
    #[serde(deserialize_with = "duration::human")]
    pub self_fence_margin: Duration,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            kind: StoreKind::Dir,
            bucket: None,
            prefix: "fencegate/".into(),
            endpoint: None,
            region: "us-east-1".into(),
            force_path_style: false,
            path: PathBuf::from("data/leases"),
            refresh_interval_ms: 1000,
            grace_ms: 2000,
            timeout_ms: 2000,
            gate_ttl: Duration::from_secs(10),
            self_fence_margin: Duration::from_secs(2),
        }
    }
}

impl Config {
    /// The `[store]` section alone (all the `lease` commands need).
    pub fn validate_store(&self) -> Result<(), String> {
        let s = &self.store;
        if s.kind == StoreKind::S3 && s.bucket.as_deref().is_none_or(str::is_empty) {
            return Err("[store] kind = \"s3\" needs a bucket".into());
        }
        if !s.prefix.is_empty() && !s.prefix.ends_with('/') {
            return Err(format!(
                "[store] prefix {:?} must be empty or end with '/'",
                s.prefix
            ));
        }
        if s.refresh_interval_ms == 0 || s.timeout_ms == 0 {
            return Err("[store] refresh_interval_ms and timeout_ms must be positive".into());
        }
        if s.self_fence_margin >= s.gate_ttl {
            return Err(format!(
                "[store] self_fence_margin ({}) must be shorter than gate_ttl ({})",
                humantime::format_duration(s.self_fence_margin),
                humantime::format_duration(s.gate_ttl)
            ));
        }
        if s.gate_ttl < Duration::from_millis(3 * s.timeout_ms) {
            return Err(format!(
                "[store] gate_ttl ({}) must be at least three store call timeouts ({} ms): it is renewed every third of it",
                humantime::format_duration(s.gate_ttl),
                3 * s.timeout_ms
            ));
        }
        if let Some(ep) = &s.endpoint {
            let uri: Uri = ep
                .parse()
                .map_err(|_| format!("[store] endpoint {ep:?} is not a URL"))?;
            if uri.scheme().is_none() || uri.authority().is_none() {
                return Err(format!("[store] endpoint {ep:?} needs a scheme and host"));
            }
        }
        Ok(())
    }
}
