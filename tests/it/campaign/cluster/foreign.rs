//! The foreign set-up steps of the cluster campaign (issue 25, point 2): a set-up
//! that must never serve beside the cluster is started against its prefix at
//! the moment that used to let it in.
//!
//! 16 s into the faults (after the directed step) and every 60 s: a single
//! instance (sled state, a fresh `data_dir`), then an instance of another shard
//! count (2, 4 or 5 shards; same store, prefix, database and peer token), each
//! while shard 0 is free. Shard 0's owner gets SIGTERM; as soon as shard 0's
//! latest gate object is its release (tens of ms), the other members are frozen
//! (SIGSTOP; their store relays cut, so that the single-threaded S3 server is
//! not held by a call they were in the middle of) so that none takes shard 0
//! back, and the foreign process is started with its address already in the
//! workers' `proxy.addr` (three lines of six: half the requests go to it). The
//! single instance is then started once more with `--takeover-may-duplicate`
//! (not in `proxy.addr`) if the freeze is still under 2 s: the cluster's gate
//! leases are surely live, and its own look at the other shards after taking
//! shard 0 must find them. The others resume (a freeze of 0.1–0.3 s); shard 0's
//! old owner is restarted once the step is over.
//!
//! Expected: every start exits 2, logged in the timeline with its reason. A
//! process let in (a build that does not refuse it) serves beside the cluster
//! for [`FOREIGN_SERVES`], then gets SIGTERM.
//!
//! After each step, the **split-brain probe**: the directed worker acquires
//! `l20` or `l18` (shard 4 or 2 of the cluster, shard 0 of every foreign shard
//! count; whichever a running member serves; 3 s route and 2 s drain timeouts),
//! polls the foreign process and that member with it until the origin answers,
//! sends the foreign process one more poll with it that the origin holds,
//! renews, and polls the member with the newer epoch. Two set-ups serving one
//! lease each drain only their own requests: the member forwards the newer
//! epoch while the older one is still at the destination, well within the
//! drain timeout: R2. When the foreign process was refused, the probe runs
//! through two members instead, once per run (the control: one fence, so the
//! raise waits out the drain timeout: exempt).

use super::*;

/// The foreign set-up steps (module doc): the first single instance this long
/// after the faults start, the other shard count right after it, both again
/// this long after the last one.
pub(super) const FOREIGN_FIRST: Duration = Duration::from_secs(16);
pub(super) const FOREIGN_EVERY: Duration = Duration::from_secs(60);
/// How long a foreign process that was let in serves beside the cluster before
/// the step stops it.
pub(super) const FOREIGN_SERVES: Duration = Duration::from_secs(8);
/// The shard counts a foreign cluster instance may have: each puts `l0`, `l2`
/// (or `l3`) into its shard 0, which it can take while the step holds it free.
pub(super) const FOREIGN_SHARDS: [u32; 3] = [2, 4, 5];
/// The split-brain probe's leases (module doc), held by the directed worker
/// alone, each with its route `r{n}`: in the cluster's shard 4 (with `l0` and
/// `l2`) and shard 2 (with `l3`), and in shard 0 of every foreign shard count,
/// with a long drain timeout. The probe takes the one whose shard a running
/// member serves (shard 0's owner may have held the other).
pub(super) const SPLIT_LEASES: [&str; 2] = ["l20", "l18"];
pub(super) const SPLIT_ROUTE: RouteConf = RouteConf {
    timeout_ms: 3000,
    drain_timeout_ms: 2000,
};

/// What a foreign set-up step starts against the cluster's prefix (module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ForeignKind {
    /// A single instance (sled state) on the same store and prefix.
    Single,
    /// A cluster instance of another shard count (same store, prefix, database
    /// and peer token).
    OtherShards,
}

impl ForeignKind {
    pub(super) fn name(self) -> &'static str {
        match self {
            ForeignKind::Single => "single instance beside the cluster",
            ForeignKind::OtherShards => "instance of another shard count",
        }
    }
}

