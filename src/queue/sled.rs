//! The queue's records on sled (SPEC §11), beside the marks and dedup records
//! of [`SledState`] and made durable by its group commit: a single instance.
//!
//! Trees: `queue` (route \0 key → the message's [`Message`], JSON),
//! `queue_requests` (route \0 key → the request as it will be sent; written
//! once), `queue_order` (lease \0 seq → route \0 key, only for messages not
//! settled: a lease's head is its first entry), `queue_seq` (lease → the next
//! sequence number) and `queue_sent` (lease → the newest epoch of which a
//! message was sent). An acceptance writes the first four in one sled
//! transaction (all or nothing after a crash), under one lock that also orders
//! the sequence numbers.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use sled::transaction::{ConflictableTransactionError, TransactionError};
use sled::Transactional;

use super::message::{Accepted, Envelope, Held, Listing, Message, QueueBound, Requeued, Status};
use crate::state::sled::SledState;
use crate::state::StateError;

fn db_err(e: sled::Error) -> StateError {
    StateError::Write(e.to_string())
}

fn id(route: &str, key: &str) -> Vec<u8> {
    let mut v = Vec::with_capacity(route.len() + 1 + key.len());
    v.extend_from_slice(route.as_bytes());
    v.push(0);
    v.extend_from_slice(key.as_bytes());
    v
}

fn order_key(lease: &str, seq: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(lease.len() + 9);
    v.extend_from_slice(lease.as_bytes());
    v.push(0);
    v.extend_from_slice(&seq.to_be_bytes());
    v
}

fn lease_prefix(lease: &str) -> Vec<u8> {
    let mut v = lease.as_bytes().to_vec();
    v.push(0);
    v
}

fn u64_of(v: Option<sled::IVec>) -> u64 {
    v.and_then(|v| <[u8; 8]>::try_from(&v[..]).ok())
        .map(u64::from_be_bytes)
        .unwrap_or(0)
}

fn decode(raw: &[u8]) -> Result<Message, StateError> {
    serde_json::from_slice(raw).map_err(|e| StateError::Write(format!("a queued message: {e}")))
}

fn encode(m: &Message) -> Vec<u8> {
    serde_json::to_vec(m).unwrap_or_default()
}

/// The queue's trees in sled.
pub struct SledQueue {
    sled: Arc<SledState>,
    msgs: sled::Tree,
    requests: sled::Tree,
    order: sled::Tree,
    seqs: sled::Tree,
    sent: sled::Tree,
    /// Per lease, the restore its queue was last fenced for.
    restore_fences: sled::Tree,
    /// Pauses in force: `kind \0 name` → since (ms, big-endian).
    pauses: sled::Tree,
    /// Bulk jobs: id → the job as JSON; and the lock a job's progress is
    /// read, changed and written under.
    jobs: sled::Tree,
    jobs_lock: Mutex<()>,
    /// Orders acceptances: a sequence number is taken, and the pass checked,
    /// under it (a leaf lock; nothing is awaited under it).
    accepting: Mutex<()>,
    /// Messages not settled per (route, lease): what `queue_order` holds,
    /// counted at open and kept with each change to it, so that a scrape
    /// reads a lease's head per pair instead of walking the index. A leaf
    /// lock.
    waiting: Mutex<HashMap<(String, String), u64>>,
    /// Requests kept per route — messages and body bytes: what a message not
    /// delivered nor dropped holds (sled keeps written values in memory, so
    /// this is memory too). Counted at open and kept with each change to the
    /// `queue_requests` tree, for the queue's bound (SPEC §11). A leaf lock.
    held: Mutex<HashMap<String, Held>>,
}

