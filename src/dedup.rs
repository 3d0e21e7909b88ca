//! Deduplication (SPEC §6): one record per (route, key) in the state store, so
//! that a retry of the *same* action is answered from the record instead of
//! repeated: keys, fingerprints, and what a record found means for the request.
//!
//! `in_flight` is durable before the request is forwarded; `done` is durable
//! before the worker gets its answer ([`crate::state`]); two concurrent requests
//! with one key never both forward.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use sha2::{Digest, Sha256};

use crate::clock::{unix_ms, Clock};
use crate::config::InDoubtPolicy;
use crate::epoch::Epoch;
pub use crate::state::{codec, Record, RequestLine, Resolution, Resolved, State, StoredResponse};
use crate::state::{Begun, End, Owner, RecordKey, StateError, StateStore, TakeOver};

/// A validated dedup key: 1–255 visible ASCII characters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DedupKey(String);

impl DedupKey {
    /// Validates a worker's `Idempotency-Key` header (SPEC §3); the error says why.
    pub fn parse(raw: &[u8]) -> Result<DedupKey, &'static str> {
        if raw.is_empty() {
            return Err("empty");
        }
        if raw.len() > 255 {
            return Err("longer than 255 characters");
        }
        if !raw.iter().all(|b| (0x21..=0x7e).contains(b)) {
            return Err("not visible ASCII");
        }
        // All bytes are visible ASCII, hence valid UTF-8.
        Ok(DedupKey(String::from_utf8_lossy(raw).into_owned()))
    }

    /// `sha256(route \n method \n path?query \n body)` as lowercase hex (SPEC §6).
    pub fn derive(route: &str, method: &str, path_query: &str, body: &[u8]) -> DedupKey {
        let mut h = Sha256::new();
        for part in [
            route.as_bytes(),
            b"\n",
            method.as_bytes(),
            b"\n",
            path_query.as_bytes(),
            b"\n",
            body,
        ] {
            h.update(part);
        }
        DedupKey(hex::encode(h.finalize()))
    }

    /// A request's key (SPEC §6): the worker's, else derived from a request
    /// whose body is `derived_from` (`derive_key = "content"` on a request
    /// that keeps a record, or any queued one), else none — a direct request
    /// then gets [`DedupKey::fresh`], a queued one is refused. The one place
    /// both paths take their key from.
    pub fn of_request(
        worker: Option<DedupKey>,
        route: &str,
        method: &str,
        path_query: &str,
        derived_from: Option<&[u8]>,
    ) -> Option<DedupKey> {
        worker.or_else(|| derived_from.map(|b| DedupKey::derive(route, method, path_query, b)))
    }

    /// A fresh unique key (`derive_key = "none"`): forwarded, never recorded.
    pub fn fresh() -> DedupKey {
        // `fg-` and 128 random bits in lowercase hex, built without formatting (it
        // runs on every such request).
        let mut bits = [0u8; 16];
        crate::entropy::fill(&mut bits);
        let mut hex = [0u8; 32];
        let _ = hex::encode_to_slice(bits, &mut hex);
        let mut key = String::with_capacity(35);
        key.push_str("fg-");
        key.push_str(std::str::from_utf8(&hex).unwrap_or_default());
        DedupKey(key)
    }

    /// The key, as forwarded and stored.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// SHA-256 of method, path?query and body: "the same request".
pub fn fingerprint(method: &str, path_query: &str, body: &[u8]) -> [u8; 32] {
    let mut h = Sha256::new();
    for part in [method.as_bytes(), b"\n", path_query.as_bytes(), b"\n", body] {
        h.update(part);
    }
    h.finalize().into()
}

/// The action a key is claimed for: its fingerprint ("the same request", SPEC
/// §6) and, for operators resolving it, its method and path.
#[derive(Debug, Clone)]
pub struct Action {
    /// Tells a repeat of the request from a reused key.
    pub fingerprint: [u8; 32],
    /// Method and path, for operators resolving an in-doubt key.
    pub request: RequestLine,
}

impl Action {
    /// The action of this request.
    pub fn new(method: &str, path_query: &str, body: &[u8]) -> Action {
        Action {
            fingerprint: fingerprint(method, path_query, body),
            request: RequestLine::new(method, path_query),
        }
    }

