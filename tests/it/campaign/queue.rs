//! The campaigns' queued route (SPEC §11), shared by the single-instance
//! campaign (`r4` on `l4`) and the cluster campaign (`r36` on `l36`): its
//! TOML, its own workers, the final wait until the queue drained, the
//! messages read from the admin API at the end, and its lines of the report.
//!
//! The route is `delivery = "queued"`, signing (every attempt carries
//! `webhook-id`), with the retry schedule 200 ms … 3 s so that a message
//! retried across the faults settles within the run, and a 1 s timeout: the
//! origin's slowest common answer, so that 3% of the attempts time out
//! (unknown outcomes), more in the slow windows. Two workers contend for its
//! lease alone, at a slower pace (a pause of 0.3 s on average before each
//! operation), and log each `202` with the message's key, epoch and `seq`;
//! they send no polls (a GET on a queued route is a message too, under the
//! key of its content). The checker judges the route by Q1–Q4
//! ([`checker::queued`]).

use std::collections::BTreeSet;
use std::net::SocketAddr;

use super::*;

const QUEUED_TIMEOUT_MS: u64 = 1000;
const QUEUED_SCHEDULE: &str = r#"["200ms", "400ms", "800ms", "1600ms", "3s"]"#;
const WEBHOOK_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
/// Workers on the queued lease alone (besides the others, which do not send
/// to it), and their mean pause before each operation (s).
pub(super) const QUEUED_WORKERS: usize = 2;
const QUEUED_THINK_S: f64 = 0.3;
/// How long a campaign waits, after healing, for the queue to drain.
const DRAIN_WAIT: Duration = Duration::from_secs(30);

/// A campaign's queued route: `route` on its own `lease` (`r` and the lease's
/// digits: scripts/campaign/worker.py names a lease's route so).
#[derive(Debug, Clone, Copy)]
pub(super) struct Queued {
    pub route: &'static str,
    pub lease: &'static str,
}

impl Queued {
    /// The route's TOML.
    pub fn toml(&self, origin_addr: &str) -> String {
        let Queued { route, lease } = self;
        format!(
            "\n[[route]]\nname = \"{route}\"\npath_prefix = \"/{route}/\"\nupstream = \"http://{origin_addr}/{route}/\"\nlease = \"{lease}\"\ntimeout_ms = {QUEUED_TIMEOUT_MS}\ndrain_timeout_ms = 1000\ndelivery = \"queued\"\nretry = {{ schedule = {QUEUED_SCHEDULE} }}\nsigning_secrets = [\"{WEBHOOK_SECRET}\"]\n"
        )
    }

    /// The route's [`QUEUED_WORKERS`] workers, ids `first` on (`extra`: more
    /// worker.py arguments).
    pub fn workers(
        &self,
        dir: &Path,
        s3: &S3Server,
        (secs, seed): (u64, u64),
        first: usize,
        extra: &[&str],
    ) -> Vec<Proc> {
        let think = QUEUED_THINK_S.to_string();
        (first..first + QUEUED_WORKERS)
            .map(|i| {
                let mut args = vec![
                    "--leases",
                    self.lease,
                    "--short-ttl",
                    "0",
                    "--think",
                    &think,
                ];
                args.extend(extra);
                start_worker(dir, i, s3, secs, seed * 100 + i as u64, &args)
            })
            .collect()
    }