impl SledQueue {
    /// Opens the queue's trees in `sled`'s database.
    pub fn open(sled: Arc<SledState>) -> Result<SledQueue, StateError> {
        let db = sled.db();
        let order = db.open_tree("queue_order").map_err(db_err)?;
        let mut waiting: HashMap<(String, String), u64> = HashMap::new();
        for item in order.iter() {
            let (k, mid) = item.map_err(db_err)?;
            let lease = k.get(..k.len().saturating_sub(9)).unwrap_or_default();
            let route = mid.split(|b| *b == 0).next().unwrap_or_default();
            *waiting
                .entry((
                    String::from_utf8_lossy(route).into_owned(),
                    String::from_utf8_lossy(lease).into_owned(),
                ))
                .or_default() += 1;
        }
        let requests = db.open_tree("queue_requests").map_err(db_err)?;
        let mut held: HashMap<String, Held> = HashMap::new();
        for item in requests.iter() {
            let (k, v) = item.map_err(db_err)?;
            let route = k.split(|b| *b == 0).next().unwrap_or_default();
            let h = held
                .entry(String::from_utf8_lossy(route).into_owned())
                .or_default();
            h.messages += 1;
            h.bytes += v.len() as u64;
        }
        Ok(SledQueue {
            msgs: db.open_tree("queue").map_err(db_err)?,
            requests,
            order,
            seqs: db.open_tree("queue_seq").map_err(db_err)?,
            sent: db.open_tree("queue_sent").map_err(db_err)?,
            restore_fences: db.open_tree("queue_restore_fenced").map_err(db_err)?,
            pauses: db.open_tree("queue_paused").map_err(db_err)?,
            jobs: db.open_tree("queue_jobs").map_err(db_err)?,
            jobs_lock: Mutex::new(()),
            sled,
            accepting: Mutex::new(()),
            waiting: Mutex::new(waiting),
            held: Mutex::new(held),
        })
    }

    /// A request of `route` stored (`Some(len)` up) or removed (down).
    fn hold(&self, route: &str, bytes: usize, up: bool) {
        let mut h = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let e = h.entry(route.to_owned()).or_default();
        if up {
            e.messages += 1;
            e.bytes += bytes as u64;
        } else {
            e.messages = e.messages.saturating_sub(1);
            e.bytes = e.bytes.saturating_sub(bytes as u64);
        }
    }

    /// Requests kept: `route`'s, and all routes'.
    pub fn held(&self, route: &str) -> (Held, Held) {
        let h = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let total = h.values().fold(Held::default(), |a, b| Held {
            messages: a.messages + b.messages,
            bytes: a.bytes + b.bytes,
        });
        (h.get(route).copied().unwrap_or_default(), total)
    }

    /// Every route's requests kept (metrics).
    pub fn held_by_route(&self) -> Vec<(String, Held)> {
        let h = self.held.lock().unwrap_or_else(|p| p.into_inner());
        h.iter().map(|(r, v)| (r.clone(), *v)).collect()
    }

    /// Counts one message more (`up`) or less waiting in `m`'s pair.
    fn count(&self, m: &Message, up: bool) {
        let mut w = self.waiting.lock().unwrap_or_else(|p| p.into_inner());
        let n = w.entry((m.route.clone(), m.lease.clone())).or_default();
        *n = if up { *n + 1 } else { n.saturating_sub(1) };
        if *n == 0 {
            w.remove(&(m.route.clone(), m.lease.clone()));
        }
    }

    /// Accepts `msg` (its `seq` is assigned here) with its request, unless its
    /// key has a message already; `admitted` is asked under the lock that
    /// orders acceptances, right before the sequence number is taken (SPEC §11:
    /// a pass aborted by a newer epoch's drain takes no place after it).
    /// Durable on return.
    pub async fn accept(
        &self,
        mut msg: Message,
        envelope: &Envelope,
        bound: &QueueBound,
        admitted: impl Fn() -> bool,
    ) -> Result<Accepted, StateError> {
        let mid = id(&msg.route, &msg.key);
        let request = envelope.encode();
        {
            let _order = self.accepting.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(old) = self.msgs.get(&mid).map_err(db_err)? {
                return Ok(Accepted::Exists(decode(&old)?));
            }
            // Under the lock that orders acceptances: two at once cannot both
            // take the last room.
            let (of_route, total) = self.held(&msg.route);
            if let Some((bound, limit)) = bound.refuses(of_route, total, request.len() as u64) {
                return Ok(Accepted::Full { bound, limit });
            }
            if !admitted() {
                return Ok(Accepted::Aborted);
            }
            msg.seq = u64_of(self.seqs.get(msg.lease.as_bytes()).map_err(db_err)?);
            let meta = encode(&msg);
            let okey = order_key(&msg.lease, msg.seq);
            (&self.msgs, &self.requests, &self.order, &self.seqs)
                .transaction(|(msgs, reqs, order, seqs)| {
                    msgs.insert(mid.as_slice(), meta.as_slice())?;
                    reqs.insert(mid.as_slice(), request.as_slice())?;
                    order.insert(okey.as_slice(), mid.as_slice())?;
                    seqs.insert(msg.lease.as_bytes(), &(msg.seq + 1).to_be_bytes()[..])?;
                    Ok::<_, ConflictableTransactionError<()>>(())
                })
                .map_err(tx_err)?;
            self.count(&msg, true);
            self.hold(&msg.route, request.len(), true);
        }
        crate::failpoint::hit("queue_accept_written");
        self.sled.commit().await?;
        Ok(Accepted::New(msg))
    }