    /// SPEC §6, "the same request": `Ok` when this is a repeat of the request
    /// that first used the key (`first`: its fingerprint and, if kept, its
    /// line), else 422 `dedup_key_reused` saying what differs. The one place a
    /// key's reuse is judged: dedup records and queued messages (§11) alike.
    pub fn repeats(
        &self,
        route: &str,
        key: &str,
        first: (&[u8; 32], Option<&RequestLine>),
        frees: KeyFrees,
    ) -> Result<(), DedupError> {
        repeats(
            route,
            key,
            first,
            (&self.fingerprint, Some(&self.request)),
            frees,
        )
    }
}

/// [`Action::repeats`] on the parts of two requests.
fn repeats(
    route: &str,
    key: &str,
    first: (&[u8; 32], Option<&RequestLine>),
    this: (&[u8; 32], Option<&RequestLine>),
    frees: KeyFrees,
) -> Result<(), DedupError> {
    if first.0 == this.0 {
        return Ok(());
    }
    Err(DedupError::KeyReused {
        route: route.to_owned(),
        key: key.to_owned(),
        differs: Differs::between(first.1, this.1),
        frees,
    })
}

/// SPEC §6: a repeat of a delivered (`done`) request gets its stored answer
/// when its body was kept (within `max_replay_bytes`), else 409 `dedup_done`
/// — never an empty 200. For dedup records and queued messages (§11) alike.
pub fn replay_done(
    key: &str,
    response: Option<StoredResponse>,
) -> Result<StoredResponse, DedupError> {
    match response {
        Some(resp) if resp.body.is_some() => Ok(resp),
        other => Err(DedupError::Done {
            key: key.to_owned(),
            status: other.map(|r| r.status),
        }),
    }
}

/// Granted the right to forward a key: the holder must finish it.
#[derive(Debug)]
pub struct Ticket {
    key: RecordKey,
    owner: Owner,
    record: Record,
}

/// What `begin` decided.
#[derive(Debug)]
pub enum Begin {
    /// Forward; report the outcome with [`Dedup::finish`].
    Forward(Ticket),
    /// The action already happened: answer with the stored response.
    Replay(StoredResponse),
}

/// How a forwarded request ended.
pub enum Outcome<'a> {
    /// The upstream answered.
    Response {
        /// The upstream's status.
        status: StatusCode,
        /// The upstream's response headers.
        headers: &'a HeaderMap,
        /// The upstream's response body, as read so far.
        body: &'a Bytes,
        /// Whether the status is in the route's `retryable_statuses`: the record is
        /// deleted.
        retryable: bool,
        /// Bodies larger than this are not kept for replay.
        max_replay_bytes: usize,
    },
    /// Nothing was sent (connect failure): the key is free again.
    NotSent,
    /// Timeout, reset after sending, drain abort, shutdown: unknown.
    Unknown,
}

/// Why a key may not be forwarded now (SPEC §6).
#[derive(Debug, Clone, thiserror::Error)]
pub enum DedupError {
    /// 409 `dedup_in_flight`: the first request has not ended.
    #[error("a request with this idempotency key is already in flight")]
    InFlight {
        /// The dedup key.
        key: String,
    },
    /// 409 `dedup_in_doubt`: the route's policy is `reject`.
    #[error("the outcome of an earlier request with this idempotency key is unknown")]
    InDoubt {
        /// The route (the key's scope, and where an operator resolves it).
        route: String,
        /// The dedup key.
        key: String,
    },
    /// 422 `dedup_key_reused`: the key's record has a different fingerprint.
    #[error("this idempotency key was used for a different request")]
    KeyReused {
        /// The route (the key's scope).
        route: String,
        /// The dedup key.
        key: String,
        /// What differs from the request that first used the key.
        differs: Differs,
        /// When the key may be used again.
        frees: KeyFrees,
    },
    /// Delivered, but no response to replay: too large to store, or resolved as
    /// delivered by an operator (SPEC §6: never an empty 200).
    #[error("this idempotency key was delivered; its response was not stored")]
    Done {
        /// The dedup key.
        key: String,
        /// The upstream's status, when known (`upstream_status` in the body).
        status: Option<u16>,
    },
    /// The state backend failed: the request is refused, not forwarded unrecorded.
    #[error(transparent)]
    State(#[from] StateError),
}

/// What differs between a request and the one that first used its key (SPEC §6:
/// method, path?query and body make "the same request").
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Differs {
    /// The method; the first request's.
    Method(String),
    /// The path; the first request's (never its query: it may carry a credential).
    Path(String),
    /// Same method and path: the query or the body differs.
    QueryOrBody,
    /// A record written before fencegate kept the request line.
    Unknown,
}

impl Differs {
    /// Compares the first request's line (if kept) with this one's.
    fn between(first: Option<&RequestLine>, this: Option<&RequestLine>) -> Differs {
        match (first, this) {
            (Some(f), Some(t)) if f.method != t.method => Differs::Method(f.method.clone()),
            (Some(f), Some(t)) if f.path != t.path => Differs::Path(f.path.clone()),
            (Some(_), Some(_)) => Differs::QueryOrBody,
            _ => Differs::Unknown,
        }
    }
}

/// When a reused key may be used again (SPEC §6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyFrees {
    /// Its `done` record expires then (ms since the Unix epoch).
    At(u64),
    /// The first request is still in flight: it ends `done` (then expires after
    /// `[dedup] ttl`) or, when nothing was delivered, frees the key at once.
    AfterFirstEnds,
    /// In doubt: never by itself; an operator's resolution decides.
    WhenResolved,
}