/// Where the foreign set-up steps are.
pub(super) enum Foreign {
    /// The next step, of this kind, is due at this instant.
    Idle(Instant, ForeignKind),
    /// Step `n`'s foreign process was refused (`fg` is `None`) or let in: then
    /// it serves beside the cluster, in the workers' `proxy.addr`, until
    /// `until`, and `down`, the stopped owner of shard 0, is restarted once it is
    /// gone. `probe`: the split-brain probe's command number and start, while it
    /// runs.
    Active {
        kind: ForeignKind,
        n: usize,
        fg: Option<Box<Fencegate>>,
        down: usize,
        until: Instant,
        probe: Option<(u32, Instant)>,
    },
    /// The faults are over: no new step.
    Over,
}

/// How a foreign process that did not start ended ("exit 2").
fn exit_of(fg: &Fencegate) -> String {
    match fg.last_exit.and_then(|s| s.code()) {
        Some(c) => format!("exit {c}"),
        None => format!("{:?}", fg.last_exit),
    }
}

/// The last line of a refused process's stderr: its reason.
fn last_line(stderr: &str) -> String {
    stderr
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or_default()
        .chars()
        .take(400)
        .collect()
}

fn kind_tag(kind: ForeignKind) -> &'static str {
    match kind {
        ForeignKind::Single => "single",
        ForeignKind::OtherShards => "shards",
    }
}

