//! SPEC §10.2, a cluster: several fencegate processes on one S3 lease store (the
//! moto test server) and one PostgreSQL database, each serving the shards whose
//! gate leases it holds and relaying the others' requests to their owners.
//!
//! Short gate leases (6 s, renewed every 2 s, self-fence margin 2 s, grace
//! 500 ms) keep takeovers within seconds while leaving a loaded two-core machine
//! a renewal's worth of slack.
//!
//! Attacks and faults on members started one by one (`support::members`): gate
//! objects someone else wrote ([`gate_objects`]), the anchor beside a single
//! instance ([`anchor`]), when an ownership row is free ([`owner_rows`]), and
//! how a tenure ends ([`tenure`]).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use crate::support::postgres::{KeyHold, PgServer};
use crate::support::*;
use bytes::Bytes;
use fencegate::cluster::shard_of;
use fencegate::epoch::{Epoch, LeaseName};
use fencegate::lease::acquire::Holding;
use fencegate::lease::Epochs;
use http_body_util::Full;

macro_rules! skip_without_postgres {
    () => {
        if !$crate::support::postgres::available_or_skip() {
            return;
        }
    };
}

mod anchor;
mod gate_objects;
mod owner_rows;
mod tenure;

const PEER_TOKEN: &str = "test-peer-token-0123456789";

/// One lease per shard (the first names `l0`, `l1`, … that fall into each shard).
fn leases_per_shard(shards: u32) -> Vec<String> {
    let mut by_shard: BTreeMap<u32, String> = BTreeMap::new();
    for i in 0.. {
        let name = format!("l{i}");
        by_shard
            .entry(shard_of(&LeaseName::parse(&name).unwrap(), shards))
            .or_insert(name);
        if by_shard.len() == shards as usize {
            break;
        }
    }
    by_shard.into_values().collect()
}

/// A free loopback port for a member's proxy listener (its `advertise`).
pub(crate) use crate::support::free_port;

/// A cluster on one store and database, with one route per lease (`/l0/` → lease
/// `l0`, and so on) to one recording origin.
struct Rig {
    s3: S3Server,
    db: String,
    db_name: String,
    origin: Origin,
    shards: u32,
    leases: Vec<String>,
    members: Vec<Member>,
    /// `gate_ttl` and `self_fence_margin` of every member, as TOML values.
    gate: (&'static str, &'static str),
    /// Extra `[server]` keys of members added from now on.
    server_extra: String,
}

struct Member {
    id: String,
    fg: Option<Fencegate>,
}

impl Member {
    fn fg(&self) -> &Fencegate {
        self.fg.as_ref().expect("running")
    }
}

impl Rig {
    async fn start(n: usize, shards: u32) -> Rig {
        let s3 = S3Server::start();
        let origin = Origin::start().await;
        let (db_name, db) = PgServer::shared().new_database();
        let mut rig = Rig {
            s3,
            db,
            db_name,
            origin,
            shards,
            leases: leases_per_shard(shards),
            members: Vec::new(),
            gate: ("6s", "2s"),
            server_extra: String::new(),
        };
        for i in 0..n {
            rig.add(&format!("fg-{}", (b'a' + i as u8) as char));
        }
        rig
    }

    fn config(&self, id: &str, port: u16) -> String {
        let routes: String = self
            .leases
            .iter()
            .map(|l| {
                let timeouts = "timeout_ms = 10000\ndrain_timeout_ms = 1000\n";
                // `/l0/` records dedup keys; `/l0-ff/` is fencing only.
                route_toml(l, l, &self.origin, timeouts)
                    + &route_toml(
                        &format!("{l}-ff"),
                        l,
                        &self.origin,
                        &format!("{timeouts}derive_key = \"none\"\n"),
                    )
            })
            .collect();
        format!(
            "{}gate_ttl = \"{}\"\nself_fence_margin = \"{}\"\n{}[cluster]\ninstance_id = \"{id}\"\nadvertise = \"http://127.0.0.1:{port}\"\nshards = {}\npeer_token = \"{PEER_TOKEN}\"\n\n{routes}",
            self.s3
                .store_toml(200)
                .replace("timeout_ms = 1500", "timeout_ms = 1000"),
            self.gate.0,
            self.gate.1,
            state_toml(&self.db, ""),
            self.shards,
        )
    }

    fn add(&mut self, id: &str) {
        self.add_with(id, |c| c);
    }

    /// [`Rig::add`] with the member's config edited (e.g. its store reached
    /// through a relay).
    fn add_with(&mut self, id: &str, edit: impl FnOnce(String) -> String) {
        self.add_on(id, free_port(), edit);
    }

    /// [`Rig::add_with`] with the proxy listener on `port`.
    fn add_on(&mut self, id: &str, port: u16, edit: impl FnOnce(String) -> String) {
        let fg = Fencegate::start_listening(
            &format!("127.0.0.1:{port}"),
            &self.server_extra,
            &edit(self.config(id, port)),
            &[],
        );
        self.members.push(Member {
            id: id.to_owned(),
            fg: Some(fg),
        });
    }

    /// Starts members side by side (each `fencegate serve` waits for nothing).
    fn add_at_once(&mut self, ids: &[&str]) {
        let starts: Vec<_> = ids
            .iter()
            .map(|id| {
                let (id, port) = (id.to_string(), free_port());
                let cfg = self.config(&id, port);
                std::thread::spawn(move || {
                    let fg =
                        Fencegate::start_listening(&format!("127.0.0.1:{port}"), "", &cfg, &[]);
                    Member { id, fg: Some(fg) }
                })
            })
            .collect();
        for s in starts {
            self.members.push(s.join().unwrap());
        }
    }

    /// [`Rig::add`] with the member reaching the S3 server through a TCP relay
    /// the test can cut.
    async fn add_behind_store_relay(&mut self, id: &str) -> crate::support::relay::Relay {
        self.add_behind_store_relay_with(id, |c| c).await
    }

    /// [`Rig::add_behind_store_relay`] with the member's config edited.
    async fn add_behind_store_relay_with(
        &mut self,
        id: &str,
        edit: impl FnOnce(String) -> String,
    ) -> crate::support::relay::Relay {
        let s3 = self.s3.endpoint.clone();
        let s3_port: u16 = s3.rsplit(':').next().and_then(|p| p.parse().ok()).unwrap();
        let relay = crate::support::relay::Relay::start(s3_port).await;
        let via = format!("http://127.0.0.1:{}", relay.addr.port());
        self.add_with(id, |c| edit(c).replace(&s3, &via));
        relay
    }

    fn member(&self, id: &str) -> &Member {
        self.members.iter().find(|m| m.id == id).unwrap()
    }

    fn member_mut(&mut self, id: &str) -> &mut Member {
        self.members.iter_mut().find(|m| m.id == id).unwrap()
    }

    fn running(&self) -> impl Iterator<Item = &Member> {
        self.members.iter().filter(|m| m.fg.is_some())
    }

