//! Reloading the config file on SIGHUP (SPEC §8). What may change live is
//! [`crate::live::Live`] (routes with their upstream headers and clients, the admin
//! token, the TLS certificate, the access-log switch) plus the log filter; it is
//! rebuilt from the new file and swapped in whole. Connections stay open and
//! in-flight requests finish on the snapshot they started with. The fence of a
//! lease no route uses any more is drained (its in-flight requests finish, up to
//! its drain timeout) and then stopped.
//!
//! Everything else — listeners, `data_dir`, `[store]`, `[state]`, `[dedup]`,
//! `[cluster]` and any other section — is fixed for the life of the process. A
//! file that does not load, or that changes a fixed key, is refused: the running
//! config stays, and the log and `fencegate_config_last_reload_successful` say so.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;

use crate::config::Config;
use crate::epoch::LeaseName;
use crate::metrics::Metrics;
use crate::shared::Shared;

/// Sets the running process's log filter (`[server] log_level`).
pub type SetLogFilter = Arc<dyn Fn(&str) -> Result<(), String> + Send + Sync>;

/// The `[server]` keys a reload may change; every other key of every section but
/// `[[route]]` is fixed (a section added later is fixed until said otherwise).
const LIVE_SERVER_KEYS: &[&str] = &["admin_token", "access_log", "log_level", "tls"];

/// Why a reload was refused.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    /// The new file does not load or validate; the running configuration stays.
    #[error("{0}")]
    Invalid(String),
    /// A key that only a restart can change was changed.
    #[error("{key} cannot change while fencegate runs (restart to apply it)")]
    Fixed {
        /// The key, e.g. `server.listen`.
        key: String,
    },
    /// The new routes could not be built.
    #[error(transparent)]
    Build(#[from] super::StartError),
}

/// What a reload changed, for its log line.
#[derive(Debug, Default)]
pub struct Reloaded {
    /// Routes the new file adds.
    pub routes_added: Vec<String>,
    /// Routes the new file removes.
    pub routes_removed: Vec<String>,
    /// Leases no route uses any more: drained, then stopped.
    pub leases_stopped: Vec<LeaseName>,
}

/// Applies the config file again on request. One reload at a time.
pub struct Reloader {
    path: PathBuf,
    /// The file as last applied: what the fixed keys are compared against.
    applied: tokio::sync::Mutex<toml::Table>,
    shared: Arc<Shared>,
    metrics: Arc<Metrics>,
    set_log: Option<SetLogFilter>,
}

impl Reloader {
    /// `running` is the text the process started from (read again from `path`
    /// when that fails: the comparison is then against the file as found).
    pub(super) fn new(
        path: PathBuf,
        shared: Arc<Shared>,
        metrics: Arc<Metrics>,
        set_log: Option<SetLogFilter>,
    ) -> Reloader {
        let applied = std::fs::read_to_string(&path)
            .ok()
            .and_then(|t| toml::from_str(&t).ok())
            .unwrap_or_default();
        Reloader {
            path,
            applied: tokio::sync::Mutex::new(applied),
            shared,
            metrics,
            set_log,
        }
    }

    /// Reloads, logs what happened and counts it.
    pub async fn reload_and_log(&self) {
        match self.reload().await {
            Ok(r) => {
                self.metrics.reloaded(true);
                tracing::info!(
                    config = %self.path.display(),
                    routes_added = %r.routes_added.join(","),
                    routes_removed = %r.routes_removed.join(","),
                    leases_stopped = %r
                        .leases_stopped
                        .iter()
                        .map(LeaseName::as_str)
                        .collect::<Vec<_>>()
                        .join(","),
                    "config reloaded"
                );
            }
            Err(e) => {
                self.metrics.reloaded(false);
                tracing::error!(
                    config = %self.path.display(),
                    reason = %e,
                    "config reload refused; the running config is kept"
                );
            }
        }
    }

