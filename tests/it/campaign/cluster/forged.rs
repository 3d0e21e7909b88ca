//! The forged gate object step of the cluster campaign (issue 25, point 5):
//! someone with write access to `{prefix}.gate/` but not the peer token writes
//! gate objects.
//!
//! 1 s into the faults and every 60 s after both shards are served again: the
//! next gate epoch of shards 2 and 4 (never the directed step's nor shard 0),
//! each a cluster object of the cluster's shard count, holder `fg-forger`, a
//! 10 s TTL, `advertise` the campaign's recording listener ([`Forger`]), its MAC
//! missing, zeros, or made with another key (two of the three per step, in
//! turn). The listener answers 503 and records whatever reaches it: every
//! request relayed there (a worker's request with its token, and the peer
//! token, handed to the forger) is reported as a `[forged gate relay]`
//! violation with the checker's. The step notes when a member serves each
//! shard again (`gate_ttl` after the forged object at the earliest, for a
//! correct build).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use super::*;
use fencegate::epoch::EpochRecord;
use fencegate::lease::CreateOutcome;
use fencegate::set_up::{GateKey, SetUp};

/// The forged gate object step: first this long after the faults start, then
/// this long after the shard was served again; the forged object's TTL.
pub(super) const FORGED_FIRST: Duration = Duration::from_secs(1);
pub(super) const FORGED_EVERY: Duration = Duration::from_secs(60);
pub(super) const FORGED_TTL: Duration = Duration::from_secs(10);
/// The rule of the forged-object check (the campaign's own, outside the history).
pub(super) const FORGED_RULE: &str = "forged gate relay";

/// Where the forged gate object step is.
#[derive(Debug, Clone)]
pub(super) enum Forged {
    Idle(Instant),
    /// Forged objects, written at `at`: (shard, gate epoch) of each whose shard
    /// no member has been seen serving again yet.
    Watching {
        pending: Vec<(u32, u64)>,
        at: Instant,
    },
    Over,
}

/// The forger's recording listener: the `advertise` of every forged gate object.
/// Anything that reaches it is a worker's request a member relayed to the forger
/// (with the peer token, in a build that trusts the object): a violation.
pub(super) struct Forger {
    addr: std::net::SocketAddr,
    seen: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
}

impl Forger {
    pub(super) fn start() -> Forger {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (log, done) = (seen.clone(), stop.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((conn, peer)) => {
                        let entry = Forger::record(conn, peer);
                        log.lock().unwrap().push(entry);
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        });
        Forger { addr, seen, stop }
    }

    /// Reads a request head (bounded), answers 503 `shard_unavailable` and says
    /// what came: when, from where, the request line, the campaign's request id
    /// and whether the peer token came with it.
    fn record(mut conn: std::net::TcpStream, peer: std::net::SocketAddr) -> String {
        use std::io::{Read, Write};
        let at = mono_ns();
        let _ = conn.set_nonblocking(false);
        let _ = conn.set_read_timeout(Some(Duration::from_secs(1)));
        let mut head = Vec::new();
        let mut buf = [0u8; 4096];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 65536 {
            match conn.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
        let _ = conn.write_all(b"HTTP/1.1 503 Service Unavailable\r\nx-fencegate-error: shard_unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
        let text = String::from_utf8_lossy(&head);
        let header = |name: &str| {
            text.lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.trim()
                        .eq_ignore_ascii_case(name)
                        .then(|| v.trim().to_owned())
                })
                .unwrap_or_default()
        };
        format!(
            "at mono {at} ns from {peer}: {:?}, x-campaign-req {:?}, x-lease-epoch {:?}, peer token {}",
            text.lines().next().unwrap_or_default(),
            header("x-campaign-req"),
            header("x-lease-epoch"),
            if header("x-fencegate-peer-token").is_empty() {
                "absent"
            } else {
                "PRESENT (leaked to the forger)"
            }
        )
    }