    /// The owner of each shard as `/v1/cluster` of `fg` shows it: its own only
    /// once it serves them (a takeover under way is no owner yet).
    async fn shard_map(fg: &Fencegate) -> Vec<Option<String>> {
        let v = fg.admin_json("/v1/cluster").await;
        let me = v["instance_id"].as_str().unwrap_or_default().to_owned();
        v["shard_map"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|s| match (s["served_here"] == true, s["owner"].as_str()) {
                        (true, _) => Some(me.clone()),
                        (false, Some(o)) if o != me => Some(o.to_owned()),
                        _ => None,
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Waits until every running member serves its shards and agrees on who owns
    /// every shard, and `check` holds for the counts; returns the map.
    async fn settled(
        &self,
        what: &str,
        check: impl Fn(&BTreeMap<String, usize>) -> bool,
    ) -> Vec<String> {
        let deadline = Instant::now() + Duration::from_secs(40);
        loop {
            let mut maps = Vec::new();
            for m in self.running() {
                maps.push(Rig::shard_map(m.fg()).await);
            }
            let agreed = maps.windows(2).all(|w| w[0] == w[1]);
            if let (true, Some(map)) = (agreed, maps.first()) {
                if map.len() == self.shards as usize && map.iter().all(Option::is_some) {
                    let map: Vec<String> = map.iter().flatten().cloned().collect();
                    let mut counts = BTreeMap::new();
                    for o in &map {
                        *counts.entry(o.clone()).or_default() += 1;
                    }
                    let live: BTreeSet<&String> = self.running().map(|m| &m.id).collect();
                    if counts.keys().all(|o| live.contains(o)) && check(&counts) {
                        return map;
                    }
                }
            }
            assert!(
                Instant::now() < deadline,
                "the cluster never settled ({what}): {maps:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until member `id` says it owns every shard (the others dead or
    /// gone); returns it.
    async fn sole_owner(&self, id: &str) -> &Fencegate {
        let fg = self.member(id).fg();
        eventually(&format!("{id} owns every shard"), || async {
            Rig::shard_map(fg)
                .await
                .iter()
                .all(|o| o.as_deref() == Some(id))
        })
        .await;
        fg
    }

    async fn worker(&self, lease: &str, holder: &str) -> Holding {
        let epochs = self.s3.epochs().await;
        acquire(&epochs, lease, holder, Duration::from_secs(60)).await
    }
}

/// `kill -SIG pid` (a freeze is [`freeze`]: it waits until the process is stopped).
fn signal(fg: &Fencegate, sig: &str) {
    let pid = fg.pid().to_string();
    assert!(std::process::Command::new("kill")
        .args([sig, &pid])
        .status()
        .unwrap()
        .success());
}

/// Sends a keyed request through `fg` that the origin holds under `hold`, and
/// waits until it is at the origin: the request a test kills, freezes or cuts
/// the owner under.
async fn held_at_origin(
    rig: &Rig,
    fg: &Fencegate,
    path: &str,
    w: &Holding,
    key: &str,
    payload: &str,
    hold: &str,
) -> tokio::task::JoinHandle<Result<Reply, String>> {
    let mut req = keyed(fg, path, w, key, payload);
    req.headers_mut()
        .insert("x-test-hold", hold.parse().unwrap());
    let pending = tokio::spawn(try_send(req));
    // This request's own arrival, not any: a count could be met by another
    // request, and the caller's freeze would then land before this one was sent.
    rig.origin
        .wait_until("the held request", |log| {
            log.iter().any(|a| a.body.starts_with(payload.as_bytes()))
        })
        .await;
    pending
}

/// Each live instance holds ⌊n/l⌋ or ⌈n/l⌉ shards.
fn balanced(shards: u32, live: usize) -> impl Fn(&BTreeMap<String, usize>) -> bool {
    move |counts| {
        let (lo, hi) = (shards as usize / live, (shards as usize).div_ceil(live));
        counts.len() == live && counts.values().all(|c| (lo..=hi).contains(c))
    }
}

fn payloads_at(origin: &Origin, prefix: &str) -> Vec<Arrival> {
    origin
        .log()
        .into_iter()
        .filter(|a| a.body.starts_with(prefix.as_bytes()))
        .collect()
}

/// Any instance serves any lease: a request reaches the destination once,
/// whichever instance the worker sent it to, without the cluster's headers; a
/// retry of a delivered key through another instance is answered from the shared
/// record, not forwarded again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_instance_serves_any_lease_once_through_the_owner() {
    skip_without_python!();
    skip_without_postgres!();
    let rig = Rig::start(3, 4).await;
    let map = rig.settled("three members", balanced(4, 3)).await;
    let mut workers = Vec::new();
    for (shard, lease) in rig.leases.iter().enumerate() {
        let w = rig.worker(lease, "w").await;
        for m in rig.running() {
            let payload = format!("{lease} via {}", m.id);
            let r = post(m.fg(), &format!("/{lease}/x"), &w, &payload).await;
            assert_eq!(
                r.status,
                200,
                "{payload} (owner {}): {}",
                map[shard],
                String::from_utf8_lossy(&r.body)
            );
        }
        let arrived = payloads_at(&rig.origin, &format!("{lease} via"));
        assert_eq!(arrived.len(), 3, "each once at the destination");
        for a in arrived {
            assert_eq!(a.header("x-fencegate-peer"), None);
            assert_eq!(a.header("x-fencegate-peer-token"), None);
            assert_eq!(a.header("x-lease-token"), None);
            // The worker's hop only, appended once (by the instance it reached).
            assert_eq!(a.header("x-forwarded-for").as_deref(), Some("127.0.0.1"));
        }
        workers.push(w);
    }
    // A delivered key, retried through every instance: answered from the record.
    let (lease, w) = (&rig.leases[0], &workers[0]);
    let first = rig.running().next().unwrap().fg();
    let r = send(keyed(first, &format!("/{lease}/k"), w, "key-1", "keyed")).await;
    assert_eq!(r.status, 200);
    for m in rig.running() {
        let again = send(keyed(m.fg(), &format!("/{lease}/k"), w, "key-1", "keyed")).await;
        assert_eq!(again.status, 200);
        assert_eq!(
            again.headers["x-fencegate-replayed"], "true",
            "via {}",
            m.id
        );
        assert_eq!(
            again.body, r.body,
            "the replay's body, unchanged via {}",
            m.id
        );
    }
    assert_eq!(payloads_at(&rig.origin, "keyed").len(), 1);
    // A refusal reaches the worker as the owner gave it, through any instance.
    let refusals: Vec<_> = forged_answers(&rig, lease, w).await;
    assert!(
        refusals.windows(2).all(|p| p[0] == p[1]),
        "the same refusal through every instance: {refusals:?}"
    );
    assert_eq!(refusals[0].0, 403, "{refusals:?}");
    assert!(refusals[0].1.contains("token_invalid"), "{refusals:?}");
    assert!(payloads_at(&rig.origin, "forged").is_empty());
    let mut relayed = 0.0;
    for m in rig.running() {
        relayed += m.fg().metric_sum("fencegate_peer_forwards_total").await;
    }
    assert!(relayed >= 6.0, "requests were relayed to owners: {relayed}");
    // The peer token is never logged, nor shown by the admin API.
    for m in rig.running() {
        assert!(!m.fg().stderr().contains(PEER_TOKEN), "{} logged it", m.id);
        let shown = m.fg().admin_json("/v1/cluster").await.to_string();
        assert!(!shown.contains(PEER_TOKEN));
    }
}

/// A request of `lease` at `w`'s epoch with a wrong token, sent through every
/// instance: status and body of each answer.
async fn forged_answers(rig: &Rig, lease: &str, w: &Holding) -> Vec<(u16, String)> {
    let mut out = Vec::new();
    for m in rig.running() {
        let forged = worker_req(&m.fg().url(&format!("/{lease}/x")), w.epoch.get(), "not-it")
            .body(body("forged"))
            .unwrap();
        let r = send(forged).await;
        out.push((
            r.status.as_u16(),
            String::from_utf8_lossy(&r.body).into_owned(),
        ));
    }
    out
}

/// SPEC §10.2/§7: `X-Fencegate-Peer` without the cluster's token is refused 403
/// `peer_unauthorized`; a relayed request reaching an instance that does not own
/// its shard is never relayed again (503 `shard_unavailable`). Nothing reaches
/// the destination.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_headers_need_the_token_and_a_relayed_request_is_never_relayed_again() {
    skip_without_python!();
    skip_without_postgres!();
    let rig = Rig::start(2, 2).await;
    let map = rig.settled("two members", balanced(2, 2)).await;
    let lease = &rig.leases[0];
    let owner = rig.member(&map[0]);
    let other = rig.running().find(|m| m.id != map[0]).unwrap();
    let w = rig.worker(lease, "w").await;
    let req = |m: &Member, token: Option<&str>, payload: &str| {
        let mut b = worker_req(&m.fg().url(&format!("/{lease}/p")), w.epoch.get(), &w.token)
            .header("x-fencegate-peer", "fg-z");
        if let Some(t) = token {
            b = b.header("x-fencegate-peer-token", t);
        }
        b.body(body(payload)).unwrap()
    };
    for m in [owner, other] {
        send(req(m, None, "no token"))
            .await
            .assert_error(403, "peer_unauthorized");
        send(req(m, Some("wrong-token-0123456789"), "wrong token"))
            .await
            .assert_error(403, "peer_unauthorized");
    }
    let r = send(req(other, Some(PEER_TOKEN), "relayed twice")).await;
    r.assert_error(503, "shard_unavailable");
    assert!(r.headers.contains_key("retry-after"));
    assert_eq!(rig.origin.count(), 0, "nothing reached the destination");
    // The owner serves a request its peer relayed.
    let r = send(req(owner, Some(PEER_TOKEN), "relayed once")).await;
    assert_eq!(r.status, 200);
    let a = &payloads_at(&rig.origin, "relayed once")[0];
    assert_eq!(a.header("x-fencegate-peer-token"), None);
}

/// Balance (SPEC §10.2): three instances share eight shards 3/3/2; one stops
/// gracefully (its release lets the others take its shards at once); one is
/// killed (its shards are taken after its gate leases expire, plus grace).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shards_balance_as_instances_join_and_leave() {
    skip_without_python!();
    skip_without_postgres!();
    let mut rig = Rig::start(1, 8).await;
    rig.settled("one member holds all", balanced(8, 1)).await;
    rig.add("fg-b");
    rig.add("fg-c");
    let joined = Instant::now();
    let map = rig.settled("three members", balanced(8, 3)).await;
    eprintln!(
        "balanced over 3 members {:?} after the joins",
        joined.elapsed()
    );
    // Ready ("I can serve or route"), and no flapping: over three renew periods
    // of a balanced cluster no shard changes hands. (Time passing is the
    // condition here: stability over an interval.)
    let moves = || async {
        let mut n = 0.0;
        for m in rig.running() {
            n += m.fg().metric_sum("fencegate_cluster_takeovers_total").await
                + m.fg().metric_sum("fencegate_cluster_handovers_total").await;
        }
        n
    };
    for m in rig.running() {
        let r = send(
            http::Request::get(m.fg().admin_url("/readyz"))
                .body(body(""))
                .unwrap(),
        )
        .await;
        assert_eq!(
            r.status,
            200,
            "{}: {}",
            m.id,
            String::from_utf8_lossy(&r.body)
        );
    }
    let before = moves().await;
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(
        moves().await,
        before,
        "shards changed hands in a balanced cluster"
    );
    for m in rig.running() {
        assert_eq!(
            Rig::shard_map(m.fg()).await,
            map.iter().cloned().map(Some).collect::<Vec<_>>(),
            "{}'s map moved",
            m.id
        );
    }
    assert!(rig
        .member_mut("fg-c")
        .fg
        .as_mut()
        .unwrap()
        .terminate()
        .success());
    rig.member_mut("fg-c").fg = None;
    let left = Instant::now();
    rig.settled("after a graceful stop", balanced(8, 2)).await;
    eprintln!("rebalanced {:?} after a graceful stop", left.elapsed());
    rig.member_mut("fg-b").fg.as_mut().unwrap().kill9();
    rig.member_mut("fg-b").fg = None;
    let killed = Instant::now();
    rig.settled("after kill -9", balanced(8, 1)).await;
    let took = killed.elapsed();
    eprintln!(
        "all shards taken over {took:?} after kill -9 (gate_ttl 6 s + grace 0.5 s after the dead instance's last renewal, which came up to 2 s before the kill)"
    );
    // No successor took a shard before the dead owner's last renewal was
    // gate_ttl + grace (6.5 s) old, on the database's clock (taken_at minus
    // the previous tenure's last renewal, both now() of one server).
    let gaps = PgServer::shared().psql(
        &rig.db_name,
        "SELECT shard || ' ' || (extract(epoch FROM taken_at - previous_renewed_at) * 1000)::bigint \
         FROM fencegate_owners WHERE previous_owner = 'fg-b'",
    );
    let mut checked = 0;
    for line in gaps.lines() {
        let mut it = line.split_whitespace();
        let (Some(shard), Some(ms)) = (it.next(), it.next().and_then(|m| m.parse::<u64>().ok()))
        else {
            continue;
        };
        assert!(
            ms >= 6500,
            "shard {shard}: taken {ms} ms after fg-b's last renewal"
        );
        checked += 1;
    }
    assert!(checked >= 2, "fg-b's shards were taken over: {gaps}");
}

/// Takeover after kill -9 (SPEC §10.2): a request the dead owner had at the
/// destination leaves its key `in_flight`; the successor turns it `in_doubt`, so
/// the worker's retry is refused, never repeated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_turns_the_dead_owners_in_flight_keys_in_doubt() {
    skip_without_python!();
    skip_without_postgres!();
    let mut rig = Rig::start(2, 2).await;
    let map = rig.settled("two members", balanced(2, 2)).await;
    let lease = rig.leases[0].clone();
    let (owner_id, other_id) = {
        let other = rig.running().find(|m| m.id != map[0]).unwrap();
        (map[0].clone(), other.id.clone())
    };
    let w = rig.worker(&lease, "w").await;
    let owner = rig.member(&owner_id).fg();
    let pending = held_at_origin(
        &rig,
        owner,
        &format!("/{lease}/k"),
        &w,
        "key-held",
        "held",
        "h",
    )
    .await;
    rig.member_mut(&owner_id).fg.as_mut().unwrap().kill9();
    assert!(
        pending.await.unwrap().is_err(),
        "the worker lost its answer"
    );
    rig.member_mut(&owner_id).fg = None;
    let survivor = rig.sole_owner(&other_id).await;
    let retry = send(keyed(
        survivor,
        &format!("/{lease}/k"),
        &w,
        "key-held",
        "held",
    ))
    .await;
    retry.assert_error(409, "dedup_in_doubt");
    assert_eq!(payloads_at(&rig.origin, "held").len(), 1, "never repeated");
    rig.origin.release("h");

    // The successor started the lease's fence at max(stored mark, latest epoch
    // listed): a newer worker epoch that the dead owner never saw is the mark
    // at once, and the older one is stale there without any request raising it.
    // (Checked on a fresh takeover: the survivor gives the shard back to a
    // restarted member, then takes it again after killing that one.)
    let epochs = rig.s3.epochs().await;
    let newer = force_next_epoch(&epochs, &lease, "w2", Duration::from_secs(60)).await;
    rig.add("fg-c");
    let map = rig.settled("fg-c joined", balanced(2, 2)).await;
    let holder = map[0].clone();
    let other = if holder == other_id {
        "fg-c"
    } else {
        other_id.as_str()
    }
    .to_owned();
    rig.member_mut(&holder).fg.as_mut().unwrap().kill9();
    rig.member_mut(&holder).fg = None;
    let successor = rig.sole_owner(&other).await;
    let leases = successor.admin_json("/v1/leases").await;
    let row = leases["leases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["lease"] == lease.as_str())
        .cloned()
        .unwrap_or_default();
    assert_eq!(row["high_water_mark"], newer.epoch.get(), "{row}");
    send(keyed(
        successor,
        &format!("/{lease}/k"),
        &w,
        "key-old",
        "old",
    ))
    .await
    .assert_error(409, "epoch_stale");
    assert!(payloads_at(&rig.origin, "old").is_empty());
}

/// Self-fencing (SPEC §10.2): an owner cut off from the lease store cannot renew;
/// it starts no forward after `gate_ttl − self_fence_margin` and aborts the
/// request it has at the destination at `gate_ttl` (504 `drain_aborted`, the key
/// in doubt); the other instance takes the shard after expiry plus grace, and the
/// retry is refused there, never repeated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_cut_off_from_the_store_stops_then_aborts_at_gate_ttl() {
    skip_without_python!();
    skip_without_postgres!();
    let mut rig = Rig::start(0, 1).await;
    let relay = rig.add_behind_store_relay("fg-a").await;
    rig.settled("fg-a owns the shard", |c| c.get("fg-a") == Some(&1))
        .await;
    rig.add("fg-b");
    rig.settled("fg-b joined", |c| c.get("fg-a") == Some(&1))
        .await;
    let lease = rig.leases[0].clone();
    let w = rig.worker(&lease, "w").await;
    let a = rig.member("fg-a").fg();
    let pending = held_at_origin(
        &rig,
        a,
        &format!("/{lease}/k"),
        &w,
        "key-cut",
        "cut off",
        "cut",
    )
    .await;
    relay.refuse(true);
    relay.cut();
    let cut = Instant::now();
    let answer = pending.await.unwrap().expect("fg-a answers its worker");
    let aborted_after = cut.elapsed();
    answer.assert_error(504, "drain_aborted");
    eprintln!("the in-flight request was aborted {aborted_after:?} after the cut (gate_ttl 6 s from the last renewal, which came up to 2 s before)");
    assert!(
        aborted_after <= Duration::from_secs(8),
        "aborted only {aborted_after:?} after the cut"
    );
    // Cut off, fg-a forwards nothing more itself.
    let r = post(a, &format!("/{lease}/x"), &w, "after the cut").await;
    assert_ne!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let b = rig.member("fg-b").fg();
    eventually("fg-b takes the shard", || async {
        Rig::shard_map(b).await == vec![Some("fg-b".to_owned())]
    })
    .await;
    let retry = send(keyed(b, &format!("/{lease}/k"), &w, "key-cut", "cut off")).await;
    retry.assert_error(409, "dedup_in_doubt");
    assert_eq!(
        payloads_at(&rig.origin, "cut off").len(),
        1,
        "never repeated"
    );
    assert!(payloads_at(&rig.origin, "after the cut").is_empty());
    rig.origin.release("cut");
}

/// SPEC §10.2 (issue 25, point 1): every lease of a shard is held to the shard's
/// one deadline — whatever is in flight is aborted at `gate_ttl` after the last
/// gate create was sent — however many leases the shard has. Two busy leases in
/// one shard: `aaa` with a request the destination holds, `zzz` with a large
/// upload the destination has not read yet (route timeout 60 s, drain timeout
/// 1 s); the owner is cut from the store and the successor forwards `zzz`'s next
/// epoch. Fails when a shard's fences are closed one after another, each with a
/// timeout of its own started when its turn came: `zzz`'s epoch-1 upload then
/// still streamed when epoch 2 arrived, and reached the destination whole after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_lease_of_a_cut_off_owners_shard_is_aborted_by_gate_ttl() {
    skip_without_python!();
    skip_without_postgres!();
    const UPLOAD: usize = 64 << 20;
    let mut rig = Rig::start(0, 1).await;
    rig.leases = vec!["aaa".into(), "zzz".into()];
    // The audit's figures: renewals every 4 s, forwards until 6 s after a create,
    // everything aborted at 12 s. One lease after another, `zzz` was aborted at
    // 18 s, after the successor's first forward (~13.5–15 s).
    rig.gate = ("12s", "6s");
    let long = |c: String| {
        c.replace(
            "timeout_ms = 10000\n",
            &format!("timeout_ms = 60000\nmax_body_bytes = {}\n", 2 * UPLOAD),
        )
    };
    let relay = rig.add_behind_store_relay_with("fg-a", long).await;
    rig.settled("fg-a owns the shard", |c| c.get("fg-a") == Some(&1))
        .await;
    rig.add_with("fg-b", long);
    rig.settled("fg-b joined", |c| c.get("fg-a") == Some(&1))
        .await;
    let a = rig.member("fg-a").fg();
    let b = rig.member("fg-b").fg();
    let wa = rig.worker("aaa", "wa").await;
    let wz = rig.worker("zzz", "wz").await;
    let slow = held_at_origin(&rig, a, "/aaa/k", &wa, "k-aaa", "aaa slow", "aaa").await;
    let upload = worker_req(&a.url("/zzz-ff/upload"), wz.epoch.get(), &wz.token)
        .header("x-test-hold-body", "upload")
        .body(Full::new(Bytes::from(vec![b'u'; UPLOAD])))
        .unwrap();
    let uploading = tokio::spawn(try_send(upload));
    let is_upload = |a: &Arrival| a.header("x-test-hold-body").as_deref() == Some("upload");
    rig.origin
        .wait_until("the upload's head", |log| log.iter().any(is_upload))
        .await;
    relay.refuse(true);
    relay.cut();
    eventually("fg-b takes the shard", || async {
        Rig::shard_map(b).await == vec![Some("fg-b".to_owned())]
    })
    .await;
    let epochs = rig.s3.epochs().await;
    let wz2 = force_next_epoch(&epochs, "zzz", "wz2", Duration::from_secs(60)).await;
    let r = post(b, "/zzz-ff/next", &wz2, "zzz epoch 2").await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let second = payloads_at(&rig.origin, "zzz epoch 2").remove(0);
    // The destination now reads the epoch-1 upload: whole only if fg-a still
    // streamed it.
    rig.origin.release("upload");
    rig.origin.release("aaa");
    rig.origin
        .wait_until("the upload read to its end", |log| {
            log.iter().any(|a| is_upload(a) && a.completed.is_some())
        })
        .await;
    let first = rig.origin.log().into_iter().find(is_upload).unwrap();
    assert!(
        !first.body_whole,
        "epoch 1 of zzz reached the destination whole ({} bytes) {:?} after epoch 2 arrived",
        first.body_read,
        first
            .completed
            .unwrap()
            .saturating_duration_since(second.arrived)
    );
    let answered = uploading.await.unwrap();
    assert!(
        answered.as_ref().map_or(true, |r| r.status != 200),
        "the upload's worker was told it was delivered"
    );
    slow.await
        .unwrap()
        .expect("fg-a answers")
        .assert_error(504, "drain_aborted");
}

/// The honest limit's safe side (SPEC §10.2): an owner frozen past its gate lease
/// (SIGSTOP) is replaced; when it wakes, it has stopped forwarding on its own
/// clock, so a stale worker's request sent to it never reaches the destination,
/// and the new owner serves the newer epoch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_owner_wakes_up_fenced() {
    skip_without_python!();
    skip_without_postgres!();
    let rig = Rig::start(2, 1).await;
    let map = rig
        .settled("two members, one shard", |c| c.len() == 1)
        .await;
    let lease = &rig.leases[0];
    let frozen = rig.member(&map[0]);
    let other = rig.running().find(|m| m.id != map[0]).unwrap();
    let old = rig.worker(lease, "old").await;
    assert_eq!(
        post(frozen.fg(), &format!("/{lease}/x"), &old, "old before")
            .await
            .status,
        200
    );
    freeze(frozen.fg().pid());
    eventually("the other instance takes the shard", || async {
        Rig::shard_map(other.fg()).await == vec![Some(other.id.clone())]
    })
    .await;
    // The old worker's lease ends and a new one takes it (forced: it is still live).
    let epochs = rig.s3.epochs().await;
    let new = force_next_epoch(&epochs, lease, "new", Duration::from_secs(60)).await;
    assert_eq!(
        post(other.fg(), &format!("/{lease}/x"), &new, "new via owner")
            .await
            .status,
        200
    );
    signal(frozen.fg(), "-CONT");
    // At once after waking: the stale request must not be forwarded by the frozen one.
    let r = post(frozen.fg(), &format!("/{lease}/x"), &old, "old after wake").await;
    assert_ne!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert!(payloads_at(&rig.origin, "old after wake").is_empty());
    // And the newer epoch, sent to the woken instance, is served once (relayed).
    eventually("the woken instance relays to the new owner", || async {
        post(frozen.fg(), &format!("/{lease}/x"), &new, "new via woken")
            .await
            .status
            == 200
    })
    .await;
    assert_eq!(payloads_at(&rig.origin, "new via woken").len(), 1);
}