    /// The route's keys seen so far: what the workers sent it, and what
    /// reached the destination on it (at or after `since`, mono ns).
    pub fn keys(&self, dir: &Path, since: u64) -> BTreeSet<String> {
        let mut keys = BTreeSet::new();
        let prefix = format!("/{}/", self.route);
        // Read while the origin may be writing: a line cut short is skipped.
        let text = fs::read_to_string(dir.join("origin.jsonl")).unwrap_or_default();
        let lines = text
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok());
        for v in lines {
            if v["ev"] == "arrive"
                && v["arrive"].as_u64().unwrap_or_default() >= since
                && v["path"].as_str().is_some_and(|p| p.starts_with(&prefix))
            {
                keys.extend(s(&v["key"]));
            }
        }
        if since == 0 {
            for entry in fs::read_dir(dir).into_iter().flatten().flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                if name.starts_with('w') && name.ends_with(".jsonl") {
                    for v in json_lines(&entry.path()) {
                        if v["ev"] == "attempt" && v["route"] == self.route {
                            keys.extend(s(&v["key"]).filter(|k| !k.is_empty()));
                        }
                    }
                }
            }
        }
        keys
    }

    /// The messages of `keys` as fencegate's admin API shows them (a key it
    /// does not hold is left out); `None` if it stopped answering.
    pub fn messages(
        &self,
        admin: SocketAddr,
        keys: &BTreeSet<String>,
    ) -> Option<BTreeMap<(String, String), checker::Message>> {
        let mut out = BTreeMap::new();
        for key in keys {
            let path = format!("/v1/deliveries/{}/{key}", self.route);
            let mut tries = 0;
            let v = loop {
                match admin_json(admin, &path) {
                    Ok(v) => break Some(v),
                    Err(e) if e == "404" => break None,
                    Err(_) if tries < 10 => {
                        tries += 1;
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    Err(_) => return None,
                }
            };
            let Some(v) = v else { continue };
            let n = |f: &str| v[f].as_u64().unwrap_or_default();
            out.insert(
                (self.route.to_owned(), key.clone()),
                checker::Message {
                    seq: n("seq"),
                    epoch: n("epoch"),
                    status: s(&v["status"]).unwrap_or_default(),
                    attempts: n("attempts"),
                    unknown_outcomes: n("unknown_outcomes"),
                },
            );
        }
        Some(out)
    }

    /// Waits (bounded) until no message is pending or being delivered (SPEC
    /// §11: every accepted message is delivered, or fails, by the end), as
    /// the first of `admins` that answers says (in a cluster every instance
    /// reads the database). `Ok`: how long it took; `Err`: the failure.
    pub fn wait_drained(&self, admins: &[SocketAddr]) -> Result<Duration, String> {
        let started = Instant::now();
        let mut left = String::new();
        while started.elapsed() < DRAIN_WAIT {
            let total = |admin: SocketAddr, status: &str| {
                admin_json(
                    admin,
                    &format!(
                        "/v1/deliveries?route={}&status={status}&limit=1",
                        self.route
                    ),
                )
                .ok()
                .and_then(|v| v["total"].as_u64())
            };
            let answers = admins
                .iter()
                .map(|&a| (total(a, "pending"), total(a, "delivering")));
            let mut last = (None, None);
            for answer in answers {
                last = answer;
                if let (Some(_), Some(_)) = answer {
                    break;
                }
            }
            match last {
                (Some(0), Some(0)) => return Ok(started.elapsed()),
                (p, d) => left = format!("pending {p:?}, delivering {d:?}"),
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        Err(format!(
            "the queue did not drain in {} s after the faults healed: {left}",
            DRAIN_WAIT.as_secs()
        ))
    }

    /// The route's lines of the report.
    pub fn print(&self, q: &checker::queued::Figures) {
        println!(
            "queued route {} (Q1-Q4): {} arrivals of {} messages, {} epochs, {} first arrivals compared in seq order, {} epoch changes; repeats after a retried answer {}, after an unknown outcome {} ({} unknown outcomes counted); {} segments, {} messages accepted by a copy whose state was thrown away",
            self.route,
            q.arrivals,
            q.messages_at_destination,
            q.epochs_at_destination,
            q.ordered_firsts,
            q.epoch_changes,
            q.again_after_answer,
            q.again_after_unknown,
            q.unknown_outcomes,
            q.segments,
            q.accepted_by_copy,
        );
        print_counts("  messages answered 202, by status at the end", &q.accepted);
    }

    /// Why the run checked too little of the queue to count, if it did.
    pub fn unexercised(&self, q: &checker::queued::Figures) -> Option<String> {
        let accepted: usize = q.accepted.values().sum();
        (accepted < 10 || q.epoch_changes < 2).then(|| {
            format!(
                "only {accepted} messages accepted on the queued route {} and {} epoch changes among its arrivals: the campaign did not exercise the queue",
                self.route, q.epoch_changes
            )
        })
    }
}

/// The queued route's part of a run: its messages at the end, and the forks
/// of its state (the single instance's clone step; never in a cluster).
pub(super) struct QueueRun {
    pub queued: Queued,
    pub messages: BTreeMap<(String, String), checker::Message>,
    pub forks: Vec<checker::Fork>,
}