    /// Loads the file, checks that no fixed key changed, builds the new live
    /// config and swaps it in.
    pub async fn reload(&self) -> Result<Reloaded, ReloadError> {
        let mut applied = self.applied.lock().await;
        let cfg = Config::load(&self.path).map_err(|e| ReloadError::Invalid(e.to_string()))?;
        let text = std::fs::read_to_string(&self.path)
            .map_err(|e| ReloadError::Invalid(format!("cannot read config: {e}")))?;
        let table: toml::Table =
            toml::from_str(&text).map_err(|e| ReloadError::Invalid(e.message().to_owned()))?;
        if let Some(key) = fixed_key_changed(&applied, &table) {
            return Err(ReloadError::Fixed { key });
        }
        self.check_cluster_leases(&cfg)?;
        check_kinds(&self.shared.live.current(), &cfg)?;
        // Acceptances under way end first, and none starts until the new
        // routes are in place: what the check below reads of the queue is
        // what the new routes meet (SPEC §11, the rule of kinds).
        let _kinds = match &self.shared.queue {
            Some(q) => Some(match q.kinds.try_write() {
                Ok(g) => g,
                Err(_) => {
                    tracing::info!("the reload waits for queued acceptances under way to end");
                    q.kinds.write().await
                }
            }),
            None => None,
        };
        if let Some(q) = &self.shared.queue {
            if let Some(why) = crate::queue::conflict(q.store.as_ref(), &cfg.routes)
                .await
                .map_err(|e| ReloadError::Invalid(e.to_string()))?
            {
                return Err(ReloadError::Invalid(why));
            }
        }
        let running: HashSet<LeaseName> = self
            .shared
            .fences
            .all()
            .iter()
            .map(|f| f.lease().clone())
            .collect();
        let mut new = match super::build_live(
            &cfg,
            &self.shared.fences,
            &self.shared.mode,
            &self.metrics,
            &self.shared.upstreams,
        )
        .await
        {
            Ok(n) => n,
            Err(e) => {
                // Fences started for the refused file's new leases admitted
                // nothing: stop them, or they would be refreshed for nothing.
                for f in self.shared.fences.all() {
                    if !running.contains(f.lease()) {
                        self.shared
                            .fences
                            .stop(f.lease(), std::time::Duration::ZERO)
                            .await;
                    }
                }
                return Err(e.into());
            }
        };
        let names = |l: &crate::live::Live| -> HashSet<String> {
            l.routes.iter().map(|r| r.name.clone()).collect()
        };
        let leases: HashSet<LeaseName> = new.routes.iter().map(|r| r.lease.clone()).collect();
        let new_names = names(&new);
        new.routes.carry_over(&self.shared.live.current().routes);
        let old = self.shared.live.replace(new);
        if let Some(set) = &self.set_log {
            match log_override() {
                Some(var) => tracing::info!(
                    "[server] log_level not applied: {var} is set in the environment and wins"
                ),
                None => {
                    if let Err(e) = set(&cfg.server.log_level) {
                        tracing::warn!(error = %e, "could not apply [server] log_level");
                    }
                }
            }
        }
        *applied = table;
        let old_names = names(&old);
        let mut out = Reloaded {
            routes_added: new_names.difference(&old_names).cloned().collect(),
            routes_removed: old_names.difference(&new_names).cloned().collect(),
            leases_stopped: Vec::new(),
        };
        out.routes_added.sort();
        out.routes_removed.sort();
        // A lease no route uses any more: its requests still in flight finish (up
        // to the longest drain timeout of its old routes), then its fence stops.
        let mut gone: Vec<(LeaseName, std::time::Duration)> = Vec::new();
        for r in old.routes.iter() {
            let lease = &r.lease;
            if leases.contains(lease) {
                continue;
            }
            match gone.iter_mut().find(|(l, _)| l == lease) {
                Some((_, t)) => *t = (*t).max(r.drain_timeout),
                None => gone.push((lease.clone(), r.drain_timeout)),
            }
        }
        drop(old);
        for (lease, timeout) in gone {
            out.leases_stopped.push(lease.clone());
            let fences = self.shared.fences.clone();
            tokio::spawn(async move {
                fences.stop(&lease, timeout).await;
                tracing::info!(%lease, "no route uses this lease any more: drained and stopped");
            });
        }
        Ok(out)
    }

    /// Every member must agree on the leases of each shard (a cluster's fences
    /// follow its shards): routes may change, their leases may not.
    fn check_cluster_leases(&self, cfg: &Config) -> Result<(), ReloadError> {
        if self.shared.mode.cluster().is_none() {
            return Ok(());
        }
        let leases =
            |it: &mut dyn Iterator<Item = LeaseName>| -> HashSet<LeaseName> { it.collect() };
        let now = leases(
            &mut self
                .shared
                .live
                .current()
                .routes
                .iter()
                .map(|r| r.lease.clone()),
        );
        let next = leases(&mut cfg.routes.iter().map(|r| r.lease.clone()));
        if now != next {
            return Err(ReloadError::Fixed {
                key: "the set of route leases in a cluster".into(),
            });
        }
        Ok(())
    }
}

