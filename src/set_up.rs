//! The set-up a gate object (SPEC §10) was written by: a single instance or a
//! cluster of some shard count, the state it keeps deliveries in, and — for a
//! cluster — a MAC that proves the object came from a member.
//!
//! Two set-ups on one store and prefix void the fence (each serves leases the
//! other serves), and so do two clusters of different shard counts (a lease
//! hashes to different shards). Every gate object carries its writer's set-up,
//! and every instance that reads one of another set-up that is still live stops
//! forwarding ([`crate::cluster`], [`crate::cluster::guard`]).
//!
//! Shard 0's gate lease is the prefix's *anchor*, the one gate lease a cluster
//! keeps in the store (its shards are owned through rows in the database): a
//! cluster serves no shard unless the anchor's latest gate object is one of its
//! own set-up, so a set-up that takes the anchor over from another one knows
//! which shards to look at (the previous object names its shard count; older
//! builds kept a gate lease per shard) — and does so after its own create, so
//! of two set-ups starting side by side at least one sees the other.

use std::fmt;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use std::time::{Duration, SystemTime};

use crate::config::{StateConfig, StateKind, MAX_SHARDS};
use crate::epoch::{EpochKind, EpochObject, EpochRecord, LeaseName};
use crate::lease::acquire::{free_at, LeaseStatus, PriorExpiry};
use crate::lease::{Epochs, StoreError};

/// A single instance, or a cluster of `shards` shards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SetUp {
    /// One instance holding the instance guard (SPEC §10.1).
    Single,
    /// Several instances sharing shards (SPEC §10.2).
    Cluster {
        /// How many shards.
        shards: u32,
    },
}

impl SetUp {
    /// The set-up a gate object says wrote it. Objects from before fencegate
    /// wrote `mode` were single instances'.
    pub fn of(rec: &EpochRecord) -> SetUp {
        match rec.mode.as_deref() {
            Some("cluster") => SetUp::Cluster {
                shards: rec.shards.unwrap_or(0),
            },
            _ => SetUp::Single,
        }
    }

    /// How many shards this set-up uses (older builds' clusters kept a gate
    /// lease for each under `{prefix}.gate/0000/` …),
    /// never more than a config allows (a forged object cannot make a reader
    /// look at billions of shards).
    pub fn shards(self) -> u32 {
        match self {
            SetUp::Single => 1,
            SetUp::Cluster { shards } => shards.min(MAX_SHARDS),
        }
    }

    /// Writes this set-up into a gate object.
    pub fn stamp(self, rec: &mut EpochRecord) {
        rec.mode = Some(self.mode().into());
        rec.shards = Some(self.shards());
    }

    /// The `mode` a gate object records: `single` or `cluster`.
    pub fn mode(self) -> &'static str {
        match self {
            SetUp::Single => "single",
            SetUp::Cluster { .. } => "cluster",
        }
    }
}

impl fmt::Display for SetUp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SetUp::Single => f.write_str("a single instance"),
            SetUp::Cluster { shards } => write!(f, "a cluster of {shards} shards"),
        }
    }
}

/// The gate lease's name of a shard: `0007`.
pub fn shard_name(shard: u32) -> LeaseName {
    // Four digits always make a valid lease name.
    LeaseName::parse(&format!("{shard:04}")).unwrap_or_else(|_| unreachable!())
}

/// Whether a gate lease's latest object (SPEC §10) lets a contender in now.
///
/// Anyone who can write under `.gate/` can create the next epoch of a gate
/// lease, so an object's own word must never end the tenure before it any
/// sooner than that tenure would end by itself. `trusted`: the object was
/// sealed by a member of this set-up (a cluster's MAC, or this single
/// instance's own key) and matches its key — its TTL is believed and its
/// release is final. Anything else — another instance's object, garbage, a
/// forged acquire or release — lets a contender in no sooner than `gate_ttl`
/// after it was written, nor before its own expiry, nor before the acquire it
/// follows expires by that acquire's own TTL (a holder with a longer `gate_ttl`
/// than the reader's); never, when nothing below it parses.
pub fn gate_free(st: &LeaseStatus, trusted: bool, gate_ttl: Duration, grace: Duration) -> bool {
    match gate_free_at(st, trusted, gate_ttl, grace) {
        Free::Now => true,
        Free::At(at) => st.store_earliest > at,
        Free::Never => false,
    }
}