/// SPEC §10.2: a single instance and a cluster never share a prefix — each
/// refuses to start (exit 2) when it finds the other's live gate object.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_instance_and_a_cluster_never_share_a_prefix() {
    skip_without_python!();
    skip_without_postgres!();
    let rig = Rig::start(1, 2).await;
    rig.settled("one member", balanced(2, 1)).await;
    let single = format!(
        "{}gate_ttl = \"3s\"\nself_fence_margin = \"1s\"\n{}",
        rig.s3
            .store_toml(200)
            .replace("timeout_ms = 1500", "timeout_ms = 1000"),
        route_toml("l0", "l0", &rig.origin, "")
    );
    let (code, stderr) = serve_expecting_exit(&single);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("cluster"), "names the cluster: {stderr}");
}

/// A single instance's config on the rig's store and prefix (sled state).
fn single_toml(rig: &Rig) -> String {
    format!(
        "{}gate_ttl = \"3s\"\nself_fence_margin = \"1s\"\n{}",
        rig.s3
            .store_toml(200)
            .replace("timeout_ms = 1500", "timeout_ms = 1000"),
        route_toml("l0", "l0", &rig.origin, "")
    )
}

/// SPEC §10.1–§10.2 (issue 25, point 2a): the owner of shard 0 of a two-shard
/// cluster stops gracefully (its `release` makes shard 0 free) while the other
/// member, which holds shard 1, cannot take it yet (frozen, its gate lease still
/// live). A single instance started now on the same prefix must not serve: it
/// refuses to take over from a cluster whose deliveries are elsewhere, and with
/// `--takeover-may-duplicate` it still finds the cluster's live shard 1 after
/// taking shard 0, releases it and exits 2. Then the cluster serves again, and
/// a delivered key is never delivered twice. Failed when exclusion was checked
/// only through shard 0's latest object at start-up: the single instance served
/// every lease beside the cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_instance_never_serves_beside_a_cluster_whose_shard_0_is_free() {
    skip_without_python!();
    skip_without_postgres!();
    let mut rig = Rig::start(0, 2).await;
    // Long gate leases: the frozen member's shard-1 lease outlives the test's
    // single-instance starts by far (renewals every 10 s).
    rig.gate = ("30s", "10s");
    rig.add_at_once(&["fg-a", "fg-b"]);
    let map = rig.settled("two members", balanced(2, 2)).await;
    let lease = rig.leases[0].clone(); // shard 0's lease
    let w = rig.worker(&lease, "w").await;
    let first = rig.member(&map[1]).fg();
    let r = send(keyed(
        first,
        &format!("/{lease}/k"),
        &w,
        "charge-42",
        "charge",
    ))
    .await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let (stopping, staying) = (map[0].clone(), map[1].clone());
    freeze(rig.member(&staying).fg().pid());
    let mut gone = rig.member_mut(&stopping).fg.take().unwrap();
    assert!(gone.terminate().success());
    // Refused: the cluster's release is not this instance's to believe (it
    // waits gate_ttl after it), and its deliveries are in another state.
    let (code, stderr) = serve_expecting_exit(&single_toml(&rig));
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("--takeover-may-duplicate") || stderr.contains("2 shards"),
        "{stderr}"
    );
    let (code, stderr) =
        serve_expecting_exit_with(&single_toml(&rig), &["--takeover-may-duplicate"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("2 shards"), "names the cluster: {stderr}");
    signal(rig.member(&staying).fg(), "-CONT");
    let fg = rig.sole_owner(&staying).await;
    let again = send(keyed(fg, &format!("/{lease}/k"), &w, "charge-42", "charge")).await;
    assert_ne!(
        again.status,
        502,
        "{}",
        String::from_utf8_lossy(&again.body)
    );
    assert_eq!(
        payloads_at(&rig.origin, "charge").len(),
        1,
        "charge-42 delivered once"
    );
}