/// The admin API's path of one dedup record (SPEC §8), the key escaped as a
/// path segment.
pub fn record_path(route: &str, key: &str) -> String {
    let mut out = format!("/v1/dedup/{}/", escape_segment(route));
    out.push_str(&escape_segment(key));
    out
}

/// Whether `route` and `key` could name a dedup record or a queued message: a
/// route's name has a lease name's form (`[a-z0-9][a-z0-9._-]{0,62}`, SPEC §9)
/// and a key is a dedup key (1–255 visible ASCII, §6). A lookup of anything
/// else (from a URL or a cursor) is answered "not found" or "malformed" without
/// asking the state: PostgreSQL refuses text holding a NUL, which was a 503.
pub fn could_name(route: &str, key: &str) -> bool {
    crate::epoch::LeaseName::parse(route).is_ok() && DedupKey::parse(key.as_bytes()).is_ok()
}

/// Escapes everything but RFC 3986's unreserved characters (a key in a path, a
/// cursor in a query).
pub fn escape_segment(s: &str) -> String {
    use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
    /// All but ALPHA, DIGIT and `-._~` (bytes above ASCII are always escaped).
    const NOT_UNRESERVED: &AsciiSet = &NON_ALPHANUMERIC
        .remove(b'-')
        .remove(b'.')
        .remove(b'_')
        .remove(b'~');
    utf8_percent_encode(s, NOT_UNRESERVED).to_string()
}

/// Counters for metrics.
#[derive(Debug, Default)]
pub struct DedupCounters {
    /// Repeats answered from a stored response.
    pub replays: AtomicU64,
    /// Repeats refused (in flight, in doubt, reused, done without a body).
    pub conflicts: AtomicU64,
    /// Records that went in doubt.
    pub in_doubt: AtomicU64,
    /// Expired `done` records removed by the sweeper.
    pub swept: AtomicU64,
}

/// The dedup rules of SPEC §6 over a [`StateStore`].
pub struct Dedup {
    state: Arc<dyn StateStore>,
    clock: Arc<dyn Clock>,
    ttl: Duration,
    /// Exported as metrics.
    pub counters: DedupCounters,
}

fn record_key(route: &str, key: &DedupKey) -> RecordKey {
    RecordKey {
        route: route.to_owned(),
        key: key.0.clone(),
    }
}

impl Dedup {
    /// `[dedup] ttl`: how long a `done` record (or a settled queued message)
    /// keeps its key.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Dedup over `state`, keeping `done` records for `ttl` past their outcome.
    pub fn new(state: Arc<dyn StateStore>, clock: Arc<dyn Clock>, ttl: Duration) -> Dedup {
        Dedup {
            state,
            clock,
            ttl,
            counters: DedupCounters::default(),
        }
    }

    fn now_ms(&self) -> u64 {
        unix_ms(self.clock.now())
    }

    /// When a claim may take over an existing record, as of now.
    fn rules(&self, now_ms: u64, policy: InDoubtPolicy) -> TakeOver {
        let ttl = u64::try_from(self.ttl.as_millis()).unwrap_or(u64::MAX);
        TakeOver {
            in_doubt: policy == InDoubtPolicy::Resend,
            // Expired when done (updated) + ttl <= now.
            done_before_ms: now_ms.saturating_add(1).saturating_sub(ttl),
        }
    }