/// When [`gate_free`] turns true on the store's clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Free {
    /// A contender may take it now.
    Now,
    /// Not before this time, on the store's clock.
    At(SystemTime),
    /// Never: nothing below the latest object parses, so no expiry can be believed.
    Never,
}

/// When [`gate_free`] turns true, so a waiting contender (or the keeper) knows when to
/// look again.
pub(crate) fn gate_free_at(
    st: &LeaseStatus,
    trusted: bool,
    gate_ttl: Duration,
    grace: Duration,
) -> Free {
    let (Some(object), Some(written)) = (&st.object, st.written) else {
        return Free::Now;
    };
    if trusted {
        return match object {
            EpochObject::Acquire { expires_at, .. } => Free::At(free_at(*expires_at, grace)),
            _ => Free::Now,
        };
    }
    let mut at = free_at(written + gate_ttl, grace);
    if let EpochObject::Acquire { expires_at, .. } = object {
        at = at.max(free_at(*expires_at, grace));
    }
    match st.prior_expiry {
        Some(PriorExpiry::At(prior)) => Free::At(at.max(free_at(prior, grace))),
        Some(PriorExpiry::Unknown) => Free::Never,
        Some(PriorExpiry::Nothing) | None => Free::At(at),
    }
}

/// How many shard gate leases have been used under the prefix: one more than
/// the highest `{prefix}.gate/NNNN/` that holds any object (read in one
/// delimiter listing; gaps and deleted old epochs do not hide a shard). A
/// set-up taking shard 0 over from an object it cannot trust reads every one
/// of them, whatever that object claims.
pub async fn shards_in_use(epochs: &Epochs) -> Result<u32, StoreError> {
    let prefix = epochs.prefix();
    let highest = epochs
        .store()
        .list_folders(prefix)
        .await?
        .iter()
        .filter_map(|f| {
            f.strip_prefix(prefix)?
                .strip_suffix('/')?
                .parse::<u32>()
                .ok()
        })
        .filter(|s| *s < MAX_SHARDS)
        .max();
    Ok(highest.map_or(1, |h| h + 1))
}

/// Where an instance keeps marks and dedup records, as its gate objects name it:
/// `sled:{instance id}` (sled lives in `data_dir`, beside the id), or the
/// database as `postgres://host:port/db`, with `schema=NAME` when its tables
/// are in a schema other than `public` (`schema`: the one in use, as the
/// database says) and `database_id=ID` (the id written into it,
/// [`crate::state::identity`]) as query parameters; never credentials. Instances that
/// name the same state share deliveries; a takeover between two that do not may
/// repeat a delivery.
pub fn state_of(
    cfg: &StateConfig,
    instance_id: &str,
    schema: Option<&str>,
    database_id: Option<&str>,
) -> String {
    match cfg.kind {
        StateKind::Sled => format!("sled:{instance_id}"),
        StateKind::Postgres => {
            let url = cfg.resolved_url().unwrap_or_default();
            match url.parse::<tokio_postgres::Config>() {
                Ok(c) => {
                    let hosts: Vec<String> = c
                        .get_hosts()
                        .iter()
                        .zip(c.get_ports().iter().chain(std::iter::repeat(&5432)))
                        .map(|(h, p)| match h {
                            tokio_postgres::config::Host::Tcp(h) => format!("{h}:{p}"),
                            #[cfg(unix)]
                            tokio_postgres::config::Host::Unix(d) => {
                                format!("{}:{p}", d.display())
                            }
                        })
                        .collect();
                    let db = c.get_dbname().or(c.get_user()).unwrap_or_default();
                    // Two schemas of one database keep two sets of deliveries,
                    // however the schema was chosen (`[state] schema`, the
                    // url's `search_path`, the role's); `public` is named as
                    // before schemas were (no suffix).
                    let mut query: Vec<String> = Vec::new();
                    if let Some(s) = schema.filter(|s| *s != "public") {
                        query.push(format!("schema={s}"));
                    }
                    // What the database is, not how it is reached: two
                    // environments reach their own by one host:port/db.
                    if let Some(id) = database_id {
                        query.push(format!("database_id={id}"));
                    }
                    let query = if query.is_empty() {
                        String::new()
                    } else {
                        format!("?{}", query.join("&"))
                    };
                    format!("postgres://{}/{db}{query}", hosts.join(","))
                }
                Err(_) => "postgres".into(),
            }
        }
    }
}