/// Issue 25, point 2b: an instance of another shard count never joins — not
/// even when shard 0 happens to be free — because the other shards' live gate
/// objects name the running cluster's shape. Failed when only shard 0 was
/// looked at: the 4-shard instance served leases the 2-shard cluster served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_of_another_shard_count_never_joins() {
    skip_without_python!();
    skip_without_postgres!();
    let mut rig = Rig::start(0, 2).await;
    rig.gate = ("30s", "10s");
    rig.add_at_once(&["fg-a", "fg-b"]);
    let map = rig.settled("two members", balanced(2, 2)).await;
    freeze(rig.member(&map[1]).fg().pid());
    let mut gone = rig.member_mut(&map[0]).fg.take().unwrap();
    assert!(gone.terminate().success());
    rig.shards = 4;
    let (code, stderr) = serve_expecting_exit(&rig.config("fg-c", free_port()));
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("a cluster of 2 shards"), "{stderr}");
    rig.shards = 2;
    signal(rig.member(&map[1]).fg(), "-CONT");
}

/// Issue 25, point 2 while running: a live gate object of another set-up
/// appearing under a running cluster's prefix (here written by hand into a
/// shard the cluster does not hold, as a single instance's would be) stops
/// every member's forwarding at once, and says why (`/readyz`, the metric,
/// `/v1/cluster`); once it has expired the cluster serves again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_gate_object_of_another_set_up_stops_the_cluster_until_it_ends() {
    skip_without_python!();
    skip_without_postgres!();
    let rig = Rig::start(1, 2).await;
    rig.settled("one member", balanced(2, 1)).await;
    let fg = rig.member("fg-a").fg();
    let lease = rig.leases[0].clone();
    let w = rig.worker(&lease, "w").await;
    assert_eq!(
        post(fg, &format!("/{lease}-ff/x"), &w, "before")
            .await
            .status,
        200
    );
    // The next epoch of shard 0's gate lease, as a single instance writes it
    // (shard 0 is the only one a single instance uses: on another shard such an
    // object is forged, and only makes that shard unavailable).
    let gates = Epochs::new(rig.s3.store().await, format!("{PREFIX}.gate/"));
    let shard1 = LeaseName::parse("0000").unwrap();
    let next = gates
        .latest_after(&shard1, Epoch::NONE)
        .await
        .unwrap()
        .next()
        .unwrap();
    let mut rec = fencegate::epoch::EpochRecord::acquire(
        &shard1,
        next,
        "fg-single",
        b"token",
        // Long enough for the checks made while it lives (/readyz, the
        // metric, nothing delivered) on a loaded machine: with 5 s it expired
        // before /readyz was read in two runs under the full suite.
        Duration::from_secs(15),
    );
    fencegate::set_up::SetUp::Single.stamp(&mut rec);
    gates
        .create(&shard1, next, rec.to_json().into())
        .await
        .unwrap();
    // The anchor's round (every gate_ttl / 4) names the conflict; the keeper's
    // own round may see shard 0's new object first, and refuse that shard
    // alone, before it: waiting for the object in the shard map and reading
    // /readyz at once failed that way under a loaded suite.
    eventually("fg-a names the other set-up", || async {
        !fg.admin_json("/v1/cluster").await["conflict"].is_null()
    })
    .await;
    // From then on nothing is forwarded (the cluster kept forwarding beside the
    // other set-up when running instances never looked at a gate object's mode).
    let r = post(fg, &format!("/{lease}-ff/x"), &w, "during").await;
    r.assert_error(503, "shard_unavailable");
    let ready = fg.admin_json("/readyz").await;
    assert!(
        ready.to_string().contains("a single instance"),
        "/readyz says why: {ready}"
    );
    assert_eq!(
        fg.metric_sum("fencegate_cluster_set_up_conflict").await,
        1.0
    );
    assert!(payloads_at(&rig.origin, "during").is_empty());
    eventually("fg-a serves again once the object has expired", || async {
        post(fg, &format!("/{lease}-ff/x"), &w, "after")
            .await
            .status
            == 200
    })
    .await;
    assert_eq!(
        fg.metric_sum("fencegate_cluster_set_up_conflict").await,
        0.0
    );
}

/// Issue 25, point 5: gate objects are authenticated. Someone who can write
/// under `.gate/` but lacks the peer token creates the next gate epoch of the
/// only shard, naming itself holder and its own address as `advertise`: the
/// owner loses the shard, but no member relays a worker's request (its token,
/// body and the peer token) there — the shard is unavailable (503, the metric
/// and `/v1/cluster` say why) until `gate_ttl` after the forged object was
/// written, then a member takes it and serves again. Failed when gate objects
/// were trusted as written: the other member relayed to the forger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_gate_object_is_trusted_for_nothing() {
    skip_without_python!();
    skip_without_postgres!();
    let rig = Rig::start(2, 1).await;
    let map = rig
        .settled("two members, one shard", |c| c.len() == 1)
        .await;
    let other = rig.running().find(|m| m.id != map[0]).unwrap().fg();
    let lease = rig.leases[0].clone();
    let w = rig.worker(&lease, "w").await;
    assert_eq!(
        post(other, &format!("/{lease}-ff/x"), &w, "before")
            .await
            .status,
        200
    );
    let forger = Origin::start().await;
    let gates = Epochs::new(rig.s3.store().await, format!("{PREFIX}.gate/"));
    let shard0 = LeaseName::parse("0000").unwrap();
    let next = gates
        .latest_after(&shard0, Epoch::NONE)
        .await
        .unwrap()
        .next()
        .unwrap();
    let mut rec = fencegate::epoch::EpochRecord::acquire(
        &shard0,
        next,
        "fg-evil",
        b"token",
        // A short TTL, not believed: the shard stays unavailable until
        // gate_ttl after the forged object was written.
        Duration::from_secs(1),
    );
    fencegate::set_up::SetUp::Cluster { shards: 1 }.stamp(&mut rec);
    rec.advertise = Some(forger.url("").trim_end_matches('/').to_owned());
    rec.mac = Some("00".repeat(32));
    gates
        .create(&shard0, next, rec.to_json().into())
        .await
        .unwrap();
    let forged_at = Instant::now();
    // Both members: the owner too, or it may still serve the shard within its
    // own tenure (it has not read the forgery yet) when the other relays there.
    let members: Vec<&Fencegate> = rig.running().map(|m| m.fg()).collect();
    eventually("every member reads the forged object", || async {
        for fg in &members {
            if fg.admin_json("/v1/cluster").await["shard_map"][0]["anchor_epoch"] != next.get() {
                return false;
            }
        }
        true
    })
    .await;
    let r = post(other, &format!("/{lease}-ff/x"), &w, "during").await;
    assert!(
        forger.log().is_empty(),
        "a worker's request was relayed to the forger's advertise: {:?}",
        forger
            .log()
            .iter()
            .map(|a| a.path.clone())
            .collect::<Vec<_>>()
    );
    // The shard is unavailable until gate_ttl after the forged object was
    // written: judged when the answer came within it (a busy machine may
    // answer later, when a member serves the shard again, rightly).
    let gate_ttl = humantime::parse_duration(rig.gate.0).unwrap();
    if forged_at.elapsed() < gate_ttl {
        r.assert_error(503, "shard_unavailable");
        assert!(other.admin_json("/v1/cluster").await["shard_map"][0]["untrusted"].is_string());
    } else {
        eprintln!("answered past gate_ttl after the forgery: the window was not judged");
    }
    assert_eq!(
        other
            .metric_sum("fencegate_cluster_untrusted_gate_objects")
            .await,
        1.0
    );
    eventually("a member serves the shard again", || async {
        post(other, &format!("/{lease}-ff/x"), &w, "after")
            .await
            .status
            == 200
    })
    .await;
    assert!(
        forged_at.elapsed() >= Duration::from_secs(6),
        "taken back only gate_ttl after the forged object ({:?})",
        forged_at.elapsed()
    );
    assert!(forger.log().is_empty(), "nothing was relayed to the forger");
    assert!(payloads_at(&rig.origin, "during").is_empty());
}

/// The other way round: a cluster instance refuses a prefix a single instance
/// holds, naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_instance_refuses_a_prefix_a_single_instance_holds() {
    skip_without_python!();
    skip_without_postgres!();
    let rig = Rig::start(0, 2).await;
    let single = format!(
        "{}gate_ttl = \"3s\"\nself_fence_margin = \"1s\"\n{}",
        rig.s3
            .store_toml(200)
            .replace("timeout_ms = 1500", "timeout_ms = 1000"),
        route_toml("l0", "l0", &rig.origin, "")
    );
    let _single = Fencegate::start(&single);
    let (code, stderr) = serve_expecting_exit(&rig.config("fg-x", free_port()));
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("a single instance"),
        "names the single instance's mode: {stderr}"
    );
}