    /// Claims `key` for a new forward, or answers from its record (SPEC §6).
    pub async fn begin(
        &self,
        owner: Owner,
        route: &str,
        key: &DedupKey,
        action: Action,
        epoch: Epoch,
        policy: InDoubtPolicy,
    ) -> Result<Begin, DedupError> {
        let Action {
            fingerprint: fp,
            request,
        } = action;
        let k = record_key(route, key);
        let now = self.now_ms();
        let fresh = Record {
            state: State::InFlight,
            fingerprint: fp,
            epoch,
            created_ms: now,
            updated_ms: now,
            response: None,
            request: Some(request),
        };
        let rec = match self
            .state
            .begin(owner, &k, &fresh, self.rules(now, policy))
            .await?
        {
            Begun::Claimed => {
                return Ok(Begin::Forward(Ticket {
                    key: k,
                    owner,
                    record: fresh,
                }))
            }
            Begun::Exists(rec) => rec,
        };
        let frees = match rec.state {
            State::Done => KeyFrees::At(
                rec.updated_ms
                    .saturating_add(u64::try_from(self.ttl.as_millis()).unwrap_or(u64::MAX)),
            ),
            State::InFlight => KeyFrees::AfterFirstEnds,
            State::InDoubt => KeyFrees::WhenResolved,
        };
        repeats(
            &k.route,
            &k.key,
            (&rec.fingerprint, rec.request.as_ref()),
            (&fresh.fingerprint, fresh.request.as_ref()),
            frees,
        )
        .inspect_err(|_| {
            self.counters.conflicts.fetch_add(1, Relaxed);
        })?;
        match rec.state {
            State::Done => {
                let resp = replay_done(&k.key, rec.response)?;
                self.counters.replays.fetch_add(1, Relaxed);
                Ok(Begin::Replay(resp))
            }
            State::InFlight => {
                self.counters.conflicts.fetch_add(1, Relaxed);
                Err(DedupError::InFlight { key: k.key })
            }
            State::InDoubt => Err(DedupError::InDoubt {
                route: k.route,
                key: k.key,
            }),
        }
    }

    /// Records how a forwarded request ended; for `done`, durable on return.
    pub async fn finish(&self, ticket: Ticket, outcome: Outcome<'_>) -> Result<(), StateError> {
        let Ticket {
            key,
            owner,
            mut record,
        } = ticket;
        record.updated_ms = self.now_ms();
        let end = match outcome {
            Outcome::Response {
                retryable: true, ..
            }
            | Outcome::NotSent => End::Delete,
            Outcome::Unknown => {
                self.counters.in_doubt.fetch_add(1, Relaxed);
                record.state = State::InDoubt;
                End::InDoubt(record)
            }
            Outcome::Response {
                status,
                headers,
                body,
                max_replay_bytes,
                ..
            } => {
                crate::failpoint::hit("dedup_response_before_done");
                record.state = State::Done;
                record.response = Some(StoredResponse {
                    status: status.as_u16(),
                    headers: headers
                        .iter()
                        .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
                        .collect(),
                    body: (body.len() <= max_replay_bytes).then(|| body.clone()),
                });
                End::Done(record)
            }
        };
        self.state.finish(owner, &key, end).await
    }

    /// Start-up: every `in_flight` record becomes `in_doubt` (we died mid-request).
    pub async fn recover(&self, owner: Owner) -> Result<usize, StateError> {
        self.state.recover(owner, self.now_ms()).await
    }

    /// Removes expired records. Returns how many.
    pub async fn sweep(&self) -> Result<usize, StateError> {
        let n = self
            .state
            .sweep(self.rules(self.now_ms(), InDoubtPolicy::Reject))
            .await?;
        self.counters.swept.fetch_add(n as u64, Relaxed);
        Ok(n)
    }

    /// The record of `key` on `route`, if any (admin API).
    pub async fn get(&self, route: &str, key: &DedupKey) -> Result<Option<Record>, StateError> {
        self.state.get(&record_key(route, key)).await
    }

    /// An operator resolves an in-doubt key: delivered → `done` without a stored
    /// body; not delivered → deleted.
    pub async fn resolve(
        &self,
        owner: Owner,
        route: &str,
        key: &DedupKey,
        how: Resolution,
    ) -> Result<Resolved, StateError> {
        self.state
            .resolve(owner, &record_key(route, key), how, self.now_ms())
            .await
    }

    /// Runs the retention sweep every `every` until `stop`.
    pub async fn run_sweeper(
        self: Arc<Self>,
        every: Duration,
        stop: tokio_util::sync::CancellationToken,
    ) {
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
            match self.sweep().await {
                Ok(0) => {}
                Ok(n) => tracing::info!(removed = n, "dedup sweep removed expired records"),
                Err(e) => tracing::warn!(error = %e, "dedup sweep failed"),
            }
        }
    }
}