    /// The message of `route`, `key`, if there is one.
    pub fn get(&self, route: &str, key: &str) -> Result<Option<Message>, StateError> {
        self.msgs
            .get(id(route, key))
            .map_err(db_err)?
            .map(|v| decode(&v))
            .transpose()
    }

    /// The request of `route`, `key`.
    pub fn envelope(&self, route: &str, key: &str) -> Result<Option<Envelope>, StateError> {
        match self.requests.get(id(route, key)).map_err(db_err)? {
            None => Ok(None),
            Some(v) => Envelope::decode(&v)
                .map(Some)
                .ok_or_else(|| StateError::Write("a queued request is unreadable".into())),
        }
    }

    /// The first message of `lease` not settled, if any.
    pub fn head(&self, lease: &str) -> Result<Option<Message>, StateError> {
        let Some(entry) = self.order.scan_prefix(lease_prefix(lease)).next() else {
            return Ok(None);
        };
        let (_, mid) = entry.map_err(db_err)?;
        match self.msgs.get(&mid).map_err(db_err)? {
            Some(v) => decode(&v).map(Some),
            None => Err(StateError::Write(format!(
                "lease {lease}'s queue names a message that is gone"
            ))),
        }
    }

    /// Leases with messages not settled (start-up).
    pub fn leases_with_work(&self) -> Result<Vec<String>, StateError> {
        let mut out: Vec<String> = Vec::new();
        for item in self.order.iter() {
            let (k, _) = item.map_err(db_err)?;
            let Some(at) = k.iter().position(|b| *b == 0) else {
                continue;
            };
            let lease = String::from_utf8_lossy(&k[..at]).into_owned();
            if out.last() != Some(&lease) {
                out.push(lease);
            }
        }
        Ok(out)
    }

    /// Up to `max` messages at the front of `lease`'s queue that have the
    /// epoch of its head (in place order): what `ordering = "none"` may send
    /// at once.
    pub fn front(&self, lease: &str, max: usize) -> Result<Vec<Message>, StateError> {
        let mut out: Vec<Message> = Vec::new();
        for item in self.order.scan_prefix(lease_prefix(lease)) {
            let (_, mid) = item.map_err(db_err)?;
            let Some(v) = self.msgs.get(&mid).map_err(db_err)? else {
                break;
            };
            let m = decode(&v)?;
            if out.first().is_some_and(|h| h.epoch != m.epoch) || out.len() >= max {
                break;
            }
            out.push(m);
        }
        Ok(out)
    }

    /// (route, lease) of every message that may still be sent: pending or
    /// delivering, or failed (an operator may retry it). A direct route on
    /// such a lease could overtake it, and a route moved to another lease
    /// would answer that lease's workers from it (SPEC §11). One pass over
    /// the messages: start-up and reload only.
    pub fn holding(&self) -> Result<std::collections::BTreeSet<(String, String)>, StateError> {
        let mut out = std::collections::BTreeSet::new();
        for item in self.msgs.iter() {
            let (_, v) = item.map_err(db_err)?;
            let m = decode(&v)?;
            if matches!(
                m.status,
                Status::Pending | Status::Delivering | Status::Failed
            ) {
                out.insert((m.route, m.lease));
            }
        }
        Ok(out)
    }

    /// [`super::store::QueueStore::other_kind`]: a prefix probe per route.
    pub fn other_kind(
        &self,
        routes: &[(&str, bool)],
    ) -> Result<Option<(String, bool)>, StateError> {
        for &(name, queued) in routes {
            let mut prefix = name.as_bytes().to_vec();
            prefix.push(0);
            let kept = if queued {
                self.sled.holds_records_of(name)?
            } else {
                self.msgs
                    .scan_prefix(&prefix)
                    .next()
                    .transpose()
                    .map_err(db_err)?
                    .is_some()
            };
            if kept {
                return Ok(Some((name.to_owned(), queued)));
            }
        }
        Ok(None)
    }

