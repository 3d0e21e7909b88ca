//! `[state]` (SPEC §9): where marks and dedup records live (sled or PostgreSQL).

use super::*;

/// `[state] kind`: which backend holds marks and dedup records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum StateKind {
    /// sled under `data_dir` (one instance).
    #[default]
    Sled,
    /// A PostgreSQL database (SPEC §10).
    Postgres,
}

/// `[state]`: where marks and dedup records live.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StateConfig {
    /// Which backend.
    pub kind: StateKind,
    /// PostgreSQL connection string (`postgres://…` or `key=value …`); `${NAME}`
    /// is read from the environment. Never logged or shown.
    pub url: Option<String>,
    /// Most connections kept open to PostgreSQL.
    pub pool_size: usize,
    /// Extra CA bundle (PEM) trusted for the database's TLS certificate.
    pub ca_file: Option<PathBuf>,
    /// Bound on connecting (shared among the url's hosts) and on every statement.
    #[serde(alias = "timeout", deserialize_with = "duration::ms")]
    pub timeout_ms: u64,
    /// The PostgreSQL schema holding fencegate's tables (SPEC §9): one per
    /// set-up sharing a database. Unset: the connection's own `search_path`
    /// (normally `public`), as before the key existed — setting `public`
    /// explicitly could move an existing set-up off tables its role's
    /// `search_path` found elsewhere.
    pub schema: Option<String>,
    /// sled's page cache in MiB: how much of the marks, dedup records and
    /// queued messages stays resident (sled only).
    pub cache_mb: u64,
    /// Queued messages whose request is kept (not yet delivered nor dropped),
    /// over every route; past it a new one is refused (503 `queue_full`, SPEC
    /// §11). sled only: sled keeps what it writes in memory.
    pub queue_max_messages: u64,
    /// And their bytes as stored.
    pub queue_max_bytes: u64,
}

impl Default for StateConfig {
    fn default() -> Self {
        StateConfig {
            kind: StateKind::Sled,
            url: None,
            pool_size: 16,
            ca_file: None,
            timeout_ms: 2000,
            schema: None,
            cache_mb: 64,
            queue_max_messages: 100_000,
            queue_max_bytes: 256 << 20,
        }
    }
}

impl StateConfig {
    /// The connection string with `${NAME}` read from the environment.
    pub fn resolved_url(&self) -> Result<String, String> {
        let raw = self
            .url
            .as_deref()
            .ok_or("[state] kind = \"postgres\" needs url")?;
        from_env("[state] url", raw)
    }

    /// `timeout_ms` as a [`Duration`].
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms)
    }
}

impl Config {
    pub(super) fn validate_state(&self) -> Result<(), String> {
        let s = &self.state;
        if s.cache_mb == 0 {
            return Err("[state] cache_mb must be at least 1".into());
        }
        if s.kind == StateKind::Postgres {
            s.resolved_url()?;
            if s.pool_size == 0 {
                return Err("[state] pool_size must be at least 1".into());
            }
            if s.timeout_ms == 0 {
                return Err("[state] timeout_ms must be at least 1".into());
            }
            if let Some(ca) = &s.ca_file {
                if !ca.is_file() {
                    return Err(format!(
                        "[state] ca_file {} is not a readable file",
                        ca.display()
                    ));
                }
            }
            if let Some(schema) = &s.schema {
                check_schema_name(schema)?;
            }
        } else if s.url.is_some() {
            return Err(
                "[state] url is set but kind is \"sled\": set kind = \"postgres\" or remove url"
                    .into(),
            );
        } else if s.schema.is_some() {
            return Err(
                "[state] schema is set but kind is \"sled\": a schema names where fencegate's tables live in PostgreSQL"
                    .into(),
            );
        }
        Ok(())
    }
}

/// `[state] schema`: an unquoted PostgreSQL identifier (lowercase letters,
/// digits, `_`; at most 63 bytes; not `pg_…`, which PostgreSQL reserves), so
/// that it goes into `search_path` and `CREATE SCHEMA` without quoting.
fn check_schema_name(name: &str) -> Result<(), String> {
    let first_ok = name
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_');
    let rest_ok = name
        .chars()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if !first_ok || !rest_ok || name.len() > 63 {
        return Err(format!(
            "[state] schema {name:?} must be 1 to 63 lowercase letters, digits or '_', not starting with a digit"
        ));
    }
    if name.starts_with("pg_") {
        return Err(format!(
            "[state] schema {name:?}: names starting with pg_ are reserved by PostgreSQL"
        ));
    }
    Ok(())
}