    pub(super) fn seen(&self) -> Vec<String> {
        self.seen.lock().unwrap().clone()
    }
}

impl Drop for Forger {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

impl ClusterNemesis<'_> {
    /// The forged gate object step (module doc), one move per call.
    pub(super) fn forged_step(&mut self) {
        let now = Instant::now();
        match self.forged.clone() {
            Forged::Over => {}
            Forged::Idle(at) => {
                if now >= at {
                    self.forge();
                }
            }
            Forged::Watching { mut pending, at } => {
                if now < self.forged_look || now < at + Duration::from_secs(5) {
                    return;
                }
                self.forged_look = now + Duration::from_millis(200);
                let late = now >= at + Duration::from_secs(25);
                let mut i = 0;
                while i < pending.len() {
                    let (shard, epoch) = pending[i];
                    let detail = match self.shard_owner(shard) {
                        Some(m) => format!(
                            "shard {shard} (forged epoch {epoch}) served by {} again {} ms after the forged object",
                            self.instances[m].id,
                            (now - at).as_millis()
                        ),
                        None if late => format!(
                            "shard {shard}: no member serves it 25 s after the forged object"
                        ),
                        None => {
                            i += 1;
                            continue;
                        }
                    };
                    self.note("forged gate object: the shard served again", detail);
                    pending.remove(i);
                }
                self.forged = if pending.is_empty() {
                    self.forged_done += 1;
                    Forged::Idle(now + FORGED_EVERY)
                } else {
                    Forged::Watching { pending, at }
                };
            }
        }
    }

    /// Writes the next gate epoch of two busy shards (2 and 4: never the
    /// directed step's nor shard 0) as someone with write access to the store
    /// but not the peer token would: a cluster object naming a holder that is no
    /// member and the forger's listener as `advertise`, its MAC missing, zeros,
    /// or made with another key (two of the three per step, in turn).
    fn forge(&mut self) {
        let advertise = format!("http://{}", self.forger.addr);
        let mut pending = Vec::new();
        for (k, shard) in [2u32, 4].into_iter().enumerate() {
            let variant = (2 * self.forged_done + k) % 3;
            let name = LeaseName::parse(&format!("{shard:04}")).unwrap();
            let gates = &self.gates;
            let written = tokio::runtime::Handle::current().block_on(async {
                for _ in 0..5 {
                    let latest = gates.latest_after(&name, Epoch::NONE).await.ok()?;
                    let next = latest.next()?;
                    let mut rec =
                        EpochRecord::acquire(&name, next, "fg-forger", b"forged token", FORGED_TTL);
                    SetUp::Cluster { shards: SHARDS }.stamp(&mut rec);
                    rec.advertise = Some(advertise.clone());
                    match variant {
                        0 => rec.mac = None,
                        1 => rec.mac = Some("00".repeat(32)),
                        _ => GateKey::from_peer_token(
                            "not-the-peer-token",
                            &format!("{PREFIX}.gate/"),
                        )
                        .seal(&mut rec),
                    }
                    match gates.create(&name, next, rec.to_json().into()).await {
                        Ok(CreateOutcome::Created) => return Some(next.get()),
                        // A renewal got there first: the next one.
                        Ok(CreateOutcome::AlreadyExists) | Err(_) => {}
                    }
                }
                None
            });
            let how = ["no MAC", "a MAC of zeros", "a MAC made with another key"][variant];
            match written {
                Some(epoch) => {
                    self.note(
                        "forged gate object written",
                        format!("shard {shard} epoch {epoch}: holder fg-forger, advertise {advertise}, {how}, ttl {} s", FORGED_TTL.as_secs()),
                    );
                    pending.push((shard, epoch));
                }
                None => self.note("forged gate object not written", format!("shard {shard}")),
            }
        }
        self.forged = if pending.is_empty() {
            Forged::Idle(Instant::now() + Duration::from_secs(3))
        } else {
            Forged::Watching {
                pending,
                at: Instant::now(),
            }
        };
    }
}