/// Whether two `state` names, as gate objects carry them, name one state: by
/// the database's id when both carry one — a database restored under another
/// name, or moved to another host, is still itself — else by the whole name
/// (`sled:{instance id}`: the id travels with its `data_dir`).
pub fn same_state(a: &str, b: &str) -> bool {
    fn database_id(state: &str) -> Option<&str> {
        let query = state.strip_prefix("postgres://")?.split_once('?')?.1;
        query
            .split('&')
            .find_map(|kv| kv.strip_prefix("database_id="))
    }
    match (database_id(a), database_id(b)) {
        (Some(x), Some(y)) => x == y,
        _ => a == b,
    }
}

/// The key of a cluster's gate-object MACs, derived from the peer token (which
/// every member has and workers do not): whoever can write under `.gate/` but
/// lacks the token cannot make members relay to an address of its choosing or
/// take ownership facts from its objects (SPEC §10.2).
#[derive(Clone)]
pub struct GateKey(Hmac<Sha256>);

impl fmt::Debug for GateKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("GateKey(..)")
    }
}

impl GateKey {
    /// A cluster's key: its peer token, bound to the gate objects' prefix (a
    /// sealed object copied from another prefix — a staging set-up with the
    /// same token — does not verify here).
    pub fn from_peer_token(token: &str, prefix: &str) -> GateKey {
        GateKey::derive(b"fencegate gate object v1", token.as_bytes(), prefix)
    }

    /// A single instance's key: a secret kept in its `data_dir`, so it can
    /// tell its own gate objects (taken back after a restart, or a release
    /// that is final) from anyone else's.
    pub fn from_secret(secret: &[u8], prefix: &str) -> GateKey {
        GateKey::derive(b"fencegate instance gate object v1", secret, prefix)
    }

    fn derive(label: &[u8], secret: &[u8], prefix: &str) -> GateKey {
        // HMAC takes a key of any length; a label keeps this use of the secret
        // apart from any other.
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(label)
            .unwrap_or_else(|_| unreachable!("HMAC takes any key length"));
        mac.update(&(secret.len() as u64).to_be_bytes());
        mac.update(secret);
        mac.update(prefix.as_bytes());
        let key = mac.finalize().into_bytes();
        GateKey(
            <Hmac<Sha256> as Mac>::new_from_slice(&key)
                .unwrap_or_else(|_| unreachable!("HMAC takes any key length")),
        )
    }

    /// The key of the record that says which set-up a database belongs to
    /// (SPEC §10): a cluster's peer token under a label of its own.
    pub(crate) fn for_set_up_record(token: &str) -> GateKey {
        GateKey::derive(b"fencegate set-up record v1", token.as_bytes(), "")
    }

    fn tag(&self, rec: &EpochRecord) -> Vec<u8> {
        self.tag_of(&canonical(rec))
    }

    /// The MAC of `message` under this key.
    pub(crate) fn tag_of(&self, message: &[u8]) -> Vec<u8> {
        let mut mac = self.0.clone();
        mac.update(message);
        mac.finalize().into_bytes().to_vec()
    }

    /// Whether `given` (hex) is the MAC of `message` (constant-time compare).
    pub(crate) fn verifies_message(&self, message: &[u8], given: &str) -> bool {
        let Ok(given) = hex::decode(given) else {
            return false;
        };
        let mut mac = self.0.clone();
        mac.update(message);
        mac.verify_slice(&given).is_ok()
    }

    /// Sets `rec.mac` over every other field of the object.
    pub fn seal(&self, rec: &mut EpochRecord) {
        rec.mac = Some(hex::encode(self.tag(rec)));
    }

    /// Whether `rec` was sealed with this key (constant-time compare).
    pub fn verifies(&self, rec: &EpochRecord) -> bool {
        rec.mac
            .as_deref()
            .is_some_and(|m| self.verifies_message(&canonical(rec), m))
    }
}

/// Appends one field of a sealed message: a byte 1, its length (u64,
/// big-endian) and its bytes, or a byte 0 when absent — no field can run into
/// the next.
pub(crate) fn push_field(out: &mut Vec<u8>, v: Option<&str>) {
    match v {
        Some(s) => {
            out.push(1);
            out.extend_from_slice(&(s.len() as u64).to_be_bytes());
            out.extend_from_slice(s.as_bytes());
        }
        None => out.push(0),
    }
}

