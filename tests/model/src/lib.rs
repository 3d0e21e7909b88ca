//! A `stateright` model of fencegate's protocol (SPEC §2, §4–§6, §10): the
//! fence and its drain, dedup records, the gate leases of a cluster's shard,
//! self-fencing, takeover and settling — checked exhaustively for small bounds.
//!
//! It models the *protocol*, not the code: one shard holding one or two leases
//! ([`Cfg::leases`]), each with its own worker epochs in a lease store with
//! conditional create and a `LastModified` of `lm_res` ticks' resolution, its own
//! fence (mark, barrier, settle, raise and drain; its mark and drained-through
//! epoch in the state store) and its own requests at the destination; one to
//! three fencegate instances holding the shard's gate lease, a PostgreSQL-like
//! state store whose writes are conditioned on the writer's gate epoch (one per
//! shard), and a destination that records each request's arrival and
//! completion. [`Cfg`] holds the bounds, the nemesis budget and the [`Holes`] —
//! switches that put back the designs the code had before its edges were fixed,
//! so each property can be shown to fail without its mechanism.
//!
//! Time is a global tick counter (the store's clock). An instance's monotonic
//! clock runs at the same rate; a *pause* stops the instance for a number of
//! ticks (it acts on nothing, and its timers fire late). Every instance step is
//! *urgent*: time does not advance while a running instance has something to do
//! (a write after its check, a timeout that is due, a renewal, a takeover), so
//! every delay the checker explores is one of the nemesis's: a pause, a late
//! store response (`store_delay`), a slow or silent destination, a worker that
//! sends late. Message pairs and how they appear here:
//!
//! - worker → fencegate: a request is sent at any tick, or never (loss); a peer
//!   hop (non-owner → owner) is the same as a late send, the owner decides.
//! - fencegate → lease store: a gate create is applied up to `store_delay`
//!   ticks after it was sent and confirmed up to `store_delay` ticks later (an
//!   uncertain result read back); an instance may lose the store for good (its
//!   renewals fail: `store_cuts`, or `renew = false` for every tenure);
//!   fencegate → state store: every write is conditioned on the gate epoch at
//!   the moment it commits.
//! - fencegate → destination: the write starts in the tick of the check unless
//!   the instance pauses; a delay before it counts as a pause (the limit of
//!   SPEC §10.2 is about exactly this stall). By default the write is whole in
//!   that tick; with [`Cfg::long_writes`] it lasts (a long upload) until the
//!   request is answered, aborted or times out — the destination may then
//!   complete it at any later time.
//! - destination → fencegate: a response arrives at any time, never (loss, then
//!   the route timeout), or the destination never answers.
//!
//! Leaving the shard: an owner forwards nothing later than `gate_ttl − margin`
//! after it sent its latest gate create, and at `gate_ttl` aborts every request
//! in flight of every lease of the shard — one deadline for the shard, whatever
//! the number of leases. [`Holes::sequential_close`] puts back the design that
//! issue 25 (point 1) found: the fences closed one after another from
//! `gate_ttl − margin`, each close with a deadline of `margin` from when it was
//! called, so lease k's requests were aborted as late as `gate_ttl + k·margin`.
//! The successor's settle does not cover that: it lasts a drain timeout, while a
//! request still being written lives up to its route timeout. The checks could
//! not see it while a write was whole at once (with the write over, aborting it
//! later changes nothing at the destination, and S2's time rule below excused
//! it): it takes two leases, writes that last, and a margin above grace + the
//! drain timeout (with two leases; k − 1 margins with k).
//!
//! Properties ([`Proto::properties`]), each within one lease (requests of
//! different leases are never compared):
//! - **S1** epochs never go back at the destination (arrival order).
//! - **S2** for requests a, b of a lease with epoch(a) < epoch(b), a is complete
//!   at the destination before b arrives, unless the drain b waited for timed
//!   out on a: b arrived a full drain timeout after a was admitted (the campaign
//!   checker's rule), and, with writes that last, a's write had ended (aborted,
//!   or its route timeout fired) — a request still being written when b arrives
//!   can be completed after it however old it is.
//! - **S3** a request is forwarded (its pass granted) only while its epoch is the
//!   latest of its lease in the store and unexpired on the store's clock.
//! - **S4** a dedup key is delivered at most once (until its `done` record has
//!   expired after the dedup TTL, SPEC §6).
//! - reachability: a takeover happens after an owner died; a request is
//!   delivered after a takeover.

use stateright::{Model, Property};

/// Ticks of the store's clock.
pub type T = u8;

/// The most leases the modelled shard holds.
pub const MAX_LEASES: usize = 2;