    /// Per route, how many messages are not settled and when the oldest
    /// lease head among them was accepted (metrics): the counts kept with
    /// the order index, and one read of each lease's head.
    pub fn depth(&self) -> Result<HashMap<String, (u64, u64)>, StateError> {
        let pairs: Vec<((String, String), u64)> = self
            .waiting
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(k, n)| (k.clone(), *n))
            .collect();
        let mut heads: HashMap<String, u64> = HashMap::new();
        let mut out: HashMap<String, (u64, u64)> = HashMap::new();
        for ((route, lease), n) in pairs {
            let head = match heads.get(&lease) {
                Some(h) => *h,
                None => {
                    let h = self.head(&lease)?.map_or(u64::MAX, |m| m.accepted_ms);
                    heads.insert(lease, h);
                    h
                }
            };
            let r = out.entry(route).or_insert((0, u64::MAX));
            r.0 += n;
            r.1 = r.1.min(head);
        }
        Ok(out)
    }

    /// The epoch of the last message waiting in `lease`'s queue (0: none) —
    /// the newest waiting, as places follow epoch order (an operator's retry
    /// takes a place only when no newer epoch is sent or waiting).
    pub fn newest_waiting(&self, lease: &str) -> Result<u64, StateError> {
        let Some(entry) = self.order.scan_prefix(lease_prefix(lease)).next_back() else {
            return Ok(0);
        };
        let (_, mid) = entry.map_err(db_err)?;
        Ok(match self.msgs.get(&mid).map_err(db_err)? {
            Some(v) => decode(&v)?.epoch,
            None => 0,
        })
    }

    /// Writes a message's attempt as started (`delivering`), with its epoch as
    /// the newest of its lease that may have been sent: from here on an
    /// operator's retry of an older message is superseded, whatever becomes of
    /// this one (a drop, a final failure). Durable on return.
    pub async fn start_attempt(&self, msg: &Message) -> Result<(), StateError> {
        self.start_attempt_unflushed(msg)?;
        self.sled.commit().await
    }

    /// [`SledQueue::start_attempt`] without waiting for the disk.
    pub fn start_attempt_unflushed(&self, msg: &Message) -> Result<(), StateError> {
        let mid = id(&msg.route, &msg.key);
        let meta = encode(msg);
        let newest = u64_of(self.sent.get(msg.lease.as_bytes()).map_err(db_err)?);
        (&self.msgs, &self.sent)
            .transaction(|(msgs, sent)| {
                msgs.insert(mid.as_slice(), meta.as_slice())?;
                if msg.epoch > newest {
                    sent.insert(msg.lease.as_bytes(), &msg.epoch.to_be_bytes()[..])?;
                }
                Ok::<_, ConflictableTransactionError<()>>(())
            })
            .map_err(tx_err)
    }

    /// Waits until every write made so far is durable: what is answered from
    /// a message read now is then on disk (another request's acceptance may
    /// have written it and not yet committed).
    pub async fn durable(&self) -> Result<(), StateError> {
        self.sled.commit().await
    }

    /// Writes a message that stays in its queue (a retry scheduled). Durable
    /// on return.
    pub async fn put(&self, msg: &Message) -> Result<(), StateError> {
        self.msgs
            .insert(id(&msg.route, &msg.key), encode(msg))
            .map_err(db_err)?;
        self.sled.commit().await
    }

    /// Writes a settled message and takes it out of its queue (the next one
    /// may go). Durable on return. (Its epoch was made the newest sent when
    /// an attempt of it started: [`SledQueue::start_attempt`].)
    pub async fn settle(&self, msg: &Message) -> Result<(), StateError> {
        self.settle_unflushed(msg)?;
        self.sled.commit().await
    }

    /// [`SledQueue::settle`] without waiting for the disk: durable with the
    /// next commit (the next attempt's start, or [`SledQueue::durable`]).
    pub fn settle_unflushed(&self, msg: &Message) -> Result<(), StateError> {
        let mid = id(&msg.route, &msg.key);
        let meta = encode(msg);
        let okey = order_key(&msg.lease, msg.seq);
        // A delivered or dropped message is never sent again (only a failed
        // one may be retried): its request, the body's bytes, goes with it.
        let done = matches!(msg.status, Status::Delivered | Status::Dropped);
        let removed = (&self.msgs, &self.order, &self.requests)
            .transaction(|(msgs, order, reqs)| {
                msgs.insert(mid.as_slice(), meta.as_slice())?;
                let request = if done {
                    reqs.remove(mid.as_slice())?.map(|v| v.len())
                } else {
                    None
                };
                let removed = order.remove(okey.as_slice())?.is_some();
                Ok::<_, ConflictableTransactionError<()>>((removed, request))
            })
            .map_err(tx_err)?;
        let (removed, request) = removed;
        if removed {
            self.count(msg, false);
        }
        if let Some(len) = request {
            self.hold(&msg.route, len, false);
        }
        Ok(())
    }

    /// Puts a failed message back at the end of its lease's queue, pending
    /// now, with a new place — checked and written under the lock that orders
    /// acceptances, so that no newer epoch's message is placed or sent between
    /// the check and the write. Durable on return.
    pub async fn requeue(
        &self,
        route: &str,
        key: &str,
        now_ms: u64,
    ) -> Result<Requeued, StateError> {
        let mid = id(route, key);
        let msg = {
            let _order = self.accepting.lock().unwrap_or_else(|p| p.into_inner());
            let Some(raw) = self.msgs.get(&mid).map_err(db_err)? else {
                return Ok(Requeued::Gone);
            };
            let mut msg = decode(&raw)?;
            if msg.status != Status::Failed {
                return Ok(Requeued::NotFailed(msg.status));
            }
            let newest = self
                .sent_epoch(&msg.lease)?
                .max(self.newest_waiting(&msg.lease)?);
            if newest > msg.epoch {
                return Ok(Requeued::Superseded(newest));
            }
            msg.seq = u64_of(self.seqs.get(msg.lease.as_bytes()).map_err(db_err)?);
            msg.status = Status::Pending;
            msg.next_attempt_ms = now_ms;
            msg.updated_ms = now_ms;
            msg.last_error = None;
            let meta = encode(&msg);
            let okey = order_key(&msg.lease, msg.seq);
            let written =
                (&self.msgs, &self.order, &self.seqs).transaction(|(msgs, order, seqs)| {
                    // Unchanged since read (the sweeper takes what it removes
                    // in a transaction too).
                    if msgs.get(mid.as_slice())?.as_deref() != Some(&raw[..]) {
                        return Err(ConflictableTransactionError::Abort(()));
                    }
                    msgs.insert(mid.as_slice(), meta.as_slice())?;
                    order.insert(okey.as_slice(), mid.as_slice())?;
                    seqs.insert(msg.lease.as_bytes(), &(msg.seq + 1).to_be_bytes()[..])?;
                    Ok::<_, ConflictableTransactionError<()>>(())
                });
            match written {
                Ok(()) => self.count(&msg, true),
                Err(TransactionError::Abort(())) => return Ok(Requeued::Gone),
                Err(TransactionError::Storage(e)) => return Err(db_err(e)),
            }
            msg
        };
        self.sled.commit().await?;
        Ok(Requeued::Done(Box::new(msg)))
    }

    /// [`super::store::QueueStore::restore_fenced`].
    pub fn restore_fenced(&self, lease: &str) -> Result<u64, StateError> {
        Ok(u64_of(
            self.restore_fences.get(lease.as_bytes()).map_err(db_err)?,
        ))
    }

    /// [`super::store::QueueStore::mark_restore_fenced`].
    pub async fn mark_restore_fenced(&self, lease: &str, r: u64) -> Result<(), StateError> {
        self.restore_fences
            .insert(lease.as_bytes(), &r.to_be_bytes()[..])
            .map_err(db_err)?;
        self.sled.commit().await
    }

    /// [`super::store::QueueStore::put_job`].
    pub async fn put_job(&self, job: &super::job::Job) -> Result<(), StateError> {
        let json = serde_json::to_vec(job).map_err(|e| StateError::Write(e.to_string()))?;
        self.jobs.insert(job.id.as_bytes(), json).map_err(db_err)?;
        self.sled.commit().await
    }

    /// [`super::store::QueueStore::jobs`].
    pub fn jobs(&self) -> Result<Vec<super::job::Job>, StateError> {
        let mut out = Vec::new();
        for item in self.jobs.iter() {
            let (_, v) = item.map_err(db_err)?;
            if let Ok(j) = serde_json::from_slice::<super::job::Job>(&v) {
                out.push(j);
            }
        }
        super::job::newest_first(&mut out);
        Ok(out)
    }

    /// [`super::store::QueueStore::job_progress`].
    pub async fn job_progress(
        &self,
        id: &str,
        delta: &super::job::JobDelta,
    ) -> Result<Option<super::job::Job>, StateError> {
        let job = {
            let _one = self.jobs_lock.lock().unwrap_or_else(|p| p.into_inner());
            let Some(raw) = self.jobs.get(id.as_bytes()).map_err(db_err)? else {
                return Ok(None);
            };
            let mut job: super::job::Job = serde_json::from_slice(&raw)
                .map_err(|e| StateError::Write(format!("a bulk job cannot be read: {e}")))?;
            job.apply(delta);
            let json = serde_json::to_vec(&job).map_err(|e| StateError::Write(e.to_string()))?;
            self.jobs.insert(id.as_bytes(), json).map_err(db_err)?;
            job
        };
        self.sled.commit().await?;
        Ok(Some(job))
    }

    /// [`super::store::QueueStore::paused`].
    pub fn paused(&self) -> Result<super::pause::Paused, StateError> {
        let mut out = super::pause::Paused::default();
        for item in self.pauses.iter() {
            let (k, v) = item.map_err(db_err)?;
            let mut parts = k.splitn(2, |b| *b == 0);
            let kind = String::from_utf8_lossy(parts.next().unwrap_or_default());
            let name = String::from_utf8_lossy(parts.next().unwrap_or_default());
            if let Some(p) = super::pause::Pausable::of(&kind, &name) {
                out.0.insert(p, u64_of(Some(v)));
            }
        }
        Ok(out)
    }

    /// [`super::store::QueueStore::set_paused`].
    pub async fn set_paused(
        &self,
        what: &super::pause::Pausable,
        since_ms: Option<u64>,
    ) -> Result<(), StateError> {
        let mut key = what.kind().as_bytes().to_vec();
        key.push(0);
        key.extend_from_slice(what.name().as_bytes());
        match since_ms {
            Some(ms) => {
                // Kept if already paused: the pause began when it first did.
                self.pauses
                    .compare_and_swap(&key, None as Option<&[u8]>, Some(&ms.to_be_bytes()[..]))
                    .map_err(db_err)?
                    .ok();
            }
            None => {
                self.pauses.remove(&key).map_err(db_err)?;
            }
        }
        self.sled.commit().await
    }

    /// [`super::store::QueueStore::raise_sent`].
    pub async fn raise_sent(&self, lease: &str, epoch: u64) -> Result<(), StateError> {
        self.sent
            .fetch_and_update(lease.as_bytes(), |old| {
                let old = old
                    .and_then(|v| <[u8; 8]>::try_from(v).ok())
                    .map_or(0, u64::from_be_bytes);
                Some(old.max(epoch).to_be_bytes().to_vec())
            })
            .map_err(db_err)?;
        self.sled.commit().await
    }

    /// The newest epoch of `lease` of which a message was sent (0: none).
    pub fn sent_epoch(&self, lease: &str) -> Result<u64, StateError> {
        Ok(u64_of(self.sent.get(lease.as_bytes()).map_err(db_err)?))
    }

    /// Up to `limit` messages matching, in key order (route, then key).
    /// [`super::store::QueueStore::list`]: the tree's order is by route then
    /// key (as bytes, `id`), the listing's.
    pub fn list(&self, l: &Listing) -> Result<(Vec<Message>, u64), StateError> {
        let iter = match &l.route {
            Some(r) => self.msgs.scan_prefix(id(r, "")),
            None => self.msgs.iter(),
        };
        let mut out = Vec::new();
        let mut total = 0;
        for item in iter {
            let (_, v) = item.map_err(db_err)?;
            let m = decode(&v)?;
            if !l.matches(&m) {
                continue;
            }
            total += 1;
            if out.len() < l.limit && l.after_start(&m) {
                out.push(m);
            }
        }
        Ok((out, total))
    }

    /// Removes settled messages last changed before `before_ms`; how many.
    pub async fn sweep(&self, before_ms: u64) -> Result<usize, StateError> {
        let mut gone = 0;
        for item in self.msgs.iter() {
            let (k, v) = item.map_err(db_err)?;
            let m = decode(&v)?;
            if m.status.is_settled() && m.updated_ms < before_ms {
                // Message and request together, and only if unchanged since
                // read (an operator's retry wins).
                let removed = (&self.msgs, &self.requests)
                    .transaction(|(msgs, reqs)| {
                        if msgs.get(&k)?.as_deref() != Some(&v[..]) {
                            return Ok(None);
                        }
                        msgs.remove(&k)?;
                        let request = reqs.remove(&k)?.map(|r| r.len());
                        Ok::<_, ConflictableTransactionError<()>>(Some(request))
                    })
                    .map_err(tx_err)?;
                if let Some(request) = removed {
                    gone += 1;
                    if let Some(len) = request {
                        self.hold(&m.route, len, false);
                    }
                }
            }
        }
        // Finished bulk jobs are kept as long as settled messages.
        let mut jobs_gone = 0;
        {
            let _one = self.jobs_lock.lock().unwrap_or_else(|p| p.into_inner());
            for item in self.jobs.iter() {
                let (k, v) = item.map_err(db_err)?;
                let done = serde_json::from_slice::<super::job::Job>(&v)
                    .is_ok_and(|j| j.finished && j.updated_ms < before_ms);
                if done {
                    self.jobs.remove(&k).map_err(db_err)?;
                    jobs_gone += 1;
                }
            }
        }
        if gone > 0 || jobs_gone > 0 {
            self.sled.commit().await?;
        }
        Ok(gone)
    }
}