/// SPEC §11: a lease's requests are queued or forwarded, never both in one
/// run — a direct route's dedup records and a queued route's messages are
/// kept apart, so a key done on one would be delivered again by the other,
/// and a direct request could overtake a message.
fn check_kinds(current: &crate::live::Live, cfg: &Config) -> Result<(), ReloadError> {
    let running = current.routes.iter().map(|o| crate::config::RouteKind {
        name: &o.name,
        lease: o.lease.as_str(),
        queued: o.queued,
    });
    let next = cfg.routes.iter().map(crate::config::RouteKind::of);
    if let Some((q, d)) = crate::config::mixed_delivery(running.chain(next)) {
        // One of the pair runs now (the new config alone passed the rule).
        let now = current
            .routes
            .iter()
            .find(|o| {
                [q, d]
                    .iter()
                    .any(|k| o.name == k.name && o.lease.as_str() == k.lease)
            })
            .map_or(q, |o| if o.queued { q } else { d });
        return Err(ReloadError::Fixed {
            key: format!(
                "whether lease {}'s requests are queued (route {:?} is {} now)",
                now.lease,
                now.name,
                if now.queued { "queued" } else { "direct" }
            ),
        });
    }
    Ok(())
}

/// The environment variable that overrides `[server] log_level`, if set.
pub fn log_override() -> Option<&'static str> {
    ["FENCEGATE_LOG", "RUST_LOG"]
        .into_iter()
        .find(|v| std::env::var(v).is_ok_and(|s| !s.is_empty()))
}

/// The first fixed key whose value differs between two config files, named as
/// `[section] key` (or `[section]`).
fn fixed_key_changed(old: &toml::Table, new: &toml::Table) -> Option<String> {
    let mut sections: Vec<&String> = old.keys().chain(new.keys()).collect();
    sections.sort();
    sections.dedup();
    for section in sections {
        if section == "route" {
            continue;
        }
        let (a, b) = (old.get(section), new.get(section));
        if section != "server" {
            if a != b {
                return Some(format!("[{section}]"));
            }
            continue;
        }
        let empty = toml::Table::new();
        let table = |v: Option<&toml::Value>| v.and_then(toml::Value::as_table).cloned();
        let (a, b) = (
            table(a).unwrap_or_else(|| empty.clone()),
            table(b).unwrap_or_else(|| empty.clone()),
        );
        let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
        keys.sort();
        keys.dedup();
        for key in keys {
            let (x, y) = (a.get(key), b.get(key));
            let changed = if key == "tls" {
                // The certificate may change; TLS on or off is a listener change.
                x.is_some() != y.is_some()
            } else {
                !LIVE_SERVER_KEYS.contains(&key.as_str()) && x != y
            };
            if changed {
                return Some(format!("[server] {key}"));
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: &str) -> toml::Table {
        toml::from_str(s).unwrap()
    }

    #[test]
    fn only_routes_and_the_live_server_keys_may_change() {
        let base = "[server]\nlisten = \"127.0.0.1:1\"\nadmin_token = \"a\"\n[store]\nkind = \"dir\"\n[[route]]\nname = \"a\"\n";
        let same = |s: &str| fixed_key_changed(&t(base), &t(s));
        assert_eq!(same(base), None);
        assert_eq!(
            same(&base.replace("name = \"a\"", "name = \"b\"")),
            None,
            "routes change live"
        );
        assert_eq!(
            same(&base.replace("admin_token = \"a\"", "log_level = \"warn\"")),
            None
        );
        assert_eq!(
            same(&base.replace("127.0.0.1:1", "127.0.0.1:2")).as_deref(),
            Some("[server] listen")
        );
        assert_eq!(
            same(&base.replace("admin_token = \"a\"", "shutdown_delay = \"5s\"")).as_deref(),
            Some("[server] shutdown_delay"),
            "the shutdown delay is read once, at start"
        );
        assert_eq!(
            same(&base.replace("kind = \"dir\"", "kind = \"s3\"")).as_deref(),
            Some("[store]")
        );
        assert_eq!(
            same(&format!("{base}\n[cluster]\nshards = 4\n")).as_deref(),
            Some("[cluster]"),
            "a section added later is fixed"
        );
        assert_eq!(
            same(&format!("{base}\n[state]\nkind = \"postgres\"\n")).as_deref(),
            Some("[state]")
        );
        let tls = "[server.tls]\ncert = \"a\"\nkey = \"b\"\n";
        assert_eq!(
            fixed_key_changed(&t(tls), &t(&tls.replace("\"a\"", "\"c\""))),
            None,
            "another certificate"
        );
        assert_eq!(
            fixed_key_changed(&t(tls), &t("")).as_deref(),
            Some("[server] tls")
        );
    }
}
