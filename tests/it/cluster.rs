//! SPEC §10.2, a cluster: several fencegate processes on one S3 lease store (the
//! moto test server) and one PostgreSQL database, each serving the shards whose
//! gate leases it holds and relaying the others' requests to their owners.
//!
//! Short gate leases (6 s, renewed every 2 s, self-fence margin 2 s, grace
//! 500 ms) keep takeovers within seconds while leaving a loaded two-core machine
//! a renewal's worth of slack.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use crate::support::postgres::PgServer;
use crate::support::*;
use fencegate::cluster::shard_of;
use fencegate::epoch::{Epoch, EpochObject, LeaseName};
use fencegate::lease::acquire::Holding;
use fencegate::lease::Epochs;

macro_rules! skip_without_postgres {
    () => {
        if !$crate::support::postgres::available_or_skip() {
            return;
        }
    };
}

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
pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A cluster on one store and database, with one route per lease (`/l0/` → lease
/// `l0`, and so on) to one recording origin.
struct Rig {
    s3: S3Server,
    db: String,
    origin: Origin,
    shards: u32,
    leases: Vec<String>,
    members: Vec<Member>,
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
        let db = PgServer::shared().database();
        let mut rig = Rig {
            s3,
            db,
            origin,
            shards,
            leases: leases_per_shard(shards),
            members: Vec::new(),
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
                route_toml(
                    l,
                    l,
                    &self.origin,
                    "timeout_ms = 10000\ndrain_timeout_ms = 1000\n",
                )
            })
            .collect();
        format!(
            "{}gate_ttl = \"6s\"\nself_fence_margin = \"2s\"\n{}[cluster]\ninstance_id = \"{id}\"\nadvertise = \"http://127.0.0.1:{port}\"\nshards = {}\npeer_token = \"{PEER_TOKEN}\"\n\n{routes}",
            self.s3
                .store_toml(200)
                .replace("timeout_ms = 1500", "timeout_ms = 1000"),
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
        let port = free_port();
        let fg = Fencegate::start_listening(
            &format!("127.0.0.1:{port}"),
            "",
            &edit(self.config(id, port)),
            &[],
        );
        self.members.push(Member {
            id: id.to_owned(),
            fg: Some(fg),
        });
    }

    /// [`Rig::add`] with the member reaching the S3 server through a TCP relay
    /// the test can cut.
    async fn add_behind_store_relay(&mut self, id: &str) -> crate::support::relay::Relay {
        let s3 = self.s3.endpoint.clone();
        let s3_port: u16 = s3.rsplit(':').next().and_then(|p| p.parse().ok()).unwrap();
        let relay = crate::support::relay::Relay::start(s3_port).await;
        let via = format!("http://127.0.0.1:{}", relay.addr.port());
        self.add_with(id, |c| c.replace(&s3, &via));
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

    async fn worker(&self, lease: &str, holder: &str) -> Holding {
        let epochs = self.s3.epochs().await;
        acquire(&epochs, lease, holder, Duration::from_secs(60)).await
    }
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
    }
    assert_eq!(payloads_at(&rig.origin, "keyed").len(), 1);
    let mut relayed = 0.0;
    for m in rig.running() {
        relayed += m.fg().metric_sum("fencegate_peer_forwards_total").await;
    }
    assert!(relayed >= 6.0, "requests were relayed to owners: {relayed}");
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
    rig.settled("three members", balanced(8, 3)).await;
    eprintln!(
        "balanced over 3 members {:?} after the joins",
        joined.elapsed()
    );
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
    // No successor's gate epoch began before the dead owner's last one expired
    // (plus grace): LastModified to LastModified, on the store's clock.
    let gates = Epochs::new(rig.s3.store().await, format!("{PREFIX}.gate/"));
    let mut checked = 0;
    for shard in 0..8 {
        let name = fencegate::cluster::shard_name(shard);
        let latest = gates.latest_after(&name, Epoch::NONE).await.unwrap();
        let mut dead_last = None;
        for e in 1..=latest.get() {
            match gates.read(&name, Epoch::new(e)).await.unwrap() {
                Some(EpochObject::Acquire {
                    holder, expires_at, ..
                }) => {
                    if holder == "fg-b" {
                        dead_last = Some(expires_at);
                    } else if let Some(dead) = dead_last.take() {
                        let gap = expires_at.duration_since(dead).unwrap_or_default();
                        assert!(
                            gap >= Duration::from_secs(6),
                            "shard {shard}: epoch {e} of {holder} created {gap:?} after fg-b's last"
                        );
                        checked += 1;
                    }
                }
                _ => dead_last = None,
            }
        }
    }
    assert!(checked >= 2, "fg-b's shards were taken over: {checked}");
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
    let mut held = keyed(owner, &format!("/{lease}/k"), &w, "key-held", "held");
    held.headers_mut()
        .insert("x-test-hold", "h".parse().unwrap());
    let pending = tokio::spawn(try_send(held));
    rig.origin.wait_for(1).await;
    rig.member_mut(&owner_id).fg.as_mut().unwrap().kill9();
    assert!(
        pending.await.unwrap().is_err(),
        "the worker lost its answer"
    );
    rig.member_mut(&owner_id).fg = None;
    let survivor = rig.member(&other_id).fg();
    eventually("the survivor takes the dead owner's shard", || async {
        Rig::shard_map(survivor)
            .await
            .iter()
            .all(|o| o.as_deref() == Some(other_id.as_str()))
    })
    .await;
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
    let mut held = keyed(a, &format!("/{lease}/k"), &w, "key-cut", "cut off");
    held.headers_mut()
        .insert("x-test-hold", "cut".parse().unwrap());
    let pending = tokio::spawn(try_send(held));
    rig.origin.wait_for(1).await;
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
    let pid = frozen.fg().pid().to_string();
    assert!(std::process::Command::new("kill")
        .args(["-STOP", &pid])
        .status()
        .unwrap()
        .success());
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
    assert!(std::process::Command::new("kill")
        .args(["-CONT", &pid])
        .status()
        .unwrap()
        .success());
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
        stderr.contains("\"single\""),
        "names the single instance's mode: {stderr}"
    );
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
    let mut held = keyed(other, &format!("/{lease}/k"), &w, "key-relayed", "relayed");
    held.headers_mut()
        .insert("x-test-hold", "r".parse().unwrap());
    let pending = tokio::spawn(try_send(held));
    rig.origin.wait_for(1).await;
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