/// SPEC §10.2, a long freeze with a request in flight: the owner is frozen past
/// its gate lease while its request is at the destination; the other instance
/// takes the shard (the record turns in doubt) and serves a newer epoch; when
/// the frozen owner wakes and reads the old request's answer, its late `done`
/// write fails (a newer owner generation holds the shard), so the key stays in
/// doubt — and nothing of the older epoch reaches the destination after the newer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deposed_owners_late_outcome_write_fails() {
    skip_without_python!();
    skip_without_postgres!();
    let rig = Rig::start(2, 1).await;
    let map = rig
        .settled("two members, one shard", |c| c.len() == 1)
        .await;
    let lease = rig.leases[0].clone();
    let a = rig.member(&map[0]).fg();
    let b = rig.running().find(|m| m.id != map[0]).unwrap();
    let old = rig.worker(&lease, "old").await;
    let pending = held_at_origin(
        &rig,
        a,
        &format!("/{lease}/k"),
        &old,
        "key-slow",
        "old slow",
        "slow",
    )
    .await;
    freeze(a.pid());
    // The destination answers while the owner is frozen.
    rig.origin.release("slow");
    eventually("the other instance takes the shard", || async {
        Rig::shard_map(b.fg()).await == vec![Some(b.id.clone())]
    })
    .await;
    let epochs = rig.s3.epochs().await;
    let new = force_next_epoch(&epochs, &lease, "new", Duration::from_secs(60)).await;
    let r = send(keyed(
        b.fg(),
        &format!("/{lease}/k"),
        &new,
        "key-new",
        "new",
    ))
    .await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    signal(a, "-CONT");
    let _ = pending.await.unwrap();
    let record = |key: &'static str| {
        let url = format!("/v1/dedup/{lease}/{key}");
        async move { b.fg().admin_json(&url).await["state"].clone() }
    };
    assert_eq!(
        record("key-slow").await,
        "in_doubt",
        "the late done did not land"
    );
    eventually("the deposed owner says its write failed", || async {
        a.stderr().contains("newer than this instance")
    })
    .await;
    let log = rig.origin.log();
    let first_new = log
        .iter()
        .filter(|x| x.epoch() == Some(new.epoch.get()))
        .map(|x| x.arrived)
        .min();
    let last_old = log
        .iter()
        .filter(|x| x.epoch() == Some(old.epoch.get()))
        .map(|x| x.arrived)
        .max();
    assert!(
        last_old < first_new,
        "the older epoch arrived after the newer"
    );
}

/// A freeze shorter than `gate_ttl − self_fence_margin` costs nothing: the owner
/// renews on waking, nobody takes its shard, and it serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_freeze_causes_no_takeover() {
    skip_without_python!();
    skip_without_postgres!();
    let rig = Rig::start(2, 1).await;
    let map = rig
        .settled("two members, one shard", |c| c.len() == 1)
        .await;
    let a = rig.member(&map[0]).fg();
    let b = rig.running().find(|m| m.id != map[0]).unwrap().fg();
    let before = b.metric_sum("fencegate_cluster_takeovers_total").await;
    freeze(a.pid());
    tokio::time::sleep(Duration::from_millis(1500)).await;
    signal(a, "-CONT");
    // Two keeper rounds of the other instance after the freeze.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(
        b.metric_sum("fencegate_cluster_takeovers_total").await,
        before
    );
    assert_eq!(Rig::shard_map(b).await, vec![Some(map[0].clone())]);
    let lease = &rig.leases[0];
    let w = rig.worker(lease, "w").await;
    assert_eq!(
        post(a, &format!("/{lease}/x"), &w, "after a short freeze")
            .await
            .status,
        200
    );
}

/// Three instances starting at once on an empty bucket: every shard gets exactly
/// one owner, which they all agree on, shared 3/3/2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_instances_starting_at_once_agree_on_one_owner_per_shard() {
    skip_without_python!();
    skip_without_postgres!();
    let mut rig = Rig::start(0, 8).await;
    rig.add_at_once(&["fg-a", "fg-b", "fg-c"]);
    let map = rig.settled("three at once", balanced(8, 3)).await;
    // The database agrees: each shard's owner row names the owner (and the
    // store holds the anchor only).
    let rows = PgServer::shared().psql(
        &rig.db_name,
        "SELECT shard || ':' || owner FROM fencegate_owners ORDER BY shard",
    );
    for (shard, owner) in map.iter().enumerate() {
        assert!(
            rows.contains(&format!("{shard}:{owner}")),
            "shard {shard}: {rows}"
        );
    }
    let gates = Epochs::new(rig.s3.store().await, format!("{PREFIX}.gate/"));
    for shard in 1..8 {
        let name = fencegate::cluster::shard_name(shard);
        let latest = gates.latest_after(&name, Epoch::NONE).await.unwrap();
        assert_eq!(latest, Epoch::NONE, "shard {shard} has gate objects");
    }
}

/// SIGTERM of an owner (SPEC §10.2): it releases its shards and the others take
/// them within a keeper round; a worker sending through a surviving instance
/// meanwhile sees 503 `shard_unavailable` only briefly, and nothing is lost or
/// repeated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_stop_hands_shards_over_quickly() {
    skip_without_python!();
    skip_without_postgres!();
    let mut rig = Rig::start(2, 2).await;
    let map = rig.settled("two members", balanced(2, 2)).await;
    let (lease, owner) = (rig.leases[0].clone(), map[0].clone());
    let other = rig.running().find(|m| m.id != owner).unwrap().id.clone();
    let w = rig.worker(&lease, "w").await;
    let stopping = std::thread::spawn({
        let pid = rig.member(&owner).fg().pid();
        move || {
            std::thread::sleep(Duration::from_millis(300));
            std::process::Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status()
                .unwrap();
        }
    });
    let via = rig.member(&other).fg();
    let (mut ok, mut refused, mut longest, mut streak) = (0, 0, Duration::ZERO, None::<Instant>);
    let start = Instant::now();
    let mut i = 0;
    while start.elapsed() < Duration::from_secs(10) {
        i += 1;
        let r = post(via, &format!("/{lease}/x"), &w, &format!("handoff {i}")).await;
        if r.status == 200 {
            ok += 1;
            if let Some(s) = streak.take() {
                longest = longest.max(s.elapsed());
            }
        } else {
            r.assert_error(503, "shard_unavailable");
            refused += 1;
            streak.get_or_insert_with(Instant::now);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stopping.join().unwrap();
    assert!(streak.is_none(), "still refused after 10 s");
    eprintln!(
        "SIGTERM handoff: {ok} served, {refused} refused 503, longest refusal streak {longest:?}"
    );
    assert!(
        longest <= Duration::from_secs(2),
        "refused for {longest:?} (more than a renew period)"
    );
    assert_eq!(
        payloads_at(&rig.origin, "handoff").len(),
        ok,
        "each served request once"
    );
    rig.member_mut(&owner).fg.as_mut().unwrap().wait_exit();
    rig.member_mut(&owner).fg = None;
}

/// The figures issue 13 asks for (not a check; run by hand, debug build):
/// `scripts/test.sh cluster::figures -- --ignored --nocapture`.
/// - gate-lease store calls per instance per hour at rest;
/// - requests per second through one instance alone, then, with three, through
///   the owner, through all three (two of three take a peer hop) and through a
///   non-owner only, 16 at a time. Takeover times: [`takeover_figures`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "figures, minutes long: run by hand"]
async fn figures() {
    skip_without_python!();
    skip_without_postgres!();
    let mut rig = Rig::start(0, 16).await;
    rig.gate = ("6s", "2s");
    // One instance first: the baseline the three are compared with.
    rig.add("fg-a");
    rig.settled("one", balanced(16, 1)).await;
    let lease = rig.leases[0].clone();
    let w = rig.worker(&lease, "load").await;
    let alone = vec![rig.member("fg-a").fg().url(&format!("/{lease}/x"))];
    throughput(&w, "one instance alone", alone).await;
    rig.add_at_once(&["fg-b", "fg-c"]);
    let map = rig.settled("three", balanced(16, 3)).await;

    async fn calls(m: &Member) -> f64 {
        m.fg()
            .metric_sum("fencegate_cluster_gate_store_calls_total")
            .await
    }
    let mut before = Vec::new();
    for m in rig.running() {
        before.push(calls(m).await);
    }
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(15)).await;
    for (m, b) in rig.running().zip(&before) {
        let per_hour = (calls(m).await - b) / t0.elapsed().as_secs_f64() * 3600.0;
        eprintln!(
            "at rest: {} makes {per_hour:.0} gate store calls per hour (${:.2}/h at $0.005 per 1,000)",
            m.id,
            per_hour * 0.005 / 1000.0
        );
    }

    let owner = map[0].clone();
    let urls = |ids: &[&str]| -> Vec<String> {
        ids.iter()
            .map(|id| rig.member(id).fg().url(&format!("/{lease}/x")))
            .collect()
    };
    let others: Vec<String> = rig
        .running()
        .filter(|m| m.id != owner)
        .map(|m| m.id.clone())
        .collect();
    let all: Vec<&str> = rig.running().map(|m| m.id.as_str()).collect();
    let runs = [
        ("through the owner", urls(&[owner.as_str()])),
        ("round-robin over 3", urls(&all)),
        ("through a non-owner", urls(&[others[0].as_str()])),
    ];
    for (what, targets) in &runs {
        throughput(&w, what, targets.clone()).await;
    }
    // Issue 27: 64 workers with dedup records in PostgreSQL, round-robin over
    // the three vs. only through the owner, interleaved, paired by round.
    // Each round on a lease of its own (a worker's lease outlives one round).
    let mut ratios = Vec::new();
    for round in 0..3 {
        let shard = round + 1;
        let lease_r = rig.leases[shard].clone();
        let owner_r = Rig::shard_map(rig.member(&owner).fg()).await[shard]
            .clone()
            .expect("owned");
        let w = rig.worker(&lease_r, "load").await;
        let url = |id: &str| rig.member(id).fg().url(&format!("/{lease_r}/x"));
        let only: Vec<String> = vec![url(&owner_r)];
        let rr: Vec<String> = all.iter().map(|id| url(id)).collect();
        let owner_rps = throughput_at(
            &w,
            &format!("round {round}: owner only, c=64"),
            only,
            64,
            6000,
        )
        .await;
        let rr_rps = throughput_at(
            &w,
            &format!("round {round}: round-robin over 3, c=64"),
            rr,
            64,
            6000,
        )
        .await;
        ratios.push(rr_rps / owner_rps);
    }
    ratios.sort_by(f64::total_cmp);
    eprintln!(
        "round-robin ÷ owner only at c=64, median of 3 paired rounds: {:.2} ({ratios:.2?})",
        ratios[1]
    );
}