/// Designs the code had before a fix (each switch reproduces one hole).
#[derive(Clone, Debug, Default)]
pub struct Holes {
    /// A restarted (or taken-over) gate forgets the epoch its drains completed
    /// through: it admits at its mark at once.
    pub forget_drain: bool,
    /// A route timeout ends the request's pass instead of letting it linger
    /// until a drain's timeout.
    pub timeout_leaves: bool,
    /// A raise that completes its drain forwards without deciding its claim
    /// again (its epoch may have expired or been superseded meanwhile).
    pub no_redecide: bool,
    /// `in_flight` and `in_doubt` dedup records expire after the dedup TTL like
    /// `done` ones.
    pub inflight_expires: bool,
    /// The ownership window starts when the gate create is *confirmed* (SPEC
    /// §10.2 as first written) instead of when it was sent.
    pub window_from_confirm: bool,
    /// A takeover from another instance admits at once: no settle of a drain
    /// timeout (a restart still settles).
    pub no_takeover_settle: bool,
    /// The successor adds `LastModified`'s resolution to it before judging the
    /// previous gate epoch's expiry (SPEC §2 "must account for the 1-second
    /// resolution"). A fix, not a hole: off means the code's reading.
    pub lm_round_up: bool,
    /// A self-fencing owner closes the shard's fences one after another (the
    /// old `Cluster::stop_serving`): at `gate_ttl − margin` lease 0's fence
    /// closes with a deadline of `margin`; once it is empty (its requests
    /// finished, or aborted at that deadline) lease 1's closes with a deadline
    /// of `margin` from then — lease k's requests are aborted as late as
    /// `gate_ttl − margin + (k+1)·margin` instead of all at `gate_ttl`.
    pub sequential_close: bool,
}

/// One request a worker sends.
#[derive(Clone, Debug)]
pub struct ReqSpec {
    /// The lease it names (0-based, below [`Cfg::leases`]).
    pub lease: u8,
    /// The worker epoch it carries (1-based).
    pub epoch: u8,
    /// Its dedup key, if it is recorded.
    pub key: Option<u8>,
    /// Not sent before this tick.
    pub not_before: T,
}

/// The bounds of one check.
#[derive(Clone, Debug)]
pub struct Cfg {
    pub instances: u8,
    /// Leases of the shard (1 or 2), each with its own worker epochs, fence and
    /// requests; the gate lease and the state store's gate epoch are shared.
    pub leases: u8,
    pub gate_ttl: T,
    pub margin: T,
    pub grace: T,
    /// `LastModified` resolution in ticks.
    pub lm_res: T,
    pub drain_timeout: T,
    pub route_timeout: T,
    pub dedup_ttl: T,
    /// Worker epochs' TTL.
    pub worker_ttl: T,
    /// Worker epochs that may be created, per lease (epoch 1 exists at tick 0).
    pub worker_epochs: [u8; MAX_LEASES],
    /// Gate epochs that may be created (bounds renewals).
    pub gate_epochs: u8,
    /// How late a gate create may be applied, and then confirmed.
    pub store_delay: T,
    pub horizon: T,
    pub reqs: Vec<ReqSpec>,
    pub crashes: u8,
    pub pauses: u8,
    pub max_pause: T,
    /// How many instances may lose the lease store for good (renewals fail).
    pub store_cuts: u8,
    /// Owners renew their gate lease (off: each tenure is one gate epoch, as if
    /// every renewal failed; smaller, and the worst case for a stall).
    pub renew: bool,
    /// The run starts at each tick below this (the first gate create's phase
    /// against `LastModified`'s resolution).
    pub start_phases: T,
    /// Responses may be lost (the route timeout then fires).
    pub lose_responses: bool,
    /// Writes last: a request still `Forwarded` may still be being written (a
    /// long upload: bounded by the route timeout, not by the drain timeout), so
    /// the destination may complete it after a newer epoch arrived whenever
    /// that was — S2 then excuses an older request only once its write has
    /// ended (answered, aborted, its route timeout fired), not by time alone.
    /// Off: a write is whole in the tick it happens, and a delay on that hop is
    /// a pause (the stall checks' reading).
    pub long_writes: bool,
    pub holes: Holes,
}

impl Cfg {
    /// Two instances and the defaults' proportions at a tick of 500 ms:
    /// gate_ttl 3 s, margin 1 s, grace 1 s, `LastModified` to the second.
    pub fn cluster() -> Cfg {
        Cfg {
            instances: 2,
            leases: 1,
            gate_ttl: 6,
            margin: 2,
            grace: 2,
            lm_res: 2,
            drain_timeout: 2,
            route_timeout: 1,
            dedup_ttl: 40,
            worker_ttl: 40,
            worker_epochs: [2; MAX_LEASES],
            gate_epochs: 3,
            store_delay: 0,
            horizon: 16,
            reqs: vec![],
            crashes: 0,
            pauses: 0,
            max_pause: 0,
            store_cuts: 0,
            renew: true,
            start_phases: 1,
            lose_responses: false,
            long_writes: false,
            holes: Holes::default(),
        }
    }

    /// One instance (SPEC §10.1): its gate lease is the instance guard.
    pub fn single() -> Cfg {
        Cfg {
            instances: 1,
            gate_epochs: 3,
            gate_ttl: 40,
            ..Cfg::cluster()
        }
    }

