//! Deduplication (SPEC §6): one record per (route, key) in sled, so that a retry of
//! the *same* action is answered from the record instead of repeated.
//!
//! `in_flight` is durable (group commit) before the request is forwarded; `done`
//! is durable before the worker gets its answer. A record's transitions are
//! compare-and-swap on its key, so two concurrent requests with one key cannot
//! both forward.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use sha2::{Digest, Sha256};

use crate::clock::{unix_ms, Clock};
use crate::config::InDoubtPolicy;
use crate::durable::{Durable, DurableError};
use crate::epoch::Epoch;
use crate::error::ProxyError;

/// A validated dedup key: 1–255 visible ASCII characters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DedupKey(String);

impl DedupKey {
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

    /// A fresh unique key (`derive_key = "none"`): forwarded, never recorded.
    pub fn fresh() -> DedupKey {
        // `fg-` and 128 random bits in lowercase hex, built without formatting (it
        // runs on every such request).
        let mut bits = [0u8; 16];
        rand::RngCore::fill_bytes(&mut rand::thread_rng(), &mut bits);
        let mut hex = [0u8; 32];
        let _ = hex::encode_to_slice(bits, &mut hex);
        let mut key = String::with_capacity(35);
        key.push_str("fg-");
        key.push_str(std::str::from_utf8(&hex).unwrap_or_default());
        DedupKey(key)
    }

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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    InFlight,
    Done,
    InDoubt,
}

impl State {
    pub fn as_str(self) -> &'static str {
        match self {
            State::InFlight => "in_flight",
            State::Done => "done",
            State::InDoubt => "in_doubt",
        }
    }
}

/// A stored response (for `done`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    pub status: u16,
    pub headers: Vec<(String, Vec<u8>)>,
    /// `None` when the body exceeded `max_replay_bytes` or an operator resolved the
    /// key as delivered.
    pub body: Option<Bytes>,
}

/// One dedup record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub state: State,
    pub fingerprint: [u8; 32],
    pub epoch: Epoch,
    pub created_ms: u64,
    pub updated_ms: u64,
    pub response: Option<StoredResponse>,
}

/// The binary record codec: versioned, length-prefixed, bounds-checked on decode.
pub mod codec {
    use super::*;

    const VERSION: u8 = 1;

    pub fn encode(r: &Record) -> Vec<u8> {
        let mut out = Vec::with_capacity(
            64 + r
                .response
                .as_ref()
                .map_or(0, |s| s.body.as_ref().map_or(0, Bytes::len)),
        );
        out.push(VERSION);
        out.push(match r.state {
            State::InFlight => 0,
            State::Done => 1,
            State::InDoubt => 2,
        });
        out.extend_from_slice(&r.fingerprint);
        out.extend_from_slice(&r.epoch.get().to_be_bytes());
        out.extend_from_slice(&r.created_ms.to_be_bytes());
        out.extend_from_slice(&r.updated_ms.to_be_bytes());
        match &r.response {
            None => out.push(0),
            Some(s) => {
                out.push(1);
                out.extend_from_slice(&s.status.to_be_bytes());
                out.extend_from_slice(&(s.headers.len() as u32).to_be_bytes());
                for (n, v) in &s.headers {
                    out.extend_from_slice(&(n.len() as u32).to_be_bytes());
                    out.extend_from_slice(n.as_bytes());
                    out.extend_from_slice(&(v.len() as u32).to_be_bytes());
                    out.extend_from_slice(v);
                }
                match &s.body {
                    None => out.push(0),
                    Some(b) => {
                        out.push(1);
                        out.extend_from_slice(&(b.len() as u32).to_be_bytes());
                        out.extend_from_slice(b);
                    }
                }
            }
        }
        out
    }