impl ClusterNemesis<'_> {
    /// The foreign set-up steps (module doc), one move per call.
    pub(super) fn foreign_step(&mut self) {
        let now = Instant::now();
        match &self.foreign {
            Foreign::Over => {}
            Foreign::Active {
                kind,
                n,
                fg,
                probe,
                until,
                ..
            } => {
                let (kind, n, let_in, until) = (*kind, *n, fg.is_some(), *until);
                match *probe {
                    Some((pn, since)) => self.probe_answer(kind, n, pn, since, let_in),
                    None if now >= until => self.end_foreign(),
                    None => {}
                }
            }
            Foreign::Idle(at, kind) => {
                let (at, kind) = (*at, *kind);
                let directed_busy = match self.directed {
                    Directed::Idle(d) => now >= d,
                    Directed::Over => false,
                    _ => true,
                };
                let all_healthy = (0..self.instances.len()).all(|i| self.healthy(i));
                if now < at
                    || now < self.quiet_until
                    || now < self.foreign_look
                    || directed_busy
                    || !all_healthy
                {
                    return;
                }
                self.foreign_look = now + Duration::from_millis(200);
                if let Some(o0) = self.shard_owner(0) {
                    self.start_foreign(kind, o0);
                }
            }
        }
    }

    /// A foreign set-up started against the prefix while shard 0 is free: the
    /// other instances frozen (short of their self-fence), shard 0's owner
    /// stopped gracefully (its release makes the shard free), the foreign process
    /// started with its address already in the workers' `proxy.addr`, the others
    /// resumed. A refusal (exit 2) is the expected outcome; a process let in
    /// serves beside the cluster for [`FOREIGN_SERVES`]. Then the split-brain
    /// probe.
    fn start_foreign(&mut self, kind: ForeignKind, o0: usize) {
        let others: Vec<usize> = (0..self.instances.len()).filter(|&i| i != o0).collect();
        self.scrape(o0);
        // SIGTERM: shard 0's owner hands its shards over (release objects)
        // while it drains; the others are frozen as soon as shard 0 is free, so
        // that none takes it (and not longer than the foreign start-up).
        let stopping = Instant::now();
        self.signal(o0, "-TERM");
        while !self.shard0_released() && stopping.elapsed() < Duration::from_secs(6) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let released = stopping.elapsed();
        let frozen = Instant::now();
        for &i in &others {
            self.signal(i, "-STOP");
            // Frozen in the middle of a store call, it would hold the
            // single-threaded S3 server: its connections end (its own relay).
            self.instances[i].store.refuse(true);
            self.instances[i].store.cut();
        }
        // Restarted once the step is over (a cluster member does not start
        // beside a live foreign set-up).
        self.instances[o0].down_until = Some(frozen + Duration::from_secs(3600));
        let n = self.foreign_done.get(kind.name()).copied().unwrap_or(0) + 1;
        let detail = format!(
            "{n}: SIGTERM {} (shard 0's owner), shard 0 released {} ms later; {} frozen",
            self.instances[o0].id,
            released.as_millis(),
            others
                .iter()
                .map(|&i| self.instances[i].id.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
        self.note(&format!("{}: shard 0 made free", kind.name()), detail);
        let port = free_port();
        let addr = format!("127.0.0.1:{port}");
        self.write_addrs(Some(&addr));
        let (config, label) = match kind {
            ForeignKind::Single => (self.single_toml(), "sled state".to_owned()),
            ForeignKind::OtherShards => {
                let shards = FOREIGN_SHARDS[self.rng.gen_range(0..FOREIGN_SHARDS.len())];
                let id = format!("fg-x{n}");
                (
                    self.cluster_toml(&id, &addr, shards),
                    format!("{id}, {shards} shards"),
                )
            }
        };
        let mut fg = Fencegate::unstarted_with_args(&addr, "", &config, &[], &[]);
        let started = fg.spawn(None);
        let took = frozen.elapsed();
        let refused = started.is_err();
        match started {
            Err(stderr) => {
                self.write_addrs(None);
                let detail = format!(
                    "{n}: {label}, {} after {} ms: {}",
                    exit_of(&fg),
                    took.as_millis(),
                    last_line(&stderr)
                );
                self.note(&format!("{}: refused", kind.name()), detail);
                fs::write(
                    self.dir
                        .join(format!("foreign-{}-{n}.stderr", kind_tag(kind))),
                    stderr,
                )
                .unwrap();
            }
            Ok(()) => {
                let detail = format!(
                    "{n}: {label}, serving at {addr} after {} ms; half the requests go to it",
                    took.as_millis()
                );
                self.note(&format!("{}: LET IN", kind.name()), detail);
            }
        }
        // The operator's override, while the cluster's gate leases are surely
        // live (its own checks of the other shards come after its create): it
        // must still find them, give shard 0 back and exit 2. Not in the
        // workers' `proxy.addr`: had the cluster's leases ended, taking over
        // with duplicates allowed would be legitimate.
        if kind == ForeignKind::Single && refused && frozen.elapsed() < Duration::from_millis(2000)
        {
            let addr2 = format!("127.0.0.1:{}", free_port());
            let mut forced = Fencegate::unstarted_with_args(
                &addr2,
                "",
                &self.single_toml(),
                &[],
                &["--takeover-may-duplicate"],
            );
            let kind2 = "single instance beside the cluster, --takeover-may-duplicate";
            match forced.spawn(None) {
                Err(stderr) => {
                    let detail = format!(
                        "{n}: {} after {} ms: {}",
                        exit_of(&forced),
                        frozen.elapsed().as_millis(),
                        last_line(&stderr)
                    );
                    self.note(&format!("{kind2}: refused"), detail);
                }
                Ok(()) => {
                    let status = forced.terminate();
                    let detail = format!(
                        "{n}: serving after {} ms, stopped at once ({status})",
                        frozen.elapsed().as_millis()
                    );
                    self.note(&format!("{kind2}: LET IN"), detail);
                }
            }
        }
        for &i in &others {
            self.instances[i].store.refuse(false);
            self.signal(i, "-CONT");
        }
        let resumed = frozen.elapsed();
        let status = self.instances[o0].fg.wait_exit();
        let detail = format!(
            "{n}: the others resumed after {} ms; {} {status}",
            resumed.as_millis(),
            self.instances[o0].id
        );
        self.note(&format!("{}: others resumed", kind.name()), detail);
        self.quiet();
        *self.foreign_done.entry(kind.name()).or_default() += 1;
        let now = Instant::now();
        // The split-brain probe: a poll held at the destination through the
        // foreign process (one let in), or through a member (the control: one
        // set-up, once per run), then the lease's next epoch through another
        // member.
        let control = refused && self.events.contains_key("(split-brain probes)");
        if control {
            self.foreign = Foreign::Active {
                kind,
                n,
                fg: None,
                down: o0,
                until: now,
                probe: None,
            };
            return;
        }
        // `second`: a member that serves the probe lease's shard, as it says.
        let (lease, owner) = SPLIT_LEASES
            .iter()
            .find_map(|l| {
                let m = others.iter().copied().find(|&i| {
                    self.served(i)
                        .is_some_and(|sh| sh.iter().flatten().any(|x| x == l))
                })?;
                Some((*l, m))
            })
            .unwrap_or((SPLIT_LEASES[0], *others.last().unwrap_or(&o0)));
        let first = if refused {
            // The control: through the other member (which relays).
            let other = others
                .iter()
                .copied()
                .find(|&i| i != owner)
                .unwrap_or(owner);
            self.instances[other].fg.proxy.to_string()
        } else {
            addr.clone()
        };
        let second = self.instances[owner].fg.proxy.to_string();
        let pn = 1000
            + self
                .events
                .get("(split-brain probes)")
                .copied()
                .unwrap_or(0) as u32
            + 1;
        *self
            .events
            .entry("(split-brain probes)".into())
            .or_default() += 1;
        self.command(format!("{pn} split {first} {second} s{pn} {lease}"));
        self.foreign = Foreign::Active {
            kind,
            n,
            fg: (!refused).then(|| Box::new(fg)),
            down: o0,
            until: if refused { now } else { now + FOREIGN_SERVES },
            probe: Some((pn, now)),
        };
    }

    /// The split-brain probe's answer, once there is one (bounded): its held
    /// poll is released.
    fn probe_answer(&mut self, kind: ForeignKind, n: usize, pn: u32, since: Instant, let_in: bool) {
        let answer = self.answer(pn);
        let done = answer
            .as_ref()
            .is_some_and(|w| w.first().is_some_and(|v| v == "split"));
        if !done && since.elapsed() < Duration::from_secs(20) {
            return;
        }
        self.release_hold(&format!("s{pn}"));
        let how = answer.map_or("no answer within 20 s".to_owned(), |w| w[1..].join(" "));
        let through = if let_in {
            "held through the foreign process, newer epoch through a member"
        } else {
            "control: held through one member, newer epoch through another"
        };
        self.note(
            &format!("{}: split-brain probe", kind.name()),
            format!("{n}: {through}: {how}"),
        );
        if let Foreign::Active { probe, .. } = &mut self.foreign {
            *probe = None;
        }
    }

    /// Ends a foreign step: a process that was let in is stopped, and shard 0's
    /// owner restarted (after the probe in any case).
    fn end_foreign(&mut self) {
        let Foreign::Active {
            kind, n, fg, down, ..
        } = std::mem::replace(&mut self.foreign, Foreign::Over)
        else {
            return;
        };
        if let Some(mut fg) = fg {
            self.write_addrs(None);
            let status = if fg.exited() {
                "had exited".to_owned()
            } else {
                fg.terminate().to_string()
            };
            fs::write(
                self.dir
                    .join(format!("foreign-{}-{n}.stderr", kind_tag(kind))),
                fg.stderr(),
            )
            .unwrap();
            self.note(
                &format!("{}: stopped after serving", kind.name()),
                format!("{n}: SIGTERM: {status}"),
            );
        }
        // Only now: a restart's rebalancing would hold the probe's polls up.
        self.instances[down].down_until = Some(Instant::now());
        self.foreign = self.next_foreign(kind);
    }

    /// The step after one of `kind`: the other shard count right after a single
    /// instance, the next single instance a while later.
    fn next_foreign(&self, kind: ForeignKind) -> Foreign {
        match kind {
            ForeignKind::Single => Foreign::Idle(Instant::now(), ForeignKind::OtherShards),
            ForeignKind::OtherShards => {
                Foreign::Idle(Instant::now() + FOREIGN_EVERY, ForeignKind::Single)
            }
        }
    }

    /// A single instance's config on the cluster's store and prefix (sled state
    /// in its own fresh `data_dir`).
    fn single_toml(&self) -> String {
        format!(
            "{}gate_ttl = \"6s\"\nself_fence_margin = \"2s\"\n\n{}",
            self.store_toml, self.routes
        )
    }

    /// A cluster instance's config on the cluster's store, prefix, database and
    /// peer token, with `shards` shards.
    fn cluster_toml(&self, id: &str, addr: &str, shards: u32) -> String {
        format!(
            "{}gate_ttl = \"6s\"\nself_fence_margin = \"2s\"\n{}[cluster]\ninstance_id = \"{id}\"\nadvertise = \"http://{addr}\"\nshards = {shards}\npeer_token = \"{PEER_TOKEN}\"\n\n{}",
            self.store_toml,
            state_toml(&self.db, ""),
            self.routes
        )
    }
}