    fn keys(&self) -> usize {
        self.reqs
            .iter()
            .filter_map(|r| r.key)
            .max()
            .map_or(0, |k| k as usize + 1)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GateObj {
    pub holder: u8,
    /// `LastModified` (truncated to `lm_res`).
    pub lm: T,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RecState {
    InFlight,
    Done,
    InDoubt,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Rec {
    pub state: RecState,
    /// The gate epoch it was written under.
    pub gen: u8,
    pub created: T,
}

/// The shared state store (PostgreSQL): every write conditioned on the gate epoch.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Db {
    /// The newest gate epoch that wrote.
    pub gen: u8,
    /// Per lease.
    pub mark: [u8; MAX_LEASES],
    /// Per lease: the epoch its drains completed through.
    pub drained: [u8; MAX_LEASES],
    pub recs: Vec<Option<Rec>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Creating {
    pub gate: u8,
    pub sent: T,
    /// Applied at the store (the create won) at this tick.
    pub applied: Option<T>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RaisePhase {
    /// Waiting out a settle (after a restart or takeover).
    Settling,
    /// Draining older passes until the deadline; `aborted` once it fired.
    Draining { deadline: T, aborted: bool },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Raise {
    pub epoch: u8,
    pub req: u8,
    pub phase: RaisePhase,
}

/// One lease's fence at its owner.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Fence {
    pub mark: u8,
    pub barrier: u8,
    pub settled: u8,
    pub settle_until: T,
    pub raise: Option<Raise>,
}

/// What an instance holds while it owns the shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Own {
    pub gen: u8,
    /// Start of the ownership window (instance clock = store ticks).
    pub start: T,
    /// When the latest renewal was sent.
    pub renewed: T,
    /// Lease l's fence (unused past [`Cfg::leases`]).
    pub fences: [Fence; MAX_LEASES],
    /// `sequential_close` only: the lease whose fence is closing, and its
    /// close's deadline.
    pub closing: Option<(u8, T)>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Inst {
    pub up: bool,
    pub paused_until: T,
    pub creating: Option<Creating>,
    pub own: Option<Own>,
    /// Cut off from the lease store from now on: its renewals fail.
    pub cut: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    Unsent,
    /// At instance i, to be decided.
    Received(u8),
    /// At instance i, waiting for a settle or another raise.
    Blocked(u8),
    /// The raiser of instance i's raise.
    Raising(u8),
    /// Admitted by instance i (pass held), not yet written.
    Pending(u8),
    /// Written by instance i, awaiting the response.
    Forwarded(u8),
    /// The response reached instance i, which records it.
    Responded(u8),
    /// Outcome unknown: still counted by instance i's drains.
    Lingering(u8),
    /// Answered, refused, aborted, or its instance died.
    Gone,
}

impl Phase {
    fn at(self) -> Option<u8> {
        match self {
            Phase::Received(i)
            | Phase::Blocked(i)
            | Phase::Raising(i)
            | Phase::Pending(i)
            | Phase::Forwarded(i)
            | Phase::Responded(i)
            | Phase::Lingering(i) => Some(i),
            Phase::Unsent | Phase::Gone => None,
        }
    }

    /// Holds a pass of instance i (counts for its drains).
    fn pass_of(self, i: u8) -> bool {
        matches!(self, Phase::Pending(j) | Phase::Forwarded(j) | Phase::Responded(j) | Phase::Lingering(j) if j == i)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Req {
    pub phase: Phase,
    /// When its pass was granted.
    pub passed: T,
    pub arrived: Option<T>,
    pub completed: bool,
}

/// The properties' names (for [`stateright::Checker::discovery`]).
pub mod prop {
    pub const S1: &str = "S1 epochs never go back at the destination";
    pub const S2: &str =
        "S2 an older request completes before a newer one arrives, unless its drain timed out";
    pub const S3: &str = "S3 forwarded only while its epoch is the latest and unexpired";
    pub const S4: &str = "S4 a dedup key is delivered at most once";
    pub const TAKEOVER_AFTER_DEATH: &str = "a takeover happens after an owner died";
    pub const DELIVERED_AFTER_TAKEOVER: &str = "a request is delivered after a takeover";
}

/// Violations and reachability, recorded when they happen.
pub mod flag {
    pub const S1: u16 = 1;
    pub const S2: u16 = 2;
    pub const S3: u16 = 4;
    pub const S4: u16 = 8;
    pub const TAKEOVER_AFTER_DEATH: u16 = 16;
    pub const DELIVERED_AFTER_TAKEOVER: u16 = 32;
    pub const TAKEN_OVER: u16 = 64;
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct St {
    pub now: T,
    /// Lease l's worker epoch e+1's `LastModified`, once created.
    pub wep: [Vec<Option<T>>; MAX_LEASES],
    /// Gate epoch g+1.
    pub gates: Vec<GateObj>,
    pub db: Db,
    pub inst: Vec<Inst>,
    pub reqs: Vec<Req>,
    pub deliveries: Vec<u8>,
    /// Per lease: the newest epoch that arrived at the destination.
    pub max_arrived: [u8; MAX_LEASES],
    pub crashes: u8,
    pub pauses: u8,
    pub cuts: u8,
    pub flags: u16,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    Tick,
    /// A worker of lease l creates its next epoch.
    NewEpoch(u8),
    Send(u8, u8),
    Crash(u8),
    Restart(u8),
    Pause(u8, T),
    /// Instance i can no longer reach the lease store (its renewals fail).
    CutStore(u8),
    /// Instance i sends a gate create (renewal or acquisition).
    SendCreate(u8),
    /// The store applies instance i's create (or refuses it: taken).
    ApplyCreate(u8),
    /// Instance i learns its create won (or lost).
    Confirm(u8),
    /// Instance i self-fences: past `gate_ttl` it aborts and drops the shard.
    SelfFence(u8),
    /// `sequential_close`: instance i's close of the shard takes its next step
    /// (starts, aborts its lease's requests at the deadline, or moves on).
    CloseStep(u8),
    /// Instance i decides request r.
    Decide(u8),
    /// Instance i's raise of lease l takes its next step.
    RaiseStep(u8, u8),
    Write(u8),
    Complete(u8),
    CompleteLost(u8),
    Record(u8),
    RouteTimeout(u8),
}

pub struct Proto {
    pub cfg: Cfg,
}

fn floor(t: T, res: T) -> T {
    t - t % res
}

impl Proto {
    pub fn new(cfg: Cfg) -> Proto {
        Proto { cfg }
    }

    fn running(&self, s: &St, i: u8) -> bool {
        let n = &s.inst[i as usize];
        n.up && s.now >= n.paused_until
    }

    fn latest_epoch(s: &St, l: u8) -> u8 {
        s.wep[l as usize].iter().take_while(|e| e.is_some()).count() as u8
    }

    fn expired(&self, s: &St, l: u8, e: u8) -> bool {
        match s.wep[l as usize][e as usize - 1] {
            Some(lm) => s.now >= lm.saturating_add(self.cfg.worker_ttl),
            None => true,
        }
    }

    /// Whether instance i may forward now (holds the shard, inside its window).
    fn in_window(&self, s: &St, i: u8) -> bool {
        s.inst[i as usize]
            .own
            .is_some_and(|o| s.now < o.start + self.cfg.gate_ttl - self.cfg.margin)
    }

    /// Whether the latest gate object lets instance i create the next one.
    fn gate_free_for(&self, s: &St, i: u8) -> bool {
        match s.gates.last() {
            None => true,
            Some(g) if g.holder == i => true,
            Some(g) => {
                let lm = if self.cfg.holes.lm_round_up {
                    g.lm + self.cfg.lm_res
                } else {
                    g.lm
                };
                s.now > lm + self.cfg.gate_ttl + self.cfg.grace
            }
        }
    }

    /// A conditioned state write of instance i: refused once a newer gate epoch wrote.
    fn db_write(s: &mut St, i: u8) -> bool {
        let Some(o) = s.inst[i as usize].own else {
            return false;
        };
        if s.db.gen > o.gen {
            return false;
        }
        s.db.gen = o.gen;
        true
    }

    /// Whether instance i holds a pass of lease l below `epoch`.
    fn older_passes(s: &St, i: u8, l: u8, epoch: u8, cfg: &Cfg) -> bool {
        s.reqs
            .iter()
            .enumerate()
            .any(|(r, q)| q.phase.pass_of(i) && cfg.reqs[r].lease == l && cfg.reqs[r].epoch < epoch)
    }

    fn rec_expired(&self, s: &St, rec: &Rec) -> bool {
        let old = s.now >= rec.created.saturating_add(self.cfg.dedup_ttl);
        old && (rec.state == RecState::Done || self.cfg.holes.inflight_expires)
    }

    /// Grants r's pass at instance i: claims its key, records S3. False: refused.
    fn grant(&self, s: &mut St, i: u8, r: u8) -> bool {
        let spec = &self.cfg.reqs[r as usize];
        if let Some(k) = spec.key {
            if let Some(rec) = s.db.recs[k as usize] {
                if !self.rec_expired(s, &rec) {
                    return false;
                }
                // SPEC §6 retention: a `done` record past the TTL is gone, and
                // its key may be delivered again; S4 counts from here.
                if rec.state == RecState::Done {
                    s.deliveries[k as usize] = 0;
                }
            }
            if !Self::db_write(s, i) {
                return false;
            }
            let gen = s.db.gen;
            s.db.recs[k as usize] = Some(Rec {
                state: RecState::InFlight,
                gen,
                created: s.now,
            });
        }
        if self.expired(s, spec.lease, spec.epoch) || Self::latest_epoch(s, spec.lease) > spec.epoch
        {
            s.flags |= flag::S3;
        }
        let q = &mut s.reqs[r as usize];
        q.phase = Phase::Pending(i);
        q.passed = s.now;
        true
    }

    /// Ends r's pass with its outcome unknown or aborted: its record is in doubt.
    fn doubt(&self, s: &mut St, i: u8, r: u8) {
        if let Some(k) = self.cfg.reqs[r as usize].key {
            if Self::db_write(s, i) {
                if let Some(rec) = s.db.recs[k as usize].as_mut() {
                    if rec.state == RecState::InFlight {
                        rec.state = RecState::InDoubt;
                    }
                }
            }
        }
    }

    /// Aborts instance i's passes below `epoch` (all: `u8::MAX`) of lease `l`
    /// (every lease: `None`).
    fn abort_older(&self, s: &mut St, i: u8, l: Option<u8>, epoch: u8) {
        for r in 0..s.reqs.len() {
            let spec = &self.cfg.reqs[r];
            if s.reqs[r].phase.pass_of(i) && l.is_none_or(|l| spec.lease == l) && spec.epoch < epoch
            {
                if !matches!(s.reqs[r].phase, Phase::Lingering(_)) {
                    self.doubt(s, i, r as u8);
                }
                s.reqs[r].phase = Phase::Gone;
            }
        }
    }

    /// Instance i confirmed gate epoch g: a renewal, or a takeover (SPEC §10.2).
    fn confirm(&self, s: &mut St, i: u8, c: Creating) {
        let start = if self.cfg.holes.window_from_confirm {
            s.now
        } else {
            c.sent
        };
        let g = c.gate;
        // A renewal only if the epoch before is the one held; otherwise (the
        // shard was someone else's meanwhile) a takeover.
        if let Some(o) = s.inst[i as usize].own.as_mut().filter(|o| o.gen + 1 == g) {
            o.gen = g;
            o.start = start;
            o.renewed = c.sent;
            return;
        }
        // Takeover (or a restart taking its own gate back): what this instance
        // held before is void.
        if s.inst[i as usize].own.is_some() {
            self.drop_shard(s, i);
        }
        let prev = if g >= 2 {
            Some(s.gates[g as usize - 2].holder)
        } else {
            None
        };
        if let Some(p) = prev {
            if p != i && !s.inst[p as usize].up {
                s.flags |= flag::TAKEOVER_AFTER_DEATH;
            }
            if p != i {
                s.flags |= flag::TAKEN_OVER;
            }
        }
        if s.db.gen > g {
            return;
        }
        s.db.gen = g;
        for rec in s.db.recs.iter_mut().flatten() {
            if rec.state == RecState::InFlight && rec.gen < g {
                rec.state = RecState::InDoubt;
            }
        }
        let cluster = self.cfg.instances > 1;
        // The switch drops the settle of a takeover from another instance; a
        // restart taking its own gate back settles as §5 says in any case.
        let from_other = prev.is_some_and(|p| p != i);
        let mut fences = [Fence::default(); MAX_LEASES];
        for (l, f) in fences.iter_mut().enumerate().take(self.cfg.leases as usize) {
            let mark = if cluster {
                s.db.mark[l].max(Self::latest_epoch(s, l as u8))
            } else {
                s.db.mark[l]
            };
            s.db.mark[l] = mark;
            let settle = mark > 0 && !(cluster && from_other && self.cfg.holes.no_takeover_settle);
            let settled = if settle && !self.cfg.holes.forget_drain {
                s.db.drained[l].min(mark)
            } else {
                mark
            };
            *f = Fence {
                mark,
                barrier: mark,
                settled,
                settle_until: if settle {
                    s.now + self.cfg.drain_timeout
                } else {
                    s.now
                },
                raise: None,
            };
        }
        s.inst[i as usize].own = Some(Own {
            gen: g,
            start,
            renewed: c.sent,
            fences,
            closing: None,
        });
    }

    /// Instance i leaves the shard: every request it holds is aborted or
    /// refused, its fences are gone.
    fn drop_shard(&self, s: &mut St, i: u8) {
        self.abort_older(s, i, None, u8::MAX);
        for q in s.reqs.iter_mut() {
            if q.phase.at() == Some(i) {
                q.phase = Phase::Gone;
            }
        }
        s.inst[i as usize].own = None;
    }

    /// Whether instance i holds a pass of lease l.
    fn passes_of(&self, s: &St, i: u8, l: u8) -> bool {
        Self::older_passes(s, i, l, u8::MAX, &self.cfg)
    }

    /// `sequential_close`: the close's next step. It starts with lease 0's
    /// fence; a fence whose deadline passed has its requests aborted; then the
    /// next lease's fence closes with a deadline of `margin` from now; after
    /// the last one the shard is dropped.
    fn close_step(&self, s: &mut St, i: u8) {
        let o = s.inst[i as usize].own.expect("owner");
        let next = match o.closing {
            None => 0,
            Some((l, _)) => {
                self.abort_older(s, i, Some(l), u8::MAX);
                l + 1
            }
        };
        if next < self.cfg.leases {
            let own = s.inst[i as usize].own.as_mut().expect("owner");
            own.closing = Some((next, s.now + self.cfg.margin));
        } else {
            self.drop_shard(s, i);
        }
    }

    /// Instance i's enabled steps (all urgent).
    fn inst_actions(&self, s: &St, i: u8, out: &mut Vec<Action>) {
        let cfg = &self.cfg;
        let n = &s.inst[i as usize];
        if let Some(o) = n.own {
            // Due with whatever else is due: after a pause, a write that was in
            // progress and the timer race.
            if cfg.holes.sequential_close {
                let due = match o.closing {
                    None => s.now >= o.start + cfg.gate_ttl - cfg.margin,
                    Some((l, deadline)) => s.now >= deadline || !self.passes_of(s, i, l),
                };
                if due {
                    out.push(Action::CloseStep(i));
                }
            } else if s.now >= o.start + cfg.gate_ttl {
                out.push(Action::SelfFence(i));
            }
        }
        if let Some(c) = n.creating {
            if c.applied.is_some() {
                out.push(Action::Confirm(i));
            }
        } else if (s.gates.len() as u8) < cfg.gate_epochs {
            // SPEC §2: the latest gate epoch is ours, or free; a renewal every
            // third of the TTL. An instance cut off from the store creates nothing.
            let due = !n.cut
                && self.gate_free_for(s, i)
                && n.own
                    .is_none_or(|o| cfg.renew && s.now >= o.renewed + cfg.gate_ttl / 3);
            if due {
                out.push(Action::SendCreate(i));
            }
        }
        if let Some(o) = n.own {
            for (l, f) in o.fences.iter().enumerate().take(cfg.leases as usize) {
                let l = l as u8;
                let Some(rz) = f.raise else { continue };
                let ready = match rz.phase {
                    RaisePhase::Settling => s.now >= f.settle_until,
                    RaisePhase::Draining { deadline, aborted } => {
                        !Self::older_passes(s, i, l, rz.epoch, cfg)
                            || (s.now >= deadline && !aborted)
                    }
                };
                if ready {
                    out.push(Action::RaiseStep(i, l));
                }
            }
        }
        for (r, q) in s.reqs.iter().enumerate() {
            let r = r as u8;
            match q.phase {
                Phase::Received(j) if j == i => out.push(Action::Decide(r)),
                Phase::Blocked(j) if j == i && self.unblocked(s, i, r) => {
                    out.push(Action::Decide(r))
                }
                Phase::Pending(j) if j == i => out.push(Action::Write(r)),
                Phase::Responded(j) if j == i => out.push(Action::Record(r)),
                Phase::Forwarded(j)
                    if j == i && s.now >= q.arrived.unwrap_or(0) + cfg.route_timeout =>
                {
                    out.push(Action::RouteTimeout(r))
                }
                _ => {}
            }
        }
    }

    fn unblocked(&self, s: &St, i: u8, r: u8) -> bool {
        match s.inst[i as usize].own {
            None => true,
            Some(o) => {
                let spec = &self.cfg.reqs[r as usize];
                let f = o.fences[spec.lease as usize];
                if f.raise.is_some() {
                    return false;
                }
                let e = spec.epoch;
                e != f.mark || e <= f.settled || s.now >= f.settle_until
            }
        }
    }

    /// Time may pass only when no running instance has a step to take and no
    /// gate create is overdue at the store.
    fn may_tick(&self, s: &St) -> bool {
        if s.now >= self.cfg.horizon {
            return false;
        }
        let mut acts = Vec::new();
        for i in 0..self.cfg.instances {
            let n = &s.inst[i as usize];
            if let Some(c) = n.creating {
                match c.applied {
                    None if s.now >= c.sent + self.cfg.store_delay => return false,
                    Some(a) if self.running(s, i) && s.now >= a + self.cfg.store_delay => {
                        return false
                    }
                    _ => {}
                }
            }
            if self.running(s, i) {
                acts.clear();
                self.inst_actions(s, i, &mut acts);
                if acts.iter().any(|a| !matches!(a, Action::Confirm(_))) {
                    return false;
                }
            }
        }
        true
    }

    fn decide(&self, s: &mut St, r: u8) {
        let cfg = &self.cfg;
        let Some(i) = s.reqs[r as usize].phase.at() else {
            return;
        };
        let ReqSpec {
            lease, epoch: e, ..
        } = cfg.reqs[r as usize];
        let l = lease as usize;
        let refuse = |s: &mut St| s.reqs[r as usize].phase = Phase::Gone;
        if !self.in_window(s, i) {
            return refuse(s);
        }
        let f = s.inst[i as usize].own.expect("in window").fences[l];
        if e < f.barrier || e < Self::latest_epoch(s, lease) || self.expired(s, lease, e) {
            return refuse(s);
        }
        if f.raise.is_some() {
            s.reqs[r as usize].phase = Phase::Blocked(i);
            return;
        }
        if e == f.mark {
            if e <= f.settled {
                if !self.grant(s, i, r) {
                    refuse(s);
                }
            } else if s.now >= f.settle_until {
                s.inst[i as usize].own.as_mut().expect("owner").fences[l].settled = f.mark;
                if !self.grant(s, i, r) {
                    refuse(s);
                }
            } else {
                s.reqs[r as usize].phase = Phase::Blocked(i);
            }
            return;
        }
        // e > mark: raise. The mark is durable before anything else.
        if !Self::db_write(s, i) {
            return refuse(s);
        }
        s.db.mark[l] = s.db.mark[l].max(e);
        let f = &mut s.inst[i as usize].own.as_mut().expect("owner").fences[l];
        f.barrier = e;
        f.raise = Some(Raise {
            epoch: e,
            req: r,
            phase: RaisePhase::Settling,
        });
        s.reqs[r as usize].phase = Phase::Raising(i);
    }

    /// Instance i's fence of lease l.
    fn fence(s: &mut St, i: u8, l: u8) -> &mut Fence {
        &mut s.inst[i as usize].own.as_mut().expect("owner").fences[l as usize]
    }

    fn raise_step(&self, s: &mut St, i: u8, l: u8) {
        let cfg = &self.cfg;
        let rz = Self::fence(s, i, l).raise.expect("raise");
        match rz.phase {
            RaisePhase::Settling => {
                let now = s.now;
                let f = Self::fence(s, i, l);
                f.settled = f.settled.max(f.mark);
                f.raise = Some(Raise {
                    phase: RaisePhase::Draining {
                        deadline: now + cfg.drain_timeout,
                        aborted: false,
                    },
                    ..rz
                });
            }
            RaisePhase::Draining { deadline, .. } if Self::older_passes(s, i, l, rz.epoch, cfg) => {
                self.abort_older(s, i, Some(l), rz.epoch);
                Self::fence(s, i, l).raise = Some(Raise {
                    phase: RaisePhase::Draining {
                        deadline,
                        aborted: true,
                    },
                    ..rz
                });
            }
            RaisePhase::Draining { .. } => {
                let e = rz.epoch;
                let f = Self::fence(s, i, l);
                f.mark = e;
                f.settled = e;
                f.raise = None;
                let holds = cfg.holes.no_redecide
                    || (self.in_window(s, i)
                        && !self.expired(s, l, e)
                        && Self::latest_epoch(s, l) <= e);
                if !(holds && self.grant(s, i, rz.req)) {
                    s.reqs[rz.req as usize].phase = Phase::Gone;
                }
                if Self::db_write(s, i) {
                    s.db.drained[l as usize] = s.db.drained[l as usize].max(e);
                }
            }
        }
    }

    fn write(&self, s: &mut St, r: u8) {
        let cfg = &self.cfg;
        let ReqSpec {
            lease, epoch: e, ..
        } = cfg.reqs[r as usize];
        let l = lease as usize;
        if e < s.max_arrived[l] {
            s.flags |= flag::S1;
        }
        s.max_arrived[l] = s.max_arrived[l].max(e);
        let now = s.now;
        let passed = s.reqs[r as usize].passed;
        for (a, q) in s.reqs.iter().enumerate() {
            let ReqSpec {
                lease: la,
                epoch: ea,
                ..
            } = cfg.reqs[a];
            let Some(arr) = q.arrived else { continue };
            if la != lease {
                continue;
            }
            // a older and still at the destination; b (this one) not a full
            // drain timeout after a's admission, or (long writes) a still
            // being written: nothing has aborted it, its route timeout has not
            // fired, so the drain b waited for did not time out on it.
            let forwarding = cfg.long_writes && matches!(q.phase, Phase::Forwarded(_));
            if ea < e && !q.completed && (now < q.passed + cfg.drain_timeout || forwarding) {
                s.flags |= flag::S2;
            }
            // This one is the older and arrives after a newer one.
            if ea > e && arr < passed + cfg.drain_timeout {
                s.flags |= flag::S2;
            }
        }
        if let Some(k) = cfg.reqs[r as usize].key {
            let d = &mut s.deliveries[k as usize];
            *d = (*d + 1).min(2);
            if *d > 1 {
                s.flags |= flag::S4;
            }
        }
        if s.flags & flag::TAKEN_OVER != 0 {
            s.flags |= flag::DELIVERED_AFTER_TAKEOVER;
        }
        let q = &mut s.reqs[r as usize];
        let i = q.phase.at().expect("pending");
        q.arrived = Some(now);
        q.phase = Phase::Forwarded(i);
    }
}

impl Proto {
    fn init_at(&self, now: T) -> St {
        let cfg = &self.cfg;
        let wep = std::array::from_fn(|l| {
            let mut w = vec![];
            if l < cfg.leases as usize {
                w = vec![None; cfg.worker_epochs[l] as usize];
                w[0] = Some(floor(now, cfg.lm_res));
            }
            w
        });
        St {
            now,
            wep,
            gates: vec![],
            db: Db {
                gen: 0,
                mark: [0; MAX_LEASES],
                drained: [0; MAX_LEASES],
                recs: vec![None; cfg.keys()],
            },
            inst: vec![
                Inst {
                    up: true,
                    paused_until: 0,
                    creating: None,
                    own: None,
                    cut: false,
                };
                cfg.instances as usize
            ],
            reqs: vec![
                Req {
                    phase: Phase::Unsent,
                    passed: 0,
                    arrived: None,
                    completed: false,
                };
                cfg.reqs.len()
            ],
            deliveries: vec![0; cfg.keys()],
            max_arrived: [0; MAX_LEASES],
            crashes: 0,
            pauses: 0,
            cuts: 0,
            flags: 0,
        }
    }
}

impl Model for Proto {
    type State = St;
    type Action = Action;

    fn init_states(&self) -> Vec<St> {
        let cfg = &self.cfg;
        (0..cfg.start_phases).map(|now| self.init_at(now)).collect()
    }

    fn actions(&self, s: &St, out: &mut Vec<Action>) {
        let cfg = &self.cfg;
        for i in 0..cfg.instances {
            let n = &s.inst[i as usize];
            if self.running(s, i) {
                self.inst_actions(s, i, out);
            }
            if let Some(c) = n.creating {
                if c.applied.is_none() {
                    out.push(Action::ApplyCreate(i));
                }
            }
            if !n.cut && s.cuts < cfg.store_cuts {
                out.push(Action::CutStore(i));
            }
            if n.up && s.crashes < cfg.crashes {
                out.push(Action::Crash(i));
            }
            if !n.up {
                out.push(Action::Restart(i));
            }
            if self.running(s, i) && s.pauses < cfg.pauses {
                for k in 1..=cfg.max_pause {
                    out.push(Action::Pause(i, k));
                }
            }
        }
        for l in 0..cfg.leases {
            if (Self::latest_epoch(s, l) as usize) < s.wep[l as usize].len() {
                out.push(Action::NewEpoch(l));
            }
        }
        for (r, q) in s.reqs.iter().enumerate() {
            let spec = &cfg.reqs[r];
            if q.phase == Phase::Unsent
                && s.now >= spec.not_before
                && s.wep[spec.lease as usize][spec.epoch as usize - 1].is_some()
            {
                for i in 0..cfg.instances {
                    if self.running(s, i) && s.inst[i as usize].own.is_some() {
                        out.push(Action::Send(r as u8, i));
                    }
                }
            }
            if q.arrived.is_some() && !q.completed {
                out.push(Action::Complete(r as u8));
                if cfg.lose_responses && matches!(q.phase, Phase::Forwarded(_)) {
                    out.push(Action::CompleteLost(r as u8));
                }
            }
        }
        if self.may_tick(s) {
            out.push(Action::Tick);
        }
    }

    fn next_state(&self, last: &St, action: Action) -> Option<St> {
        let cfg = &self.cfg;
        let mut s = last.clone();
        match action {
            Action::Tick => s.now += 1,
            Action::NewEpoch(l) => {
                let e = Self::latest_epoch(&s, l) as usize;
                s.wep[l as usize][e] = Some(floor(s.now, cfg.lm_res));
            }
            Action::Send(r, i) => s.reqs[r as usize].phase = Phase::Received(i),
            Action::Crash(i) => {
                s.crashes += 1;
                s.inst[i as usize] = Inst {
                    up: false,
                    paused_until: 0,
                    creating: None,
                    own: None,
                    cut: s.inst[i as usize].cut,
                };
                for q in s.reqs.iter_mut() {
                    if q.phase.at() == Some(i) {
                        q.phase = Phase::Gone;
                    }
                }
            }
            Action::Restart(i) => s.inst[i as usize].up = true,
            Action::CutStore(i) => {
                s.cuts += 1;
                s.inst[i as usize].cut = true;
            }
            Action::Pause(i, k) => {
                s.pauses += 1;
                s.inst[i as usize].paused_until = s.now + k;
            }
            Action::SendCreate(i) => {
                s.inst[i as usize].creating = Some(Creating {
                    gate: s.gates.len() as u8 + 1,
                    sent: s.now,
                    applied: None,
                });
            }
            Action::ApplyCreate(i) => {
                let c = s.inst[i as usize].creating.expect("creating");
                if s.gates.len() as u8 >= c.gate {
                    // 412: someone else created it. The read-back says lost.
                    s.inst[i as usize].creating = None;
                } else {
                    s.gates.push(GateObj {
                        holder: i,
                        lm: floor(s.now, cfg.lm_res),
                    });
                    s.inst[i as usize].creating = Some(Creating {
                        applied: Some(s.now),
                        ..c
                    });
                }
            }
            Action::Confirm(i) => {
                let c = s.inst[i as usize].creating.take().expect("creating");
                self.confirm(&mut s, i, c);
            }
            Action::SelfFence(i) => self.drop_shard(&mut s, i),
            Action::CloseStep(i) => self.close_step(&mut s, i),
            Action::Decide(r) => self.decide(&mut s, r),
            Action::RaiseStep(i, l) => self.raise_step(&mut s, i, l),
            Action::Write(r) => self.write(&mut s, r),
            Action::Complete(r) => {
                let q = &mut s.reqs[r as usize];
                q.completed = true;
                if let Phase::Forwarded(i) = q.phase {
                    q.phase = Phase::Responded(i);
                }
            }
            Action::CompleteLost(r) => s.reqs[r as usize].completed = true,
            Action::Record(r) => {
                let i = s.reqs[r as usize].phase.at().expect("responded");
                if let Some(k) = cfg.reqs[r as usize].key {
                    if Self::db_write(&mut s, i) {
                        if let Some(rec) = s.db.recs[k as usize].as_mut() {
                            rec.state = RecState::Done;
                        }
                    }
                }
                s.reqs[r as usize].phase = Phase::Gone;
            }
            Action::RouteTimeout(r) => {
                let i = s.reqs[r as usize].phase.at().expect("forwarded");
                self.doubt(&mut s, i, r);
                s.reqs[r as usize].phase = if cfg.holes.timeout_leaves {
                    Phase::Gone
                } else {
                    Phase::Lingering(i)
                };
            }
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(prop::S1, |_, s: &St| s.flags & flag::S1 == 0),
            Property::always(prop::S2, |_, s: &St| s.flags & flag::S2 == 0),
            Property::always(prop::S3, |_, s: &St| s.flags & flag::S3 == 0),
            Property::always(prop::S4, |_, s: &St| s.flags & flag::S4 == 0),
            Property::sometimes(prop::TAKEOVER_AFTER_DEATH, |_, s: &St| {
                s.flags & flag::TAKEOVER_AFTER_DEATH != 0
            }),
            Property::sometimes(prop::DELIVERED_AFTER_TAKEOVER, |_, s: &St| {
                s.flags & flag::DELIVERED_AFTER_TAKEOVER != 0
            }),
        ]
    }
}