/// The fields a MAC covers, each length-prefixed ([`push_field`]).
fn canonical(rec: &EpochRecord) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    let mut field = |v: Option<&str>| push_field(&mut out, v);
    let kind = match rec.kind {
        EpochKind::Acquire => "acquire",
        EpochKind::Release => "release",
    };
    field(Some(&rec.v.to_string()));
    field(Some(&rec.lease));
    field(Some(&rec.epoch.to_string()));
    field(Some(kind));
    field(Some(&rec.holder));
    field(rec.token_sha256.as_deref());
    field(rec.ttl_ms.map(|t| t.to_string()).as_deref());
    field(rec.advertise.as_deref());
    field(rec.mode.as_deref());
    field(rec.shards.map(|s| s.to_string()).as_deref());
    field(rec.state.as_deref());
    // Sealed only when present, so objects written before it verify as
    // they did.
    if let Some(g) = rec.state_generation {
        field(Some(&g.to_string()));
    }
    out
}

/// The lease store a set-up names (SPEC §10): `s3://{bucket}`, or
/// `dir:{path}` — one directory however the config spells it (relative, `./`,
/// a symlink). The S3 endpoint is not part of it: one bucket is reached
/// through several (regional, VPC, path-style) ones.
pub fn store_name(cfg: &crate::config::Config) -> String {
    match cfg.store.kind {
        crate::config::StoreKind::S3 => {
            format!("s3://{}", cfg.store.bucket.as_deref().unwrap_or_default())
        }
        crate::config::StoreKind::Dir => format!(
            "dir:{}",
            std::fs::canonicalize(&cfg.store.path)
                .unwrap_or_else(|_| cfg.store.path.clone())
                .display()
        ),
    }
}

/// A fresh id: 128 random bits, hex (a set-up's, a database's).
pub(crate) fn new_id() -> String {
    format!(
        "{:016x}{:016x}",
        crate::entropy::u64(),
        crate::entropy::u64()
    )
}

/// The key of the set-up's id in the lease store: beside the gate objects,
/// outside any lease's folder (lease names do not start with a dot).
pub(crate) fn set_up_key(prefix: &str) -> String {
    format!("{prefix}.set-up")
}

/// The object at [`set_up_key`].
#[derive(serde::Serialize, serde::Deserialize)]
struct StoreObject {
    v: u32,
    set_up: String,
    created_by: String,
}

pub(crate) fn store_error(e: crate::lease::StoreError) -> crate::state::StateError {
    crate::state::StateError::Write(format!("the lease store's set-up object: {e}"))
}

/// The set-up id the lease store keeps, if any.
pub(crate) async fn store_id(
    store: &std::sync::Arc<dyn crate::lease::LeaseStore>,
    prefix: &str,
) -> Result<Option<String>, crate::state::StateError> {
    let Some(o) = store.get(&set_up_key(prefix)).await.map_err(store_error)? else {
        return Ok(None);
    };
    serde_json::from_slice::<StoreObject>(&o.body)
        .map(|o| Some(o.set_up))
        .map_err(|e| {
            crate::state::StateError::Write(format!(
                "the lease store's {} does not parse ({e}): it is fencegate's, written once; restore it or, with every instance stopped, delete it and the database's fencegate_set_up row",
                set_up_key(prefix)
            ))
        })
}

/// Creates the store's set-up id (conditionally: of two creates, one wins
/// and both read its id back).
pub(crate) async fn create_store_id(
    store: &std::sync::Arc<dyn crate::lease::LeaseStore>,
    prefix: &str,
    created_by: &str,
) -> Result<String, crate::state::StateError> {
    let body = StoreObject {
        v: 1,
        set_up: new_id(),
        created_by: created_by.to_owned(),
    };
    let bytes =
        serde_json::to_vec(&body).map_err(|e| crate::state::StateError::Write(e.to_string()))?;
    store
        .create_if_absent(&set_up_key(prefix), bytes.into())
        .await
        .map_err(store_error)?;
    store_id(store, prefix).await?.ok_or_else(|| {
        crate::state::StateError::Write(format!(
            "the lease store's {} was created but cannot be read back",
            set_up_key(prefix)
        ))
    })
}