impl StoredResponse {
    /// The replayed response: byte-identical status, stored headers and body.
    pub fn to_response(&self) -> http::Response<http_body_util::Full<Bytes>> {
        let mut resp = http::Response::new(http_body_util::Full::new(
            self.body.clone().unwrap_or_default(),
        ));
        *resp.status_mut() = StatusCode::from_u16(self.status).unwrap_or(StatusCode::OK);
        let h = resp.headers_mut();
        for (n, v) in &self.headers {
            if let (Ok(n), Ok(v)) = (
                HeaderName::from_bytes(n.as_bytes()),
                HeaderValue::from_bytes(v),
            ) {
                h.append(n, v);
            }
        }
        h.insert("x-fencegate-replayed", HeaderValue::from_static("true"));
        resp
    }
}

/// Seconds since the Unix epoch of a record time, for the admin API.
pub fn ms_to_system(ms: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_millis(ms)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use proptest::prelude::*;

    #[test]
    fn could_name_takes_route_names_and_dedup_keys_only() {
        assert!(could_name("hooks", "msg-1"));
        assert!(could_name("a.b_c-9", &"k".repeat(255)));
        assert!(could_name("hooks", "a/b%~!"));
        for (route, key) in [
            ("hooks", "a\0b"),
            ("hooks", ""),
            ("hooks", "a b"),
            ("hooks", "é"),
            ("hooks", &*"k".repeat(256)),
            ("Hooks", "k"),
            ("ho\0oks", "k"),
            ("", "k"),
            ("-hooks", "k"),
        ] {
            assert!(!could_name(route, key), "{route:?} {key:?}");
        }
    }

    #[test]
    fn fresh_keys_are_fg_and_128_bits_of_lowercase_hex() {
        let (a, b) = (DedupKey::fresh(), DedupKey::fresh());
        for k in [&a, &b] {
            let hex = k.as_str().strip_prefix("fg-").unwrap();
            assert_eq!(hex.len(), 32);
            assert!(hex
                .bytes()
                .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c)));
            assert!(DedupKey::parse(k.as_str().as_bytes()).is_ok());
        }
        assert_ne!(a, b);
    }

    #[test]
    fn keys_are_validated() {
        assert!(DedupKey::parse(b"abc-123_~!").is_ok());
        assert!(DedupKey::parse(&[b'a'; 255]).is_ok());
        assert_eq!(DedupKey::parse(b""), Err("empty"));
        assert!(DedupKey::parse(&[b'a'; 256]).is_err());
        assert!(DedupKey::parse(b"a b").is_err());
        assert!(DedupKey::parse("é".as_bytes()).is_err());
        assert!(DedupKey::parse(b"a\tb").is_err());
    }

    #[test]
    fn derived_key_matches_the_spec_formula() {
        let k = DedupKey::derive("billing", "POST", "/billing/x?a=1", b"body");
        let expect = hex::encode(Sha256::digest(b"billing\nPOST\n/billing/x?a=1\nbody"));
        assert_eq!(k.as_str(), expect);
    }

    proptest! {
        #[test]
        fn codec_round_trips(state in 0u8..3, epoch in any::<u64>(), c in any::<u64>(), status in 100u16..600,
                             hdrs in prop::collection::vec(("[a-z-]{1,12}", prop::collection::vec(any::<u8>(), 0..20)), 0..5),
                             body in prop::option::of(prop::collection::vec(any::<u8>(), 0..300)), with_resp in any::<bool>()) {
            let r = Record {
                state: [State::InFlight, State::Done, State::InDoubt][state as usize],
                fingerprint: [7; 32],
                epoch: Epoch::new(epoch),
                created_ms: c,
                updated_ms: c / 2,
                response: with_resp.then(|| StoredResponse { status, headers: hdrs, body: body.map(Bytes::from) }),
                request: (state == 1).then(|| RequestLine::new("PATCH", "/a/ü?b")),
            };
            prop_assert_eq!(codec::decode(&codec::encode(&r)), Some(r));
        }

        #[test]
        fn codec_never_panics(raw in prop::collection::vec(any::<u8>(), 0..200)) {
            let _ = codec::decode(&raw);
        }
    }

    #[tokio::test]
    async fn lifecycle_and_sweep_with_injected_clock() {
        let dir = tempfile::tempdir().unwrap();
        let durable = crate::state::sled::SledState::open(dir.path()).unwrap();
        let clock = ManualClock::new(SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000));
        let d = Dedup::new(durable, clock.clone(), Duration::from_secs(3600));
        let key = DedupKey::parse(b"k1").unwrap();
        let fp = fingerprint("POST", "/x", b"a");
        let Begin::Forward(t) = d
            .begin(
                Owner::SINGLE,
                "r",
                &key,
                Action {
                    fingerprint: fp,
                    request: RequestLine::new("POST", "/x"),
                },
                Epoch::new(1),
                InDoubtPolicy::Reject,
            )
            .await
            .unwrap()
        else {
            panic!("expected forward")
        };
        assert!(matches!(
            d.begin(
                Owner::SINGLE,
                "r",
                &key,
                Action {
                    fingerprint: fp,
                    request: RequestLine::new("POST", "/x"),
                },
                Epoch::new(1),
                InDoubtPolicy::Reject
            )
            .await,
            Err(DedupError::InFlight { .. })
        ));
        let headers = HeaderMap::new();
        let body = Bytes::from_static(b"ok");
        d.finish(
            t,
            Outcome::Response {
                status: StatusCode::CREATED,
                headers: &headers,
                body: &body,
                retryable: false,
                max_replay_bytes: 10,
            },
        )
        .await
        .unwrap();
        match d
            .begin(
                Owner::SINGLE,
                "r",
                &key,
                Action {
                    fingerprint: fp,
                    request: RequestLine::new("POST", "/x"),
                },
                Epoch::new(2),
                InDoubtPolicy::Reject,
            )
            .await
            .unwrap()
        {
            Begin::Replay(s) => assert_eq!((s.status, s.body.as_deref()), (201, Some(&b"ok"[..]))),
            Begin::Forward(_) => panic!("expected replay"),
        }
        assert!(matches!(
            d.begin(
                Owner::SINGLE,
                "r",
                &key,
                Action {
                    fingerprint: fingerprint("POST", "/x", b"b"),
                    request: RequestLine::new("POST", "/x"),
                },
                Epoch::new(2),
                InDoubtPolicy::Reject
            )
            .await,
            Err(DedupError::KeyReused { .. })
        ));
        // Another route is another scope.
        assert!(matches!(
            d.begin(
                Owner::SINGLE,
                "r2",
                &key,
                Action {
                    fingerprint: fp,
                    request: RequestLine::new("POST", "/x"),
                },
                Epoch::new(1),
                InDoubtPolicy::Reject
            )
            .await,
            Ok(Begin::Forward(_))
        ));
        assert_eq!(d.sweep().await.unwrap(), 0);
        clock.advance(Duration::from_secs(3601));
        // r2's record is still in flight: never swept from under a live request.
        assert_eq!(d.sweep().await.unwrap(), 1);
        assert!(d.get("r", &key).await.unwrap().is_none());
    }

    /// An `in_flight` or `in_doubt` record past the TTL is still what it was: a
    /// retry is refused (never forwarded a second time), and the sweep keeps it.
    #[tokio::test]
    async fn in_flight_and_in_doubt_records_never_expire_into_absent() {
        let dir = tempfile::tempdir().unwrap();
        let durable = crate::state::sled::SledState::open(dir.path()).unwrap();
        let clock = ManualClock::new(SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000));
        let d = Dedup::new(durable, clock.clone(), Duration::from_secs(2));
        let fp = fingerprint("POST", "/x", b"a");
        let (flying, doubtful) = (
            DedupKey::parse(b"flying").unwrap(),
            DedupKey::parse(b"doubtful").unwrap(),
        );
        let begin = |k| {
            d.begin(
                Owner::SINGLE,
                "r",
                k,
                Action {
                    fingerprint: fp,
                    request: RequestLine::new("POST", "/x"),
                },
                Epoch::new(1),
                InDoubtPolicy::Reject,
            )
        };
        let Ok(Begin::Forward(_in_flight)) = begin(&flying).await else {
            panic!("expected forward")
        };
        let Ok(Begin::Forward(t)) = begin(&doubtful).await else {
            panic!("expected forward")
        };
        d.finish(t, Outcome::Unknown).await.unwrap();
        clock.advance(Duration::from_secs(4));
        assert!(matches!(
            begin(&flying).await,
            Err(DedupError::InFlight { .. })
        ));
        assert!(matches!(
            begin(&doubtful).await,
            Err(DedupError::InDoubt { .. })
        ));
        assert_eq!(d.sweep().await.unwrap(), 0);
    }
}