/// Issue 28's figures (not a check; run by hand, debug build):
/// `cargo test --test it cluster::at_rest_figures -- --ignored --nocapture`.
/// Three instances, every `[store]`/`[cluster]` timing key at its default (16
/// shards, `gate_ttl` 10 s, `self_fence_margin` 2 s, `grace_ms` 2 s), no
/// traffic: the lease store calls the cluster's coordination makes, per hour for
/// the three, by operation when the build counts them so, priced at S3
/// Standard (PUT and LIST $0.005 per 1,000, GET and HEAD $0.0004), over 60 s
/// after a 30 s settle; and the database calls of coordination per instance
/// per second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "figures, minutes long: run by hand"]
async fn at_rest_figures() {
    skip_without_python!();
    skip_without_postgres!();
    let mut rig = Rig::start(0, 16).await;
    rig.gate = ("10s", "2s");
    let defaults = |c: String| {
        c.replace("grace_ms = 500", "grace_ms = 2000")
            .replace("refresh_interval_ms = 200", "refresh_interval_ms = 1000")
    };
    for id in ["fg-a", "fg-b", "fg-c"] {
        rig.add_with(id, defaults);
    }
    rig.settled("three", balanced(16, 3)).await;
    tokio::time::sleep(Duration::from_secs(30)).await;
    async fn by_op(fg: &Fencegate, name: &str) -> BTreeMap<String, f64> {
        let r = send(
            http::Request::get(fg.admin_url("/metrics"))
                .body(body(""))
                .unwrap(),
        )
        .await;
        let text = String::from_utf8_lossy(&r.body).into_owned();
        let mut out = BTreeMap::new();
        for line in text.lines().filter(|l| l.starts_with(name)) {
            let op = line
                .split("op=\"")
                .nth(1)
                .and_then(|r| r.split('"').next())
                .unwrap_or("all")
                .to_owned();
            let v: f64 = line
                .rsplit(' ')
                .next()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0.0);
            *out.entry(op).or_default() += v;
        }
        out
    }
    let sum = |ms: &[BTreeMap<String, f64>]| {
        let mut t: BTreeMap<String, f64> = BTreeMap::new();
        for m in ms {
            for (k, v) in m {
                *t.entry(k.clone()).or_default() += v;
            }
        }
        t
    };
    let (mut s0, mut d0) = (Vec::new(), Vec::new());
    for m in rig.running() {
        s0.push(by_op(m.fg(), "fencegate_cluster_gate_store_calls_total").await);
        d0.push(by_op(m.fg(), "fencegate_cluster_db_calls_total").await);
    }
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(60)).await;
    let (mut s1, mut d1) = (Vec::new(), Vec::new());
    for m in rig.running() {
        s1.push(by_op(m.fg(), "fencegate_cluster_gate_store_calls_total").await);
        d1.push(by_op(m.fg(), "fencegate_cluster_db_calls_total").await);
    }
    let secs = t0.elapsed().as_secs_f64();
    let (s0, s1) = (sum(&s0), sum(&s1));
    let mut dollars = 0.0;
    for (op, v) in &s1 {
        let per_hour = (v - s0.get(op).copied().unwrap_or(0.0)) / secs * 3600.0;
        let price = match op.as_str() {
            "get" | "head" => 0.0004,
            _ => 0.005,
        };
        let month = per_hour * 24.0 * 30.0 * price / 1000.0;
        dollars += month;
        eprintln!(
            "at rest, 3 instances: {per_hour:.0} store calls per hour ({op}), ${month:.2} a month"
        );
    }
    eprintln!("at rest, 3 instances: ${dollars:.2} a month in lease store calls");
    let (d0, d1) = (sum(&d0), sum(&d1));
    for (op, v) in &d1 {
        let per_s = (v - d0.get(op).copied().unwrap_or(0.0)) / secs / 3.0;
        eprintln!("at rest: {per_s:.2} database calls per instance per second ({op})");
    }
}

/// Time from kill -9 of an owner to the first request served for its shard by
/// another instance, over 20 takeovers (gate_ttl 6 s, grace 0.5 s), on a
/// cluster of its own with four shards: the test S3 server lists a prefix in time
/// proportional to every object in the bucket, and sixteen shards' renewals slow
/// it past its callers' timeouts within minutes. Run by hand:
/// `scripts/test.sh cluster::takeover_figures -- --ignored --nocapture`
/// (`FENCEGATE_TEST_BIN` runs another build's binary under the same test).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "figures, minutes long: run by hand"]
async fn takeover_figures() {
    skip_without_python!();
    skip_without_postgres!();
    let mut rig = Rig::start(0, 4).await;
    rig.add_at_once(&["fg-a", "fg-b", "fg-c"]);
    rig.settled("three, four shards", |c| c.len() == 3).await;
    let lease = rig.leases[0].clone();
    let mut took = Vec::new();
    for round in 0..20 {
        // Every shard owned and agreed on (balance may lag under load).
        let map = rig.settled("before a kill", |c| c.len() >= 2).await;
        let owner = map[0].clone();
        let via = rig
            .running()
            .find(|m| m.id != owner)
            .unwrap()
            .fg()
            .url(&format!("/{lease}/x"));
        // A fresh worker epoch (the last one would expire over 20 rounds),
        // admitted before the kill.
        let epochs = rig.s3.epochs().await;
        let w = force_next_epoch(&epochs, &lease, "w", Duration::from_secs(60)).await;
        assert_eq!(
            post(
                rig.member(&owner).fg(),
                &format!("/{lease}/x"),
                &w,
                &format!("before {round}")
            )
            .await
            .status,
            200
        );
        rig.member_mut(&owner).fg.as_mut().unwrap().kill9();
        let killed = Instant::now();
        loop {
            let req = worker_req(&via, w.epoch.get(), &w.token)
                .body(body(&format!("takeover {round} {:?}", killed.elapsed())))
                .unwrap();
            if send(req).await.status == 200 {
                break;
            }
            assert!(killed.elapsed() < Duration::from_secs(30), "no takeover");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        took.push(killed.elapsed());
        eprintln!("takeover {round}: {:?}", killed.elapsed());
        // The single-threaded test S3 server can be slow to answer a start-up's
        // self-test under this load: try again.
        let fg = rig.member_mut(&owner).fg.as_mut().unwrap();
        let mut tries = 0;
        while let Err(e) = fg.spawn(None) {
            tries += 1;
            assert!(tries < 5, "restart: {e}");
        }
    }
    took.sort();
    eprintln!(
        "kill -9 to first request served elsewhere over {} takeovers: p50 {:?}, max {:?} (target gate_ttl + grace + 1 s = 7.5 s)",
        took.len(),
        took[took.len() / 2],
        took[took.len() - 1]
    );
}

/// 2,000 requests of lease `w` 16 at a time, spread over `targets` in turn;
/// prints what was served, req/s and latency.
async fn throughput(w: &Holding, what: &str, targets: Vec<String>) -> f64 {
    throughput_at(w, what, targets, 16, 2000).await
}

/// [`throughput`] with `c` workers sending `n` requests in all; req/s.
async fn throughput_at(w: &Holding, what: &str, targets: Vec<String>, c: usize, n: usize) -> f64 {
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..c {
        let (targets, w, what) = (targets.clone(), w.clone(), what.to_owned());
        tasks.spawn(async move {
            let mut lat = Vec::new();
            for i in (t..n).step_by(c) {
                let url = &targets[i % targets.len()];
                let req = worker_req(url, w.epoch.get(), &w.token)
                    .body(body(&format!("{what} {i} {t}")))
                    .unwrap();
                let s = Instant::now();
                // Counted, not asserted: an overloaded test S3 server can make
                // an owner self-fence for a moment (503).
                if send(req).await.status == 200 {
                    lat.push(s.elapsed());
                }
            }
            lat
        });
    }
    let mut lat = Vec::new();
    while let Some(l) = tasks.join_next().await {
        lat.extend(l.unwrap());
    }
    lat.sort();
    let rps = lat.len() as f64 / started.elapsed().as_secs_f64();
    if lat.is_empty() {
        eprintln!("{what}: none of {n} served");
        return rps;
    }
    eprintln!(
        "{what}: {} of {n} served, {rps:.0} req/s, p50 {:?}, p99 {:?}",
        lat.len(),
        lat[lat.len() / 2],
        lat[lat.len() * 99 / 100]
    );
    rps
}

/// Partitions through a TCP relay (SPEC §10.2): the owner cut off from
/// PostgreSQL refuses what needs a state write (503, nothing forwarded) while
/// fencing-only requests at its raised mark keep flowing (the gate lease is in
/// S3); another instance cut off from the owner refuses (503) and nothing of its
/// requests reaches the destination.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_from_the_database_and_between_instances() {
    skip_without_python!();
    skip_without_postgres!();
    let mut rig = Rig::start(0, 1).await;
    let pg = crate::support::relay::Relay::start(pg_port(&rig.db)).await;
    let via_pg = pg.url(&rig.db_name);
    let port = free_port();
    let peer = crate::support::relay::Relay::start(port).await;
    let db = rig.db.clone();
    rig.add_on("fg-a", port, |c| {
        c.replace(&db, &via_pg).replace(
            &format!("advertise = \"http://127.0.0.1:{port}\""),
            &format!("advertise = \"http://{}\"", peer.addr),
        )
    });
    rig.settled("fg-a owns the shard", |c| c.get("fg-a") == Some(&1))
        .await;
    rig.add("fg-b");
    rig.settled("fg-b joined", |c| c.get("fg-a") == Some(&1))
        .await;
    let lease = rig.leases[0].clone();
    let w = rig.worker(&lease, "w").await;
    let (a, b) = (rig.member("fg-a").fg(), rig.member("fg-b").fg());
    assert_eq!(
        post(a, &format!("/{lease}-ff/x"), &w, "ff before")
            .await
            .status,
        200
    );
    assert_eq!(
        post(b, &format!("/{lease}-ff/x"), &w, "relayed before")
            .await
            .status,
        200
    );

    // fg-a ↔ PostgreSQL cut.
    pg.refuse(true);
    pg.cut();
    let r = post(a, &format!("/{lease}/x"), &w, "needs a record").await;
    r.assert_error(503, "store_unavailable");
    assert!(payloads_at(&rig.origin, "needs a record").is_empty());
    for i in 0..5 {
        let r = post(a, &format!("/{lease}-ff/x"), &w, &format!("ff during {i}")).await;
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    }
    assert_eq!(payloads_at(&rig.origin, "ff during").len(), 5);
    pg.refuse(false);

    // fg-b ↔ fg-a cut: fg-b cannot relay.
    peer.refuse(true);
    peer.cut();
    // The relay accepts and closes at once, as a cut middlebox does: the relaying
    // instance wrote the request and cannot know the owner did not get it, so it
    // answers 504 `upstream_timeout` (outcome unknown); a connection refused
    // outright is 503 `shard_unavailable`. The destination sees nothing either way.
    for attempt in ["relay cut", "relay cut again"] {
        let r = post(b, &format!("/{lease}-ff/x"), &w, attempt).await;
        assert!(
            matches!(
                r.error_code().as_deref(),
                Some("shard_unavailable" | "upstream_timeout")
            ),
            "{}",
            String::from_utf8_lossy(&r.body)
        );
    }
    assert!(payloads_at(&rig.origin, "relay cut").is_empty());
    peer.refuse(false);
    assert_eq!(
        post(b, &format!("/{lease}-ff/x"), &w, "relayed after")
            .await
            .status,
        200
    );
}

/// The port in a test database's connection string.
fn pg_port(url: &str) -> u16 {
    url.split("port=")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no port in {url}"))
}

/// A relay that fails after the owner may have forwarded the request (the owner
/// killed while the relayed request is at the destination) answers 504
/// `upstream_timeout` — outcome unknown — never 503 `shard_unavailable`, which
/// tells the worker nothing was forwarded. Found by the cluster fault campaign.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_cut_after_the_owner_forwarded_is_not_called_unavailable() {
    skip_without_python!();
    skip_without_postgres!();
    let mut rig = Rig::start(2, 2).await;
    let map = rig.settled("two members", balanced(2, 2)).await;
    let lease = rig.leases[0].clone();
    let owner_id = map[0].clone();
    let w = rig.worker(&lease, "w").await;
    let other = rig.running().find(|m| m.id != owner_id).unwrap().fg();
    let pending = held_at_origin(
        &rig,
        other,
        &format!("/{lease}/k"),
        &w,
        "key-relayed",
        "relayed",
        "r",
    )
    .await;
    rig.member_mut(&owner_id).fg.as_mut().unwrap().kill9();
    let answer = pending
        .await
        .unwrap()
        .expect("the relaying instance answers");
    answer.assert_error(504, "upstream_timeout");
    assert_eq!(payloads_at(&rig.origin, "relayed").len(), 1);
    rig.origin.release("r");
}