/// How many gate epochs below the latest are read for the state they name.
const GATE_OBJECTS_READ: u64 = 16;

/// Whether the gate lease of shard 0 (a single instance's guard or a cluster's
/// anchor) names `state` in one of its latest objects: the records
/// already in an unrecorded database were written by this set-up.
pub(crate) async fn named_by_gate_objects(
    store: &std::sync::Arc<dyn crate::lease::LeaseStore>,
    prefix: &str,
    state: &str,
) -> Result<bool, crate::state::StateError> {
    let prefix = format!("{prefix}.gate/");
    let shard = crate::set_up::shard_name(0);
    let epochs = crate::lease::Epochs::new(store.clone(), prefix.clone());
    let latest = epochs
        .latest_after(&shard, crate::epoch::Epoch::NONE)
        .await
        .map_err(store_error)?
        .get();
    for e in (latest.saturating_sub(GATE_OBJECTS_READ - 1)..=latest).rev() {
        if e == 0 {
            break;
        }
        let key = crate::epoch::object_key(&prefix, &shard, crate::epoch::Epoch::new(e));
        let Some(o) = store.get(&key).await.map_err(store_error)? else {
            continue;
        };
        let named = serde_json::from_slice::<crate::epoch::EpochRecord>(&o.body)
            .ok()
            .and_then(|r| r.state);
        if named.is_some_and(|n| same_state(&n, state)) {
            return Ok(true);
        }
    }
    Ok(false)
}

/// How many of a state's own latest gate objects are read for the highest
/// generation they name, and how far back at most they are looked for (other
/// states' objects — a takeover's — in between).
const GENERATIONS_READ: usize = 16;
const GENERATIONS_DEPTH: u64 = 1024;

/// The highest `state_generation` among the latest gate objects of `shard`
/// (up to `latest`) that name `state` (none: no such object carries one):
/// the latest 16 of them, looked for up to 1,024 epochs back. Sealed or not:
/// another `data_dir` on the same database, or a member under an older peer
/// token, wrote them as truly as this one. A forged object can make a state
/// fence itself (availability); none can make it skip a fence
/// ([`crate::state::identity`]).
pub async fn generation_seen(
    epochs: &Epochs,
    shard: &LeaseName,
    latest: crate::epoch::Epoch,
    state: &str,
) -> Result<Option<u64>, StoreError> {
    let (mut seen, mut ours) = (None, 0);
    let top = latest.get();
    for e in (top.saturating_sub(GENERATIONS_DEPTH - 1)..=top).rev() {
        if e == 0 || ours >= GENERATIONS_READ {
            break;
        }
        let key = crate::epoch::object_key(epochs.prefix(), shard, crate::epoch::Epoch::new(e));
        let Some(o) = epochs.store().get(&key).await? else {
            continue;
        };
        let Ok(r) = serde_json::from_slice::<EpochRecord>(&o.body) else {
            continue;
        };
        if r.epoch == e
            && r.lease == shard.as_str()
            && r.state.as_deref().is_some_and(|n| same_state(n, state))
        {
            ours += 1;
            seen = seen.max(r.state_generation);
        }
    }
    Ok(seen)
}