    struct Reader<'a>(&'a [u8]);

    impl<'a> Reader<'a> {
        fn take(&mut self, n: usize) -> Option<&'a [u8]> {
            if self.0.len() < n {
                return None;
            }
            let (a, b) = self.0.split_at(n);
            self.0 = b;
            Some(a)
        }
        fn u8(&mut self) -> Option<u8> {
            self.take(1).map(|b| b[0])
        }
        fn u16(&mut self) -> Option<u16> {
            self.take(2)
                .and_then(|b| b.try_into().ok())
                .map(u16::from_be_bytes)
        }
        fn u32(&mut self) -> Option<u32> {
            self.take(4)
                .and_then(|b| b.try_into().ok())
                .map(u32::from_be_bytes)
        }
        fn u64(&mut self) -> Option<u64> {
            self.take(8)
                .and_then(|b| b.try_into().ok())
                .map(u64::from_be_bytes)
        }
    }

    pub fn decode(raw: &[u8]) -> Option<Record> {
        let mut r = Reader(raw);
        if r.u8()? != VERSION {
            return None;
        }
        let state = match r.u8()? {
            0 => State::InFlight,
            1 => State::Done,
            2 => State::InDoubt,
            _ => return None,
        };
        let fingerprint: [u8; 32] = r.take(32)?.try_into().ok()?;
        let epoch = Epoch::new(r.u64()?);
        let created_ms = r.u64()?;
        let updated_ms = r.u64()?;
        let response = match r.u8()? {
            0 => None,
            1 => {
                let status = r.u16()?;
                let n = r.u32()? as usize;
                let mut headers = Vec::with_capacity(n.min(128));
                for _ in 0..n {
                    let nl = r.u32()? as usize;
                    let name = std::str::from_utf8(r.take(nl)?).ok()?.to_owned();
                    let vl = r.u32()? as usize;
                    headers.push((name, r.take(vl)?.to_vec()));
                }
                let body = match r.u8()? {
                    0 => None,
                    1 => {
                        let bl = r.u32()? as usize;
                        Some(Bytes::copy_from_slice(r.take(bl)?))
                    }
                    _ => return None,
                };
                Some(StoredResponse {
                    status,
                    headers,
                    body,
                })
            }
            _ => return None,
        };
        if !r.0.is_empty() {
            return None;
        }
        Some(Record {
            state,
            fingerprint,
            epoch,
            created_ms,
            updated_ms,
            response,
        })
    }
}

/// Granted the right to forward a key: the holder must finish it.
#[derive(Debug)]
pub struct Ticket {
    key: Vec<u8>,
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
        status: StatusCode,
        headers: &'a HeaderMap,
        body: &'a Bytes,
        retryable: bool,
        max_replay_bytes: usize,
    },
    /// Nothing was sent (connect failure): the key is free again.
    NotSent,
    /// Timeout, reset after sending, drain abort, shutdown: unknown.
    Unknown,
}

/// Counters for metrics.
#[derive(Debug, Default)]
pub struct DedupCounters {
    pub replays: std::sync::atomic::AtomicU64,
    pub conflicts: std::sync::atomic::AtomicU64,
    pub in_doubt: std::sync::atomic::AtomicU64,
    pub swept: std::sync::atomic::AtomicU64,
}

pub struct Dedup {
    durable: Arc<Durable>,
    clock: Arc<dyn Clock>,
    ttl: Duration,
    pub counters: DedupCounters,
}

/// An operator's resolution of an in-doubt key (SPEC §8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Resolution {
    Delivered,
    NotDelivered,
}

fn db_key(route: &str, key: &DedupKey) -> Vec<u8> {
    let mut k = Vec::with_capacity(route.len() + 1 + key.0.len());
    k.extend_from_slice(route.as_bytes());
    k.push(0);
    k.extend_from_slice(key.0.as_bytes());
    k
}

fn write_err(e: sled::Error) -> ProxyError {
    ProxyError::StateUnavailable {
        detail: e.to_string(),
    }
}

fn durable_err(e: DurableError) -> ProxyError {
    ProxyError::StateUnavailable {
        detail: e.to_string(),
    }
}