fn tx_err(e: TransactionError<()>) -> StateError {
    match e {
        TransactionError::Storage(e) => db_err(e),
        TransactionError::Abort(()) => StateError::Write("a queue transaction aborted".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn msg(key: &str, epoch: u64, status: Status) -> Message {
        Message {
            route: "hook".into(),
            key: key.into(),
            lease: "hook".into(),
            epoch,
            seq: 0,
            fingerprint: String::new(),
            method: "POST".into(),
            path: "/hook/x".into(),
            token_sha256: None,
            status,
            attempts: 0,
            unknown_outcomes: 0,
            accepted_ms: 1,
            updated_ms: 1,
            next_attempt_ms: 1,
            last_status: None,
            last_error: None,
            answer: None,
        }
    }

    fn envelope() -> Envelope {
        Envelope {
            method: "POST".into(),
            rest: "x".into(),
            query: None,
            headers: vec![],
            body: Bytes::from_static(b"b"),
        }
    }

    async fn store() -> (tempfile::TempDir, SledQueue) {
        let dir = tempfile::tempdir().unwrap();
        let sled = SledState::open(&dir.path().join("state")).unwrap();
        (dir, SledQueue::open(sled).unwrap())
    }

    async fn failed(q: &SledQueue, key: &str, epoch: u64) -> Message {
        let Accepted::New(mut m) = q
            .accept(
                msg(key, epoch, Status::Pending),
                &envelope(),
                &QueueBound::NONE,
                || true,
            )
            .await
            .unwrap()
        else {
            panic!("accepted")
        };
        m.status = Status::Failed;
        q.settle(&m).await.unwrap();
        m
    }

    /// What a message keeps is counted from acceptance until it is delivered
    /// or dropped (a failed one keeps its request for a retry), across a
    /// reopen; the bound refuses past it, and a retry of a message already
    /// accepted is answered from its record even then.
    #[tokio::test]
    async fn requests_kept_are_counted_and_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let sled = SledState::open(&dir.path().join("state")).unwrap();
        let q = SledQueue::open(sled.clone()).unwrap();
        let one = envelope().encode().len() as u64;
        let bound = QueueBound {
            route_messages: Some(2),
            ..QueueBound::NONE
        };
        let mut kept = Vec::new();
        for key in ["m1", "m2"] {
            let Accepted::New(m) = q
                .accept(msg(key, 1, Status::Pending), &envelope(), &bound, || true)
                .await
                .unwrap()
            else {
                panic!("accepted")
            };
            kept.push(m);
        }
        assert_eq!(
            q.held("hook").0,
            Held {
                messages: 2,
                bytes: 2 * one
            }
        );
        let full = q
            .accept(msg("m3", 1, Status::Pending), &envelope(), &bound, || true)
            .await
            .unwrap();
        assert!(matches!(
            full,
            Accepted::Full {
                bound: "route_messages",
                limit: 2
            }
        ));
        assert!(q.get("hook", "m3").unwrap().is_none(), "nothing written");
        let again = q
            .accept(msg("m1", 1, Status::Pending), &envelope(), &bound, || true)
            .await
            .unwrap();
        assert!(matches!(again, Accepted::Exists(_)), "a retry is answered");
        kept[0].status = Status::Delivered;
        q.settle(&kept[0]).await.unwrap();
        kept[1].status = Status::Failed;
        q.settle(&kept[1]).await.unwrap();
        assert!(
            q.envelope("hook", "m1").unwrap().is_none(),
            "delivered: gone"
        );
        assert!(q.envelope("hook", "m2").unwrap().is_some(), "failed: kept");
        assert_eq!(
            q.held("hook").0,
            Held {
                messages: 1,
                bytes: one
            }
        );
        drop(q);
        let q = SledQueue::open(sled).unwrap();
        assert_eq!(
            q.held("hook"),
            (
                Held {
                    messages: 1,
                    bytes: one
                },
                Held {
                    messages: 1,
                    bytes: one
                }
            )
        );
    }

    /// The superseded check of an operator's retry is made where the place is
    /// taken: a newer epoch's message accepted (not yet sent) before the
    /// requeue supersedes it, as one attempted and then dropped does.
    #[tokio::test]
    async fn a_requeue_is_superseded_by_a_newer_message_waiting_or_attempted() {
        let (_d, q) = store().await;
        failed(&q, "m1", 1).await;
        let Accepted::New(m2) = q
            .accept(
                msg("m2", 2, Status::Pending),
                &envelope(),
                &QueueBound::NONE,
                || true,
            )
            .await
            .unwrap()
        else {
            panic!("accepted")
        };
        assert!(matches!(
            q.requeue("hook", "m1", 5).await.unwrap(),
            Requeued::Superseded(2)
        ));
        // m2 attempted, then dropped: still superseded.
        let mut m2 = Message {
            status: Status::Delivering,
            ..m2
        };
        q.start_attempt(&m2).await.unwrap();
        m2.status = Status::Dropped;
        q.settle(&m2).await.unwrap();
        assert_eq!(q.newest_waiting("hook").unwrap(), 0);
        assert!(matches!(
            q.requeue("hook", "m1", 5).await.unwrap(),
            Requeued::Superseded(2)
        ));
        // Nothing newer: requeued at the end, pending, with a new place.
        let (_d2, q2) = store().await;
        let first = failed(&q2, "m1", 1).await;
        let Requeued::Done(again) = q2.requeue("hook", "m1", 5).await.unwrap() else {
            panic!("requeued")
        };
        assert_eq!(again.status, Status::Pending);
        assert!(again.seq > first.seq);
        assert_eq!(q2.head("hook").unwrap().map(|m| m.key), Some("m1".into()));
    }

    /// The oldest-pending figure of a route whose messages wait behind
    /// another route's head (one lease, two routes) is that head's age, not
    /// nothing.
    #[tokio::test]
    async fn a_route_behind_another_routes_head_reports_that_heads_age() {
        let (_d, q) = store().await;
        let at = |route: &str, key: &str, accepted_ms| Message {
            route: route.into(),
            accepted_ms,
            ..msg(key, 1, Status::Pending)
        };
        for m in [at("a", "k1", 5), at("b", "k2", 9)] {
            q.accept(m, &envelope(), &QueueBound::NONE, || true)
                .await
                .unwrap();
        }
        let depth = q.depth().unwrap();
        assert_eq!(depth["a"], (1, 5));
        assert_eq!(depth["b"], (1, 5));
    }

    /// The depth kept with the order index: a message settled twice (a
    /// failed one dropped) counts out once, a requeue counts in again, and a
    /// reopened store counts what its index holds.
    #[tokio::test]
    async fn the_depth_follows_the_order_index_and_survives_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state");
        {
            let state = SledState::open(&path).unwrap();
            let q = SledQueue::open(state.clone()).unwrap();
            let mut m1 = failed(&q, "m1", 1).await;
            assert!(q.depth().unwrap().is_empty());
            m1.status = Status::Dropped;
            q.settle(&m1).await.unwrap();
            assert!(
                q.depth().unwrap().is_empty(),
                "settled twice, counted out once"
            );
            q.accept(
                msg("m2", 1, Status::Pending),
                &envelope(),
                &QueueBound::NONE,
                || true,
            )
            .await
            .unwrap();
            failed(&q, "m3", 1).await;
            assert!(matches!(
                q.requeue("hook", "m3", 5).await.unwrap(),
                Requeued::Done(_)
            ));
            assert_eq!(q.depth().unwrap()["hook"], (2, 1));
            crate::state::StateStore::close(state.as_ref())
                .await
                .unwrap();
        }
        let state = crate::state::sled::tests::open_when_free(&path)
            .await
            .unwrap();
        let q = SledQueue::open(state).unwrap();
        assert_eq!(q.depth().unwrap()["hook"], (2, 1));
    }

    /// A message the sweeper removed is not brought back by a retry without
    /// its request (the lease's queue would stall on it).
    #[tokio::test]
    async fn a_swept_message_is_not_requeued() {
        let (_d, q) = store().await;
        failed(&q, "m1", 1).await;
        assert_eq!(q.sweep(u64::MAX).await.unwrap(), 1);
        assert!(q.envelope("hook", "m1").unwrap().is_none());
        assert!(matches!(
            q.requeue("hook", "m1", 5).await.unwrap(),
            Requeued::Gone
        ));
        assert!(q.head("hook").unwrap().is_none());
    }
}