/// `state` without its `database_id` (how gate objects from before database
/// ids named the same database).
pub fn without_database_id(state: &str) -> String {
    let Some((base, query)) = state.split_once('?') else {
        return state.to_owned();
    };
    let rest: Vec<&str> = query
        .split('&')
        .filter(|kv| !kv.starts_with("database_id="))
        .collect();
    if rest.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", rest.join("&"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::epoch::{Epoch, LeaseName};
    use std::time::Duration;

    fn record() -> EpochRecord {
        let lease = LeaseName::parse("0003").unwrap();
        let mut r =
            EpochRecord::acquire(&lease, Epoch::new(7), "fg-a", b"t", Duration::from_secs(6));
        SetUp::Cluster { shards: 4 }.stamp(&mut r);
        r.advertise = Some("http://10.0.0.1:8080".into());
        r
    }

    /// A sealed object verifies; any field changed, another key or no MAC does not.
    #[test]
    fn a_seal_covers_every_field_and_only_its_key_verifies_it() {
        let key = GateKey::from_peer_token("0123456789abcdef", "p/.gate/");
        let mut r = record();
        key.seal(&mut r);
        assert!(key.verifies(&r));
        assert!(!GateKey::from_peer_token("0123456789abcdeX", "p/.gate/").verifies(&r));
        assert!(!GateKey::from_peer_token("0123456789abcdef", "staging/.gate/").verifies(&r));
        let edits: [fn(&mut EpochRecord); 8] = [
            |r| r.state_generation = Some(9),
            |r| r.advertise = Some("http://evil:80".into()),
            |r| r.holder = "fg-z".into(),
            |r| r.epoch += 1,
            |r| r.shards = Some(2),
            |r| r.mode = Some("single".into()),
            |r| r.ttl_ms = Some(1),
            |r| r.kind = EpochKind::Release,
        ];
        for edit in edits {
            let mut forged = r.clone();
            edit(&mut forged);
            assert!(!key.verifies(&forged), "{forged:?}");
        }
        let mut bare = r.clone();
        bare.mac = None;
        assert!(!key.verifies(&bare));
        // Serialized and read back: still verifies.
        let back: EpochRecord = serde_json::from_slice(&r.to_json()).unwrap();
        assert!(key.verifies(&back));
    }

    /// A state generation is sealed when present; an object without one
    /// is sealed as before generations existed (older objects verify).
    #[test]
    fn a_state_generation_is_sealed_when_present() {
        let key = GateKey::from_peer_token("0123456789abcdef", "p/.gate/");
        let mut r = record();
        let before = canonical(&r);
        r.state_generation = Some(7);
        assert_ne!(canonical(&r), before);
        key.seal(&mut r);
        assert!(key.verifies(&r));
        let mut stripped = r.clone();
        stripped.state_generation = None;
        assert!(!key.verifies(&stripped), "a generation cannot be stripped");
        let mut lowered = r.clone();
        lowered.state_generation = Some(6);
        assert!(!key.verifies(&lowered));
    }

    #[test]
    fn one_database_under_two_addresses_is_one_state() {
        let a = "postgres://db-a:5432/fg?database_id=ab12";
        assert!(same_state(
            a,
            "postgres://db-b:6432/restored?database_id=ab12"
        ));
        assert!(same_state(
            a,
            "postgres://db-a:5432/fg?schema=x&database_id=ab12"
        ));
        assert!(!same_state(a, "postgres://db-a:5432/fg?database_id=cd34"));
        assert!(
            !same_state(a, "postgres://db-a:5432/fg"),
            "an object from before ids"
        );
        assert!(same_state("sled:fg-1", "sled:fg-1"));
        assert_eq!(without_database_id(a), "postgres://db-a:5432/fg");
        assert_eq!(
            without_database_id("postgres://h:1/fg?schema=x&database_id=ab12"),
            "postgres://h:1/fg?schema=x"
        );
        assert_eq!(without_database_id("sled:fg-1"), "sled:fg-1");
        assert!(!same_state("sled:fg-1", "sled:fg-2"));
    }

    /// A database is named by its id, never by the connection string alone.
    #[test]
    fn a_database_is_named_by_its_id() {
        let cfg = crate::config::Config::parse(
            "[state]\nkind = \"postgres\"\nurl = \"postgres://fg@db:5432/fencegate\"\n[[route]]\nname = \"r\"\npath_prefix = \"/r/\"\nupstream = \"http://127.0.0.1:1/\"\nlease = \"l\"\n",
        )
        .unwrap();
        assert_eq!(
            state_of(&cfg.state, "", Some("public"), Some("ab12")),
            "postgres://db:5432/fencegate?database_id=ab12"
        );
        assert_eq!(
            state_of(&cfg.state, "", Some("fg_prod"), Some("ab12")),
            "postgres://db:5432/fencegate?schema=fg_prod&database_id=ab12"
        );
        assert_ne!(
            state_of(&cfg.state, "", None, Some("ab12")),
            state_of(&cfg.state, "", None, Some("cd34")),
            "two databases at one address are two states"
        );
    }

    #[test]
    fn objects_without_a_mode_are_single_instances() {
        let mut r = record();
        r.mode = None;
        assert_eq!(SetUp::of(&r), SetUp::Single);
        assert_eq!(SetUp::of(&record()), SetUp::Cluster { shards: 4 });
    }
}