impl Dedup {
    pub fn new(durable: Arc<Durable>, clock: Arc<dyn Clock>, ttl: Duration) -> Dedup {
        Dedup {
            durable,
            clock,
            ttl,
            counters: DedupCounters::default(),
        }
    }

    fn tree(&self) -> &sled::Tree {
        self.durable.dedup_tree()
    }

    fn now_ms(&self) -> u64 {
        unix_ms(self.clock.now())
    }

    /// Only a `done` record expires: an `in_flight` or `in_doubt` one never turns
    /// into "absent" (SPEC §6) — its request may still be at the destination, and
    /// treating it as absent would forward the key again.
    fn expired(&self, r: &Record, now_ms: u64) -> bool {
        r.state == State::Done
            && r.created_ms
                .saturating_add(u64::try_from(self.ttl.as_millis()).unwrap_or(u64::MAX))
                <= now_ms
    }

    /// Claims `key` for a new forward, or answers from its record (SPEC §6).
    pub async fn begin(
        &self,
        route: &str,
        key: &DedupKey,
        fp: [u8; 32],
        epoch: Epoch,
        policy: InDoubtPolicy,
    ) -> Result<Begin, ProxyError> {
        use std::sync::atomic::Ordering::Relaxed;
        let k = db_key(route, key);
        // Most keys are new: claim them with one compare-and-swap from "absent"
        // instead of a read and then a swap (each walks sled's tree). A key that
        // exists comes back with its current value and takes the general path.
        let now = self.now_ms();
        let fresh = Record {
            state: State::InFlight,
            fingerprint: fp,
            epoch,
            created_ms: now,
            updated_ms: now,
            response: None,
        };
        let mut current = match self
            .tree()
            .compare_and_swap(&k, None::<&[u8]>, Some(codec::encode(&fresh)))
            .map_err(write_err)?
        {
            Ok(()) => return self.in_flight_written(k, fresh).await,
            Err(e) => e.current,
        };
        loop {
            let now = self.now_ms();
            let existing = current.as_ref().and_then(|v| codec::decode(v));
            if let Some(rec) = existing.as_ref().filter(|r| !self.expired(r, now)) {
                if rec.fingerprint != fp {
                    self.counters.conflicts.fetch_add(1, Relaxed);
                    return Err(ProxyError::DedupKeyReused { key: key.0.clone() });
                }
                match rec.state {
                    State::Done => {
                        self.counters.replays.fetch_add(1, Relaxed);
                        let resp = rec.response.clone().unwrap_or(StoredResponse {
                            status: 200,
                            headers: Vec::new(),
                            body: None,
                        });
                        return Ok(Begin::Replay(resp));
                    }
                    State::InFlight => {
                        self.counters.conflicts.fetch_add(1, Relaxed);
                        return Err(ProxyError::DedupInFlight { key: key.0.clone() });
                    }
                    State::InDoubt if policy == InDoubtPolicy::Reject => {
                        return Err(ProxyError::DedupInDoubt { key: key.0.clone() });
                    }
                    State::InDoubt => {}
                }
            }
            let record = Record {
                state: State::InFlight,
                fingerprint: fp,
                epoch,
                created_ms: existing
                    .as_ref()
                    .filter(|r| !self.expired(r, now))
                    .map_or(now, |r| r.created_ms),
                updated_ms: now,
                response: None,
            };
            match self
                .tree()
                .compare_and_swap(&k, current.as_ref(), Some(codec::encode(&record)))
                .map_err(write_err)?
            {
                Ok(()) => return self.in_flight_written(k, record).await,
                // Raced with another request of this key: look again.
                Err(e) => current = e.current,
            }
        }
    }