/// Balance (SPEC §10.2) when a member is cut from the lease store but not from
/// the database: it stops announcing itself, so the others take its shards once
/// its gate leases expire (they reserved its share before, and its shards stayed
/// unserved for as long as the cut lasted). Found by the cluster fault campaign.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_cut_from_the_store_loses_its_shards_to_the_others() {
    skip_without_python!();
    skip_without_postgres!();
    let mut rig = Rig::start(0, 3).await;
    let relay = rig.add_behind_store_relay("fg-a").await;
    rig.add("fg-b");
    rig.add("fg-c");
    rig.settled("three members", balanced(3, 3)).await;
    relay.refuse(true);
    relay.cut();
    let b = rig.member("fg-b").fg();
    eventually("fg-b and fg-c serve every shard", || async {
        Rig::shard_map(b)
            .await
            .iter()
            .all(|o| matches!(o.as_deref(), Some("fg-b" | "fg-c")))
    })
    .await;
    let lease = &rig.leases[0];
    let w = rig.worker(lease, "w").await;
    let r = post(b, &format!("/{lease}/x"), &w, "served").await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
}

/// Issue 25, point 6 (SPEC §10.2, liveness), with real processes: the owner's
/// claim of a key passes its owner check and is held inside the database, before
/// its commit (a transaction of the test's own holds the key's row, as a slow
/// commit would: [`KeyHold`]); the owner freezes, and the other instance takes
/// the shard meanwhile. Released, the claim must not leave the key in flight
/// under the deposed generation (a 409 `dedup_in_flight` to every retry until
/// the next takeover, and nothing an operator can resolve): the takeover waits
/// for the claim and turns it in doubt. The retry through the new owner is
/// refused as in doubt, the woken owner forwards nothing, the operator resolves
/// the key as not delivered, and the destination receives it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deposed_owners_claim_held_across_a_takeover_is_left_resolvable() {
    skip_without_python!();
    skip_without_postgres!();
    const ADMIN: &str = "test-admin-token";
    let mut rig = Rig::start(0, 1).await;
    rig.server_extra = format!("admin_token = \"{ADMIN}\"");
    // State calls may wait out the hold: what ends it is the test, not a timeout.
    let patient = |c: String| c.replace("[state]\n", "[state]\ntimeout_ms = 30000\n");
    rig.add_with("fg-a", patient);
    rig.settled("fg-a owns the shard", |c| c.get("fg-a") == Some(&1))
        .await;
    rig.add_with("fg-b", patient);
    rig.settled("fg-b joined", |c| c.get("fg-a") == Some(&1))
        .await;
    let lease = rig.leases[0].clone();
    let w = rig.worker(&lease, "w").await;
    let (a, b) = (rig.member("fg-a").fg(), rig.member("fg-b").fg());
    let path = format!("/{lease}/k");
    // The lease's mark raised, so that the claim is the request's next write.
    assert_eq!(post(a, &path, &w, "warm").await.status, 200);

    let pg = PgServer::shared();
    let key = "k-across";
    let hold = KeyHold::start(&rig.db, &lease, 0, key).await;
    let pending = tokio::spawn(try_send(keyed(a, &path, &w, key, "across")));
    eventually("fg-a's claim waits inside the database", || async {
        tokio::task::block_in_place(|| pg.waits_on_a_lock(&rig.db_name, "/* fencegate: claims */"))
    })
    .await;
    freeze(a.pid());
    // fg-b takes the shard once fg-a's row has gone unrenewed for gate_ttl +
    // grace: its take either completes (the claim did not hold it up) or
    // waits for the claim (the owner row's lock).
    eventually("fg-b's takeover reaches the database", || async {
        Rig::shard_map(b).await == vec![Some("fg-b".to_owned())]
            || tokio::task::block_in_place(|| {
                pg.waits_on_a_lock(&rig.db_name, "UPDATE fencegate_owners")
            })
    })
    .await;
    hold.release().await;
    eventually("fg-b serves the shard", || async {
        Rig::shard_map(b).await == vec![Some("fg-b".to_owned())]
    })
    .await;
    let retry = || send(keyed(b, &path, &w, key, "across"));
    retry().await.assert_error(409, "dedup_in_doubt");
    let record = b.admin_json(&format!("/v1/dedup/{lease}/{key}")).await;
    assert_eq!(record["state"], "in_doubt", "{record}");

    // The deposed owner wakes past its forwarding deadline: nothing forwarded.
    signal(a, "-CONT");
    let first = pending.await.unwrap().expect("fg-a answers its worker");
    eprintln!(
        "the deposed owner answered {} {:?}",
        first.status,
        first.error_code()
    );
    // Refused (its claim failed on the newer owner), or aborted at gate_ttl
    // while its claim waited — which a woken owner does first, its deadline
    // long past (SPEC §10.2): never forwarded either way.
    assert!(
        first.status == 503 || first.error_code().as_deref() == Some("drain_aborted"),
        "{} {}",
        first.status,
        String::from_utf8_lossy(&first.body)
    );
    assert!(payloads_at(&rig.origin, "across").is_empty());

    // The operator finds nothing at the destination and says so; the retry goes.
    let resolved = send(
        http::Request::post(b.admin_url(&format!("/v1/dedup/{lease}/{key}/resolve")))
            .header("authorization", format!("Bearer {ADMIN}"))
            .body(body(r#"{"outcome": "not_delivered"}"#))
            .unwrap(),
    )
    .await;
    assert_eq!(resolved.status, 200, "{:?}", resolved.json());
    assert_eq!(retry().await.status, 200);
    assert_eq!(retry().await.headers["x-fencegate-replayed"], "true");
    assert_eq!(payloads_at(&rig.origin, "across").len(), 1);
}

/// Sends fencing-only requests of `w` through `fg` every 50 ms, numbered
/// `{tag} 0`, `{tag} 1`, …, until `stop`; returns how many were answered 200.
fn keep_sending(
    fg: &Fencegate,
    lease: &str,
    w: &Holding,
    tag: &'static str,
    stop: tokio_util::sync::CancellationToken,
) -> tokio::task::JoinHandle<usize> {
    let url = fg.url(&format!("/{lease}-ff/x"));
    let (epoch, token) = (w.epoch.get(), w.token.clone());
    tokio::spawn(async move {
        let mut ok = 0;
        for i in 0.. {
            if stop.is_cancelled() {
                break;
            }
            let req = worker_req(&url, epoch, &token)
                .body(body(&format!("{tag} {i}")))
                .unwrap();
            if let Ok(r) = try_send(req).await {
                ok += usize::from(r.status == 200);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        ok
    })
}

/// Issue 28: an owner whose renewals stop being confirmed — PostgreSQL cut
/// away (`cut`), or its replies held so that renewals commit but the owner
/// never learns it (`unknown`) — stops forwarding on its own clock; the
/// other member takes the shard only after seeing its row unchanged for
/// `gate_ttl + grace`, and nothing the old owner forwarded arrives at the
/// destination after the successor's first delivery.
async fn an_owner_losing_the_database(fault: &str) {
    let mut rig = Rig::start(0, 1).await;
    let pg = crate::support::relay::Relay::start(pg_port(&rig.db)).await;
    let via_pg = pg.url(&rig.db_name);
    let db = rig.db.clone();
    rig.add_with("fg-a", |c| c.replace(&db, &via_pg));
    rig.settled("fg-a owns the shard", |c| c.get("fg-a") == Some(&1))
        .await;
    rig.add("fg-b");
    rig.settled("fg-b joined", |c| c.get("fg-a") == Some(&1))
        .await;
    let lease = rig.leases[0].clone();
    let w = rig.worker(&lease, "w").await;
    let (a, b) = (rig.member("fg-a").fg(), rig.member("fg-b").fg());
    let stop = tokio_util::sync::CancellationToken::new();
    let old = keep_sending(a, &lease, &w, "old owner", stop.clone());
    rig.origin
        .wait_until("the old owner forwards", |log| {
            log.iter().any(|a| a.body.starts_with(b"old owner"))
        })
        .await;
    let renewals_before = pg.held_requests();
    match fault {
        "cut" => {
            pg.refuse(true);
            pg.cut();
        }
        _ => pg.hold_replies(true),
    }
    let faulted = Instant::now();
    eventually("fg-b takes the shard", || async {
        Rig::shard_map(b).await == vec![Some("fg-b".to_owned())]
    })
    .await;
    let r = post(b, &format!("/{lease}-ff/x"), &w, "successor").await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let took = faulted.elapsed();
    // The old owner keeps being asked for a while after the successor served.
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.cancel();
    let served_by_old = old.await.unwrap();
    let first_new = payloads_at(&rig.origin, "successor").remove(0).arrived;
    let late: Vec<String> = payloads_at(&rig.origin, "old owner")
        .into_iter()
        .filter(|x| x.arrived >= first_new)
        .map(|x| String::from_utf8_lossy(&x.body).into_owned())
        .collect();
    assert!(
        late.is_empty(),
        "the old owner delivered after the successor: {late:?}"
    );
    let last_old = payloads_at(&rig.origin, "old owner")
        .into_iter()
        .map(|x| x.arrived)
        .max()
        .unwrap();
    eprintln!(
        "{fault}: the old owner served {served_by_old} requests, its last {:?} before the successor's first; the successor took the shard {took:?} after the fault ({} bytes of statements held: {})",
        first_new.saturating_duration_since(last_old),
        pg.held_requests(),
        pg.held_requests() > renewals_before
    );
    // gate_ttl 6 s - margin 2 s after the last confirmed renewal's send, which
    // came at most a renew period (2 s) before the fault.
    assert!(
        first_new.saturating_duration_since(last_old) >= Duration::from_millis(2500),
        "the old owner stopped only {:?} before the successor",
        first_new.saturating_duration_since(last_old)
    );
    if fault == "unknown" {
        // fg-b waits gate_ttl + grace (6.5 s) from the last renewal it saw
        // commit: one sent while replies were held commits too, but only if
        // it got a connection (the pool's may all be waiting on held
        // replies), so that renewal is at most a renew period (2 s) before
        // the fault, never later than the last one that committed.
        assert!(took >= Duration::from_millis(4500), "{took:?}");
    }
    pg.hold_replies(false);
    pg.refuse(false);
    pg.cut();
    // Back in touch, the old owner finds its row taken and relays.
    eventually("the old owner relays to the successor", || async {
        Rig::shard_map(a).await == vec![Some("fg-b".to_owned())]
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_cut_from_the_database_self_fences_before_the_successor_serves() {
    skip_without_python!();
    skip_without_postgres!();
    an_owner_losing_the_database("cut").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_whose_commit_is_unknown_never_lets_two_owners_serve() {
    skip_without_python!();
    skip_without_postgres!();
    an_owner_losing_the_database("unknown").await;
}

/// Issue 28: expiry is never judged on the database's clock. `now()` jumps an
/// hour ahead, then two hours back (a function shadowing `pg_catalog.now()`
/// on the database's search path): no shard changes hands, requests keep
/// being served, and a kill -9 is still taken over within `gate_ttl + grace`
/// plus a look and a renew period.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_database_clock_jumping_moves_no_shard() {
    skip_without_python!();
    skip_without_postgres!();
    let mut rig = Rig::start(0, 2).await;
    let pg = PgServer::shared();
    pg.psql(
        &rig.db_name,
        &format!(
            "CREATE SCHEMA skew; CREATE TABLE skew.by (d interval NOT NULL); \
             INSERT INTO skew.by VALUES ('0'); \
             CREATE FUNCTION skew.now() RETURNS timestamptz LANGUAGE sql STABLE \
             AS 'SELECT pg_catalog.now() + (SELECT d FROM skew.by)'; \
             ALTER DATABASE \"{}\" SET search_path = public, skew, pg_catalog;",
            rig.db_name
        ),
    );
    let db_name = rig.db_name.clone();
    let jump = |by: &str| {
        pg.psql(&db_name, &format!("UPDATE skew.by SET d = '{by}'"));
    };
    jump("1 hour");
    let shown = pg.psql(
        &rig.db_name,
        "SELECT extract(epoch FROM now() - pg_catalog.now())::int",
    );
    assert!(shown.contains("3600"), "now() is shadowed: {shown}");
    jump("0");
    rig.add_at_once(&["fg-a", "fg-b"]);
    let map = rig.settled("two members", balanced(2, 2)).await;
    let moves = || async {
        let mut n = 0.0;
        for m in rig.running() {
            n += m.fg().metric_sum("fencegate_cluster_takeovers_total").await
                + m.fg().metric_sum("fencegate_cluster_handovers_total").await;
        }
        n
    };
    let before = moves().await;
    let lease = rig.leases[0].clone();
    let w = rig.worker(&lease, "w").await;
    let stop = tokio_util::sync::CancellationToken::new();
    let sender = keep_sending(rig.member("fg-a").fg(), &lease, &w, "jumping", stop.clone());
    for by in ["1 hour", "-2 hours", "10 minutes"] {
        jump(by);
        // Several renew and look periods at each reading.
        tokio::time::sleep(Duration::from_secs(8)).await;
        let v = rig.member("fg-a").fg().admin_json("/v1/cluster").await;
        eprintln!(
            "now() {by} off: shard 0 expires_at {}",
            v["shard_map"][0]["expires_at"]
        );
    }
    stop.cancel();
    let sent = sender.await.unwrap();
    assert_eq!(
        moves().await,
        before,
        "a shard changed hands while the database's clock jumped"
    );
    let sent_all = payloads_at(&rig.origin, "jumping").len();
    assert_eq!(
        sent, sent_all,
        "every request answered 200 reached the destination"
    );
    assert!(sent >= 300, "served throughout: {sent}");
    for m in rig.running() {
        assert_eq!(
            Rig::shard_map(m.fg()).await,
            map.iter().cloned().map(Some).collect::<Vec<_>>(),
            "{}'s map moved",
            m.id
        );
    }
    // A takeover still works, timed on the survivor's own clock.
    jump("-1 hour");
    let dead = map[0].clone();
    let survivor = if dead == "fg-a" { "fg-b" } else { "fg-a" };
    rig.member_mut(&dead).fg.as_mut().unwrap().kill9();
    rig.member_mut(&dead).fg = None;
    let killed = Instant::now();
    rig.sole_owner(survivor).await;
    let took = killed.elapsed();
    eprintln!("taken over {took:?} after kill -9 with now() an hour behind");
    assert!(
        took <= Duration::from_millis(6500 + 2000 + 1500),
        "{took:?}"
    );
}

/// Issue 28: the single-instance exclusion holds after the member that last
/// renewed the anchor dies: the other members keep the anchor alive, so a
/// single instance started past the anchor's TTL (even one allowed to take
/// over from another set-up) still finds the cluster and exits 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_anchor_outlives_the_member_that_renewed_it() {
    skip_without_python!();
    skip_without_postgres!();
    let mut rig = Rig::start(0, 2).await;
    rig.add_at_once(&["fg-a", "fg-b"]);
    rig.settled("two members", balanced(2, 2)).await;
    let anchor = rig.member("fg-a").fg().admin_json("/v1/cluster").await["anchor"].clone();
    let renewer = anchor["holder"].as_str().unwrap().to_owned();
    let other = if renewer == "fg-a" { "fg-b" } else { "fg-a" };
    rig.member_mut(&renewer).fg.as_mut().unwrap().kill9();
    rig.member_mut(&renewer).fg = None;
    // Past the anchor's TTL (2 × gate_ttl) plus resolution and grace.
    tokio::time::sleep(Duration::from_millis(12_000 + 1_000 + 500 + 1_000)).await;
    let (code, stderr) =
        serve_expecting_exit_with(&single_toml(&rig), &["--takeover-may-duplicate"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("2 shards"), "names the cluster: {stderr}");
    let fg = rig.sole_owner(other).await;
    let lease = rig.leases[1].clone();
    let w = rig.worker(&lease, "w").await;
    assert_eq!(
        post(fg, &format!("/{lease}-ff/x"), &w, "served")
            .await
            .status,
        200
    );
}

/// Traces across the peer hop (docs/traces.md): a request sent to the
/// instance that does not own its shard is one trace — the relaying instance's
/// request span (the worker's span its parent) and its `peer.relay` span, then
/// the owner's request span with `peer.relay` as its parent, its steps, and the
/// destination's `traceparent` naming the owner's upstream span. Each
/// instance's spans name it (`service.instance.id`); neither the lease token
/// nor the peer token is exported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relayed_request_is_one_trace_across_the_peer_hop() {
    skip_without_python!();
    skip_without_postgres!();
    let receiver = crate::support::otlp::Receiver::start(false);
    let mut rig = Rig::start(0, 2).await;
    for id in ["fg-a", "fg-b"] {
        rig.add_with(id, |c| c + &receiver.toml(""));
    }
    let map = rig.settled("two members", balanced(2, 2)).await;
    let lease = rig.leases[0].clone();
    let owner = map[0].clone();
    let relayer = rig.running().find(|m| m.id != owner).unwrap();
    let w = rig.worker(&lease, "w").await;
    let (trace, worker_span) = ("5bf92f3577b34da6a3ce929d0e0e4736", "10f067aa0ba902b7");
    let req = worker_req(
        &relayer.fg().url(&format!("/{lease}/x")),
        w.epoch.get(),
        &w.token,
    )
    .header("traceparent", format!("00-{trace}-{worker_span}-01"))
    .header("idempotency-key", "hop-key")
    .body(body("over the hop"))
    .unwrap();
    let r = send(req).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let spans = receiver.trace(trace, 2);
    let of = |id: &str| -> Vec<&crate::support::otlp::Span> {
        spans
            .iter()
            .filter(|s| s.resource("service.instance.id") == id)
            .collect()
    };
    let (here, there) = (of(&relayer.id), of(&owner));
    let request_here = here
        .iter()
        .find(|s| s.kind() == "SPAN_KIND_SERVER")
        .expect("the relaying instance's request span");
    assert_eq!(request_here.parent(), worker_span);
    assert_eq!(request_here.attr("fencegate.outcome"), "relayed");
    let relay = here
        .iter()
        .find(|s| s.name() == "peer.relay")
        .expect("the relay span");
    assert_eq!(relay.parent(), request_here.span_id());
    assert_eq!(relay.kind(), "SPAN_KIND_CLIENT");
    assert_eq!(relay.attr("fencegate.peer"), owner.as_str());
    assert_eq!(relay.attr("http.response.status_code"), 200);
    assert_eq!(
        here.len(),
        2,
        "the relaying instance admits nothing: {here:?}"
    );
    let request_there = there
        .iter()
        .find(|s| s.kind() == "SPAN_KIND_SERVER")
        .expect("the owner's request span");
    assert_eq!(request_there.parent(), relay.span_id());
    assert_eq!(request_there.attr("fencegate.outcome"), "forwarded");
    let mut names: Vec<&str> = there.iter().map(|s| s.name()).collect();
    names.sort();
    assert_eq!(
        names,
        [
            format!("POST /{lease}/").as_str(),
            "admission",
            "dedup.claim",
            "dedup.outcome",
            "upstream"
        ]
    );
    for s in there.iter().filter(|s| s.kind() != "SPAN_KIND_SERVER") {
        assert_eq!(s.parent(), request_there.span_id(), "{s:?}");
    }
    let admission = there.iter().find(|s| s.name() == "admission").unwrap();
    assert_eq!(admission.attr("fencegate.relayed"), true);
    let upstream = there.iter().find(|s| s.name() == "upstream").unwrap();
    let arrived = &payloads_at(&rig.origin, "over the hop")[0];
    assert_eq!(
        arrived.header("traceparent"),
        Some(format!("00-{trace}-{}-01", upstream.span_id()))
    );
    let raw = receiver.raw();
    for secret in [w.token.as_str(), PEER_TOKEN, "hop-key"] {
        assert!(
            !raw.windows(secret.len()).any(|x| x == secret.as_bytes()),
            "{secret:?} was exported"
        );
    }
}

/// SPEC §10.2, the owner hint: every answer of a member names the `advertise`
/// URL of the lease's owner (`X-Fencegate-Owner`) — served there or relayed —
/// and a request sent straight to it is not relayed. A destination's own
/// `X-Fencegate-Owner` never reaches the worker: it would steer the next
/// request, and its token, elsewhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_answer_names_the_leases_owner_and_the_hint_skips_the_relay() {
    skip_without_python!();
    skip_without_postgres!();
    let rig = Rig::start(2, 1).await;
    let map = rig
        .settled("two members, one shard", |c| c.len() == 1)
        .await;
    let owner = rig.member(&map[0]).fg();
    let other = rig.running().find(|m| m.id != map[0]).unwrap().fg();
    let lease = rig.leases[0].clone();
    let w = rig.worker(&lease, "w").await;
    let owner_url = owner.url("").trim_end_matches('/').to_owned();
    for (fg, payload) in [(owner, "direct"), (other, "relayed")] {
        let r = post(fg, &format!("/{lease}/x"), &w, payload).await;
        assert_eq!(r.status, 200, "{payload}");
        assert_eq!(
            r.headers["x-fencegate-owner"],
            owner_url.as_str(),
            "{payload}"
        );
    }
    let relays = other.metric_sum("fencegate_peer_forwards_total").await;
    assert!(relays >= 1.0, "the request to the non-owner was relayed");
    // Straight to the hint: served there, nothing relayed.
    let hinted = Gatewayless(owner_url.clone());
    let r = send(
        worker_req(&hinted.url(&format!("/{lease}/x")), w.epoch.get(), &w.token)
            .body(body("hinted"))
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(
        other.metric_sum("fencegate_peer_forwards_total").await,
        relays
    );
    // A destination claiming to be the owner is not believed.
    let r = send(
        worker_req(&other.url(&format!("/{lease}/x")), w.epoch.get(), &w.token)
            .header("x-test-claims-owner", "http://evil.example")
            .body(body("spoof"))
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.headers["x-fencegate-owner"], owner_url.as_str());
    assert_eq!(payloads_at(&rig.origin, "hinted").len(), 1);
}

/// A base URL as a worker would hold it.
struct Gatewayless(String);

impl Gatewayless {
    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.0)
    }
}