    /// The `in_flight` record is written: makes it durable before the forward.
    async fn in_flight_written(&self, key: Vec<u8>, record: Record) -> Result<Begin, ProxyError> {
        crate::failpoint::hit("dedup_in_flight_written");
        self.durable.commit().await.map_err(|e| {
            // Not durable: do not forward. Leave the record in flight; it turns
            // in doubt at the next start-up if it did reach the disk.
            durable_err(e)
        })?;
        crate::failpoint::hit("dedup_in_flight_flushed");
        Ok(Begin::Forward(Ticket { key, record }))
    }

    /// Records how a forwarded request ended; for `done`, durable on return.
    pub async fn finish(&self, ticket: Ticket, outcome: Outcome<'_>) -> Result<(), ProxyError> {
        let Ticket { key, mut record } = ticket;
        record.updated_ms = self.now_ms();
        match outcome {
            Outcome::Response {
                retryable: true, ..
            }
            | Outcome::NotSent => {
                self.tree().remove(&key).map_err(write_err)?;
                Ok(())
            }
            Outcome::Unknown => {
                self.counters
                    .in_doubt
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                record.state = State::InDoubt;
                self.tree()
                    .insert(&key, codec::encode(&record))
                    .map_err(write_err)?;
                // Not awaited as durable: a crash here leaves `in_flight`, which
                // start-up turns into `in_doubt` anyway.
                Ok(())
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
                self.tree()
                    .insert(&key, codec::encode(&record))
                    .map_err(write_err)?;
                self.durable.commit().await.map_err(durable_err)?;
                crate::failpoint::hit("dedup_done_flushed");
                Ok(())
            }
        }
    }

    /// Start-up: every `in_flight` record becomes `in_doubt` (we died mid-request).
    pub async fn recover(&self) -> Result<usize, DurableError> {
        let mut n = 0;
        for item in self.tree().iter() {
            let (k, v) = item.map_err(|e| DurableError::Write(e.to_string()))?;
            if let Some(mut r) = codec::decode(&v) {
                if r.state == State::InFlight {
                    r.state = State::InDoubt;
                    r.updated_ms = self.now_ms();
                    self.tree()
                        .insert(k, codec::encode(&r))
                        .map_err(|e| DurableError::Write(e.to_string()))?;
                    n += 1;
                }
            }
        }
        if n > 0 {
            self.durable.commit().await?;
        }
        Ok(n)
    }

    /// Removes records older than the TTL. Returns how many.
    pub fn sweep(&self) -> usize {
        let now = self.now_ms();
        let mut n = 0;
        for (k, v) in self.tree().iter().filter_map(Result::ok) {
            let expired = codec::decode(&v).is_none_or(|r| self.expired(&r, now));
            if expired
                && self
                    .tree()
                    .compare_and_swap(&k, Some(v), None::<&[u8]>)
                    .is_ok_and(|r| r.is_ok())
            {
                n += 1;
            }
        }
        self.counters
            .swept
            .fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
        n
    }

    /// The record of `key` on `route`, if any (admin API).
    pub fn get(&self, route: &str, key: &DedupKey) -> Result<Option<Record>, DurableError> {
        let v = self
            .tree()
            .get(db_key(route, key))
            .map_err(|e| DurableError::Write(e.to_string()))?;
        Ok(v.and_then(|v| codec::decode(&v)))
    }

    /// An operator resolves an in-doubt key: delivered → `done` without a stored
    /// body; not delivered → deleted. Returns the new state (None = deleted), or
    /// `Err(Some(state))` when the key is not in doubt.
    pub async fn resolve(
        &self,
        route: &str,
        key: &DedupKey,
        how: Resolution,
    ) -> Result<Result<Option<State>, Option<State>>, DurableError> {
        let k = db_key(route, key);
        let wr = |e: sled::Error| DurableError::Write(e.to_string());
        let current = self.tree().get(&k).map_err(wr)?;
        let Some(mut rec) = current.as_ref().and_then(|v| codec::decode(v)) else {
            return Ok(Err(None));
        };
        if rec.state != State::InDoubt {
            return Ok(Err(Some(rec.state)));
        }
        let new = match how {
            Resolution::NotDelivered => None,
            Resolution::Delivered => {
                rec.state = State::Done;
                rec.updated_ms = self.now_ms();
                rec.response = None;
                Some(codec::encode(&rec))
            }
        };
        if self
            .tree()
            .compare_and_swap(&k, current, new)
            .map_err(wr)?
            .is_err()
        {
            return Ok(Err(Some(State::InFlight)));
        }
        self.durable.commit().await?;
        Ok(Ok(match how {
            Resolution::Delivered => Some(State::Done),
            Resolution::NotDelivered => None,
        }))
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
            let me = self.clone();
            let n = tokio::task::spawn_blocking(move || me.sweep())
                .await
                .unwrap_or(0);
            if n > 0 {
                tracing::info!(removed = n, "dedup sweep removed expired records");
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
        if self.body.is_none() {
            h.insert(
                "x-fencegate-replay-body",
                HeaderValue::from_static("not-stored"),
            );
        }
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
        let durable = Durable::open(dir.path()).unwrap();
        let clock = ManualClock::new(SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000));
        let d = Dedup::new(durable, clock.clone(), Duration::from_secs(3600));
        let key = DedupKey::parse(b"k1").unwrap();
        let fp = fingerprint("POST", "/x", b"a");
        let Begin::Forward(t) = d
            .begin("r", &key, fp, Epoch::new(1), InDoubtPolicy::Reject)
            .await
            .unwrap()
        else {
            panic!("expected forward")
        };
        assert!(matches!(
            d.begin("r", &key, fp, Epoch::new(1), InDoubtPolicy::Reject)
                .await,
            Err(ProxyError::DedupInFlight { .. })
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
            .begin("r", &key, fp, Epoch::new(2), InDoubtPolicy::Reject)
            .await
            .unwrap()
        {
            Begin::Replay(s) => assert_eq!((s.status, s.body.as_deref()), (201, Some(&b"ok"[..]))),
            Begin::Forward(_) => panic!("expected replay"),
        }
        assert!(matches!(
            d.begin(
                "r",
                &key,
                fingerprint("POST", "/x", b"b"),
                Epoch::new(2),
                InDoubtPolicy::Reject
            )
            .await,
            Err(ProxyError::DedupKeyReused { .. })
        ));
        // Another route is another scope.
        assert!(matches!(
            d.begin("r2", &key, fp, Epoch::new(1), InDoubtPolicy::Reject)
                .await,
            Ok(Begin::Forward(_))
        ));
        assert_eq!(d.sweep(), 0);
        clock.advance(Duration::from_secs(3601));
        // r2's record is still in flight: never swept from under a live request.
        assert_eq!(d.sweep(), 1);
        assert!(d.get("r", &key).unwrap().is_none());
    }

    /// An `in_flight` or `in_doubt` record past the TTL is still what it was: a
    /// retry is refused (never forwarded a second time), and the sweep keeps it.
    #[tokio::test]
    async fn in_flight_and_in_doubt_records_never_expire_into_absent() {
        let dir = tempfile::tempdir().unwrap();
        let durable = Durable::open(dir.path()).unwrap();
        let clock = ManualClock::new(SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000));
        let d = Dedup::new(durable, clock.clone(), Duration::from_secs(2));
        let fp = fingerprint("POST", "/x", b"a");
        let (flying, doubtful) = (
            DedupKey::parse(b"flying").unwrap(),
            DedupKey::parse(b"doubtful").unwrap(),
        );
        let begin = |k| d.begin("r", k, fp, Epoch::new(1), InDoubtPolicy::Reject);
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
            Err(ProxyError::DedupInFlight { .. })
        ));
        assert!(matches!(
            begin(&doubtful).await,
            Err(ProxyError::DedupInDoubt { .. })
        ));
        assert_eq!(d.sweep(), 0);
    }
}
