//! A `stateright` model of fencegate's protocol (SPEC §2, §4–§6, §10): the
//! fence and its drain, dedup records, a cluster's shard ownership rows,
//! self-fencing, takeover, handover and settling — checked exhaustively for
//! small bounds.
//!
//! It models the *protocol*, not the code: one shard holding one or two leases
//! ([`Cfg::leases`]), each with its own worker epochs in the lease store (their
//! `LastModified` of `lm_res` ticks' resolution; admission judges their expiry
//! on the store's clock), its own fence (mark, barrier, settle, raise and
//! drain; its mark and drained-through epoch in the database) and its own
//! requests at the destination; one to three fencegate instances; a
//! PostgreSQL database holding the shard's ownership row (`fencegate_owners`:
//! generation, renewals, owner) and the state, every state write conditioned
//! on the writer's generation against the row's; and a destination that
//! records each request's arrival and completion. [`Cfg`] holds the bounds,
//! the nemesis budget and the [`Holes`] — switches that put back a design
//! other than fencegate's, so each property can be shown to fail without its
//! mechanism.
//!
//! Time is a global tick counter. Every instance's monotonic clock runs at the
//! same rate; the database's clock is never read for a decision (only by
//! [`Holes::take_on_db_clock`], against which it may jump, [`Cfg::db_jump`]). A
//! *pause* stops an instance for a number of ticks (it acts on nothing, and
//! its timers fire late). Every instance step is *urgent*: time does not
//! advance while a running instance has something to do (a write after its
//! check, a timeout that is due, a renewal, a read that shows a change, a
//! take), so every delay the checker explores is one of the nemesis's: a
//! pause, a row write applied or answered late (`db_delay`) or its answer lost
//! (`db_losses`), a read answered late (`slow_reads`), a slow or silent
//! destination, a worker that sends late.
//!
//! Ownership (SPEC §10.2, issue 28):
//! - an owner renews its row every `gate_ttl / 3` with an `UPDATE` conditioned
//!   on its generation (`renewals += 1`); renewals never overlap. A row write
//!   (take, renewal, release) is applied at the database up to `db_delay` ticks
//!   after it was sent and answered up to `db_delay` ticks after that, or its
//!   answer is lost: the writer never learns the outcome (it may have
//!   committed), and a renewal whose outcome is unknown extends nothing.
//! - a contender reads the row continuously: each change is seen at once (so
//!   `since`, the arrival of the read that first showed the current
//!   `(generation, renewals, owner)`, is its commit — the earliest any
//!   contender can count from), unless its read is a slow one (answered up to
//!   `look_delay` after it executed; it judges nothing meanwhile) or it is
//!   paused (it may judge on the read it had before the pause). The row is free
//!   once released, never taken, or seen unchanged for `gate_ttl + grace` on
//!   the contender's clock; the take is an `UPDATE` conditioned on exactly the
//!   watched pair that raises the generation — so a renewal that committed
//!   meanwhile makes it match nothing. A single instance ([`Cfg::single`])
//!   takes its own row back at once after a restart (its guard, a gate lease in
//!   the lease store: the process that held it is provably gone; with one
//!   instance nothing else about that lease matters).
//! - the owner starts no forward later than `gate_ttl − margin` after it sent
//!   its latest successful renewal (or take); there its tenure *stops*: nothing
//!   new is admitted, and what the tenure has in flight is aborted at
//!   `gate_ttl` after that send — every lease of the shard by one deadline. It
//!   still holds the row and renews it: a renewal that succeeds after the stop
//!   takes the row again (a new tenure, under a new generation), as
//!   `renew_held` does. A renewal that matches nothing ends the tenure at once.
//! - a takeover (a take's answer) starts each lease's fence at max(stored
//!   mark, latest epoch), turns older generations' `in_flight` records into
//!   `in_doubt`, and settles: until a drain timeout has passed, no raise
//!   completes and nothing above the drained-through epoch is forwarded. A take
//!   of its own row by a stopped owner first aborts what the stopped tenure
//!   still has in flight.
//! - a handover (`handovers`): the owner stops, its requests finish or are
//!   aborted at `min(now + drain timeout, its abort deadline)` — those of a
//!   tenure stopped earlier too — and once none is left it releases the row
//!   (conditioned on its generation and name), which a contender takes at once.
//! - every state write is conditioned on the writer's generation against the
//!   row's (the `OWNER_OK` share lock): it commits before a take, or fails
//!   after it; a take is atomic at the database.
//! - the anchor (the one gate lease a cluster keeps in the lease store) is
//!   modelled only by what it does to an owner: a member cut from the lease
//!   store (`store_cuts`) vouches for no anchor and so renews and takes no row
//!   from then on — its shards go to the others after `gate_ttl + grace`. Its
//!   window of the anchor and the cap it puts on the shard windows
//!   (`window_from`) only shorten a window, and are left out; so is the
//!   membership (with one shard, balancing takes and hands over nothing but
//!   the handovers of the nemesis).
//!
//! Left out as well: a row write still applied after its sender crashed (a
//! crash drops it; applied late, it only makes contenders wait longer, or
//! leaves a row naming a dead instance), and a write whose client gave up but
//! whose statement still commits later (the answer is lost instead).
//!
//! The other message pairs:
//! - worker → fencegate: a request is sent at any tick, or never (loss); a peer
//!   hop (non-owner → owner) is the same as a late send, the owner decides.
//! - fencegate → destination: the write starts in the tick of the check unless
//!   the instance pauses; a delay before it counts as a pause (the limit of
//!   SPEC §10.2 is about exactly this stall). By default the write is whole in
//!   that tick; with [`Cfg::long_writes`] it lasts (a long upload) until the
//!   request is answered, aborted or times out — the destination may then
//!   complete it at any later time.
//! - destination → fencegate: a response arrives at any time, never (loss, then
//!   the route timeout), or the destination never answers.
//!
//! The stated limit: an owner stalled between its last ownership check and its
//! write by more than `margin + grace` can deliver after the successor's first
//! forward — the owner counts its window from a renewal's *send*, the
//! contender from the *arrival* of the read that showed its commit, which is
//! later — and the settle covers a further drain timeout of it. The checks
//! show both bounds exact (they hold at the bound, fail a tick past).
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

pub mod queue;

use stateright::{Model, Property};

/// Ticks of the monotonic clocks (every instance's runs at the same rate).
pub type T = u8;

/// The most leases the modelled shard holds.
pub const MAX_LEASES: usize = 2;

/// Designs other than the protocol's (each switch reproduces one hole). The
/// last three are what `src/cluster` does as of this model's commit — the
/// model found them (`take_from_latest_read`: `take_over` reads `Seen` again;
/// `retake_spares_stopped`: the new tenure `renew_held` starts;
/// `handover_spares_stopped`: `hand_over` after `stop_serving`) — and the
/// checks show each breaking S1 or S2.
#[derive(Clone, Debug, Default)]
pub struct Holes {
    /// A restarted (or taken-over) fence forgets the epoch its drains completed
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
    /// The ownership window starts when the answer to the renewal (or take)
    /// arrives instead of when it was sent.
    pub window_from_confirm: bool,
    /// A takeover from another instance admits at once: no settle of a drain
    /// timeout (a restart, or a take of a row this instance held, still
    /// settles).
    pub no_takeover_settle: bool,
    /// A stopping owner closes the shard's fences one after another (the old
    /// `Cluster::stop_serving`, issue 25 point 1): at `gate_ttl − margin` lease
    /// 0's fence closes with a deadline of `margin`; once it is empty (its
    /// requests finished, or aborted at that deadline) lease 1's closes with a
    /// deadline of `margin` from then — lease k's requests are aborted as late
    /// as `gate_ttl − margin + (k+1)·margin` instead of all at `gate_ttl`.
    pub sequential_close: bool,
    /// The take is conditioned on the row's generation only, not on the exact
    /// `(generation, renewals)` pair the contender watched: a renewal that
    /// committed after the read the contender judged on (a read answered late)
    /// leaves the take matching.
    pub take_unconditioned: bool,
    /// The contender judges the row's age on the database's clock (the
    /// renewal's commit time, `renewed_at`, against the database's `now()` at
    /// its read) instead of its own clock from its read: a forward jump of the
    /// database's clock frees the row early.
    pub take_on_db_clock: bool,
    /// The take is decided on the pair watched unchanged for `gate_ttl +
    /// grace`, but sent conditioned on the pair of the latest read when it is
    /// sent (`take_over` reads `Seen` again after `balance` judged it): a read
    /// answered between the decision and the send, showing a take or a renewal
    /// that just committed, makes the take match it — two owners at once.
    pub take_from_latest_read: bool,
    /// A take of its own row by an owner that had stopped (a renewal that
    /// succeeded after its forwarding deadline) leaves the stopped tenure's
    /// requests to their own abort deadline, up to `margin` after the new
    /// tenure began — while the new tenure settles only a drain timeout.
    pub retake_spares_stopped: bool,
    /// A handover by an owner that had stopped already (its renewals failed
    /// past its forwarding deadline, then a SIGTERM or a balancing round)
    /// releases the row at once, leaving the stopped tenure's requests to their
    /// own abort deadline: the successor takes the row at once and settles
    /// only a drain timeout.
    pub handover_spares_stopped: bool,
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
    /// requests; the ownership row and its generation are shared.
    pub leases: u8,
    pub gate_ttl: T,
    pub margin: T,
    pub grace: T,
    /// Worker epochs' `LastModified` resolution in ticks (their expiry is
    /// judged on the lease store's clock, SPEC §4).
    pub lm_res: T,
    pub drain_timeout: T,
    pub route_timeout: T,
    pub dedup_ttl: T,
    /// Worker epochs' TTL.
    pub worker_ttl: T,
    /// Worker epochs that may be created, per lease (epoch 1 exists at tick 0).
    pub worker_epochs: [u8; MAX_LEASES],
    /// Row writes (takes and renewals) that may be sent in all: bounds the
    /// search (an owner out of them renews no more, as if cut).
    pub row_writes: u8,
    /// How late a row write (take, renewal, release) is applied at the
    /// database after it was sent, and how late its answer arrives after it
    /// was applied.
    pub db_delay: T,
    /// Reads of the row whose answer may come late (the rest are answered at
    /// once, so `since` is the commit of what they show — the earliest any
    /// contender can count from).
    pub slow_reads: u8,
    /// How late a slow read's answer arrives after the read executed.
    pub look_delay: T,
    /// Answers to row writes that may be lost: the writer never learns the
    /// outcome (it may have committed).
    pub db_losses: u8,
    /// The database's clock may jump forward once, by 1 to this many ticks
    /// (read by nothing but [`Holes::take_on_db_clock`]).
    pub db_jump: T,
    pub horizon: T,
    pub reqs: Vec<ReqSpec>,
    pub crashes: u8,
    pub pauses: u8,
    pub max_pause: T,
    /// How many instances may lose the lease store for good (the anchor: such
    /// a member renews no row from then on).
    pub store_cuts: u8,
    /// Handovers (an owner drains, then releases its row) that may happen.
    pub handovers: u8,
    /// Owners renew their row (off: each tenure is one take, as if every
    /// renewal failed; smaller, and the worst case for a stall).
    pub renew: bool,
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
    /// gate_ttl 3 s, margin 1 s, grace 1 s.
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
            row_writes: 3,
            db_delay: 0,
            slow_reads: 0,
            look_delay: 0,
            db_losses: 0,
            db_jump: 0,
            horizon: 16,
            reqs: vec![],
            crashes: 0,
            pauses: 0,
            max_pause: 0,
            store_cuts: 0,
            handovers: 0,
            renew: true,
            lose_responses: false,
            long_writes: false,
            holes: Holes::default(),
        }
    }

    /// One instance (SPEC §10.1): its ownership is the instance guard, which a
    /// restart takes back at once (the process that held it is provably gone).
    pub fn single() -> Cfg {
        Cfg {
            instances: 1,
            row_writes: 3,
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

/// The shard's ownership row (`fencegate_owners`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Row {
    /// 0: no row yet.
    pub gen: u8,
    pub renewals: u8,
    /// The instance that took it last.
    pub owner: Option<u8>,
    /// Released by its owner (a handover): free at once.
    pub released: bool,
    /// The database's clock at the commit that wrote `(gen, renewals)`
    /// (`renewed_at`; kept only for [`Holes::take_on_db_clock`]).
    pub at: T,
}

/// A row as a contender last read it, and since when (its clock) it has read
/// it so.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Seen {
    pub row: Row,
    /// The arrival of the read that first showed `(gen, renewals, owner)`.
    pub since: T,
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
    /// The generation it was written under.
    pub gen: u8,
    pub created: T,
}

/// The rest of the database: marks and dedup records, every write
/// conditioned on the writer's generation against the row's (`OWNER_OK`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Db {
    /// Per lease.
    pub mark: [u8; MAX_LEASES],
    /// Per lease: the epoch its drains completed through.
    pub drained: [u8; MAX_LEASES],
    pub recs: Vec<Option<Rec>>,
}

/// A row write on its way.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// Renew the row held under this generation.
    Renew(u8),
    /// Take the row conditioned on this `(generation, renewals)` (generation
    /// 0: insert it).
    Take(u8, u8),
    /// Release the row held under this generation (a handover).
    Release(u8),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Answer {
    /// The renewals count after it, or no match.
    Renewed(Option<u8>),
    /// The new generation and the previous owner, or no match.
    Took(Option<(u8, Option<u8>)>),
    Released,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Op {
    pub kind: OpKind,
    pub sent: T,
    /// Applied at the database at this tick, with this answer.
    pub applied: Option<(T, Answer)>,
}

/// A read of the row on its way back (it executed at `read`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Look {
    pub row: Row,
    pub read: T,
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

/// The row an instance holds (`holding`), and its window.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Hold {
    pub gen: u8,
    /// As its latest renewal's answer said.
    pub renewals: u8,
    /// The window's origin: the send of the latest renewal (or take) that
    /// succeeded. Forwards start until `gate_ttl − margin` after it.
    pub start: T,
    /// The latest renewal's send (renewals every `gate_ttl / 3`).
    pub last_sent: T,
    /// A renewal succeeded while no tenure was served: take the row again
    /// (a new tenure, under a new generation).
    pub retake: bool,
    /// Handing the shard over: once its requests are over, release the row.
    pub leaving: bool,
    /// The release waits until this instance holds no pass.
    pub wait: bool,
}

/// The tenure an instance serves (its fences).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Own {
    pub gen: u8,
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
    /// Cut off from the lease store from now on: it vouches for no anchor, so
    /// it renews and takes no row.
    pub cut: bool,
    pub hold: Option<Hold>,
    pub own: Option<Own>,
    /// Its row write in flight (renewals never overlap; a take is sent only
    /// when no renewal is in flight).
    pub op: Option<Op>,
    /// Its slow read of the row in flight (its reads wait for it, and it
    /// judges nothing meanwhile).
    pub look: Option<Look>,
    pub seen: Option<Seen>,
    /// `take_from_latest_read`: a take decided, not yet sent.
    pub deciding: bool,
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

    /// Holds a pass of instance i.
    fn pass_of(self, i: u8) -> bool {
        matches!(self, Phase::Pending(j) | Phase::Forwarded(j) | Phase::Responded(j) | Phase::Lingering(j) if j == i)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Req {
    pub phase: Phase,
    /// When its pass was granted.
    pub passed: T,
    /// The generation of the tenure that granted its pass.
    pub gen: u8,
    /// Its tenure stopped: what is still in flight is aborted at this tick.
    pub abort_at: Option<T>,
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
    pub row: Row,
    /// How far the database's clock is ahead of the ticks (its jumps).
    pub db_skew: T,
    pub db: Db,
    pub inst: Vec<Inst>,
    pub reqs: Vec<Req>,
    pub deliveries: Vec<u8>,
    /// Per lease: the newest epoch that arrived at the destination.
    pub max_arrived: [u8; MAX_LEASES],
    pub crashes: u8,
    pub pauses: u8,
    pub cuts: u8,
    pub writes: u8,
    pub losses: u8,
    pub slow: u8,
    pub handovers: u8,
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
    /// Instance i can no longer reach the lease store (it renews no row).
    CutStore(u8),
    /// The database's clock jumps forward.
    DbJump(T),
    /// Instance i reads the row (answered at once).
    Look(u8),
    /// Instance i reads the row, and the answer will come late.
    SlowRead(u8),
    /// The answer to instance i's slow read arrives.
    LookAnswer(u8),
    /// Instance i sends a renewal of the row it holds.
    SendRenew(u8),
    /// `take_from_latest_read`: instance i decides to take the row.
    DecideTake(u8),
    /// Instance i sends a take of the row (or of its own, again).
    SendTake(u8),
    /// Instance i, handing over, releases its row.
    SendRelease(u8),
    /// The database applies instance i's row write.
    Apply(u8),
    /// Instance i receives its row write's answer.
    Answer(u8),
    /// Instance i's row write's answer is lost (applied or not).
    LoseAnswer(u8),
    /// Instance i's forwarding deadline passed: its tenure stops (what is in
    /// flight is aborted at `gate_ttl` after the window's origin).
    Stop(u8),
    /// Instance i hands the shard over: it stops, its requests finish or are
    /// aborted a drain timeout later, then it releases the row.
    Handover(u8),
    /// A stopped tenure's request reaches its abort deadline.
    Abort(u8),
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

/// Whether two reads show the same row (what `look_round` compares).
fn same_row(a: &Row, b: &Row) -> bool {
    (a.gen, a.renewals, a.owner, a.released) == (b.gen, b.renewals, b.owner, b.released)
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

    /// Whether instance i serves a tenure whose fences are open.
    fn serving(s: &St, i: u8) -> bool {
        s.inst[i as usize].own.is_some_and(|o| o.closing.is_none())
    }

    /// Whether instance i may start a forward now: it serves, inside its window.
    fn in_window(&self, s: &St, i: u8) -> bool {
        let n = &s.inst[i as usize];
        Self::serving(s, i)
            && n.hold
                .is_some_and(|h| s.now < h.start + self.cfg.gate_ttl - self.cfg.margin)
    }

    /// The database's clock now.
    fn db_now(s: &St) -> T {
        s.now + s.db_skew
    }

    /// The pair instance i would take the row from now, if its reads say the
    /// row is free: never taken, released, or seen unchanged for `gate_ttl +
    /// grace` (on its own clock from the read that first showed it; with
    /// `take_on_db_clock`, on the database's clock from the commit). A single
    /// instance takes its own row back at once (its guard: the process that
    /// held it is provably gone).
    fn free_for(&self, s: &St, i: u8) -> Option<(u8, u8)> {
        let cfg = &self.cfg;
        let seen = s.inst[i as usize].seen?;
        let r = seen.row;
        let pair = Some((r.gen, r.renewals));
        if r.gen == 0 || r.released {
            return pair;
        }
        if cfg.instances == 1 && r.owner == Some(i) {
            return pair;
        }
        let wait = cfg.gate_ttl + cfg.grace;
        let old = if cfg.holes.take_on_db_clock {
            Self::db_now(s) >= r.at + wait
        } else {
            s.now >= seen.since + wait
        };
        if old {
            pair
        } else {
            None
        }
    }

    /// A state write under generation `gen`: refused once the row holds a
    /// newer one (`OWNER_OK`: the write share-locks the row, so it commits
    /// before a take or fails after it).
    fn db_write(s: &St, gen: u8) -> bool {
        s.row.gen <= gen
    }

    /// Whether instance i's tenure `gen` holds a pass of lease l below `epoch`
    /// (what its fence's drains count).
    fn older_passes(s: &St, i: u8, gen: u8, l: u8, epoch: u8, cfg: &Cfg) -> bool {
        s.reqs.iter().enumerate().any(|(r, q)| {
            q.phase.pass_of(i)
                && q.gen == gen
                && cfg.reqs[r].lease == l
                && cfg.reqs[r].epoch < epoch
        })
    }

    fn rec_expired(&self, s: &St, rec: &Rec) -> bool {
        let old = s.now >= rec.created.saturating_add(self.cfg.dedup_ttl);
        old && (rec.state == RecState::Done || self.cfg.holes.inflight_expires)
    }

    /// Grants r's pass at instance i: claims its key, records S3. False: refused.
    fn grant(&self, s: &mut St, i: u8, r: u8) -> bool {
        let spec = &self.cfg.reqs[r as usize];
        let gen = s.inst[i as usize].own.expect("serving").gen;
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
            if !Self::db_write(s, gen) {
                return false;
            }
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
        q.gen = gen;
        q.abort_at = None;
        true
    }

    /// Ends r's pass with its outcome unknown or aborted: its record is in
    /// doubt (a write under the pass's generation).
    fn doubt(&self, s: &mut St, r: u8) {
        if let Some(k) = self.cfg.reqs[r as usize].key {
            if Self::db_write(s, s.reqs[r as usize].gen) {
                if let Some(rec) = s.db.recs[k as usize].as_mut() {
                    if rec.state == RecState::InFlight {
                        rec.state = RecState::InDoubt;
                    }
                }
            }
        }
    }

    /// Aborts request r's pass now.
    fn abort(&self, s: &mut St, r: u8) {
        if !matches!(s.reqs[r as usize].phase, Phase::Lingering(_)) {
            self.doubt(s, r);
        }
        s.reqs[r as usize].phase = Phase::Gone;
        s.reqs[r as usize].abort_at = None;
    }

    /// Aborts instance i's passes of lease `l` (every lease: `None`) below
    /// `epoch` (all: `u8::MAX`) of tenure `gen` (any: `None`).
    fn abort_older(&self, s: &mut St, i: u8, gen: Option<u8>, l: Option<u8>, epoch: u8) {
        for r in 0..s.reqs.len() {
            let spec = &self.cfg.reqs[r];
            let q = &s.reqs[r];
            if q.phase.pass_of(i)
                && gen.is_none_or(|g| q.gen == g)
                && l.is_none_or(|l| spec.lease == l)
                && spec.epoch < epoch
            {
                self.abort(s, r as u8);
            }
        }
    }

    /// Refuses every request at instance i that holds no pass (the fences are
    /// gone).
    fn refuse_waiting(s: &mut St, i: u8) {
        for q in s.reqs.iter_mut() {
            if q.phase.at() == Some(i) && !q.phase.pass_of(i) {
                q.phase = Phase::Gone;
            }
        }
    }

    /// Instance i stops serving its tenure: nothing new is forwarded, what its
    /// tenure holds in flight is aborted at `deadline` (every lease alike).
    fn stop(&self, s: &mut St, i: u8, deadline: T) {
        let Some(o) = s.inst[i as usize].own.take() else {
            return;
        };
        Self::refuse_waiting(s, i);
        for q in s.reqs.iter_mut() {
            if q.phase.pass_of(i) && q.gen == o.gen {
                q.abort_at = Some(q.abort_at.map_or(deadline, |d| d.min(deadline)));
            }
        }
    }

    /// Instance i leaves the shard at once: every request it holds is aborted
    /// or refused, its fences are gone.
    fn drop_shard(&self, s: &mut St, i: u8) {
        self.abort_older(s, i, None, None, u8::MAX);
        Self::refuse_waiting(s, i);
        s.inst[i as usize].own = None;
    }

    /// `sequential_close`: the close's next step. It starts with lease 0's
    /// fence; a fence whose deadline passed has its requests aborted; then the
    /// next lease's fence closes with a deadline of `margin` from now; after
    /// the last one the shard is dropped.
    fn close_step(&self, s: &mut St, i: u8) {
        let o = s.inst[i as usize].own.expect("owner");
        let next = match o.closing {
            None => {
                Self::refuse_waiting(s, i);
                0
            }
            Some((l, _)) => {
                self.abort_older(s, i, Some(o.gen), Some(l), u8::MAX);
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

    /// Instance i's take of the row succeeded under generation g (the row's
    /// previous owner `prev`): a new tenure (SPEC §10.2).
    fn took(&self, s: &mut St, i: u8, g: u8, prev: Option<u8>, sent: T) {
        let cfg = &self.cfg;
        if s.row.gen > g {
            // Taken again meanwhile: its claim fails (`OwnerLost`), it hands
            // the row back (the release matches nothing).
            s.inst[i as usize].hold = None;
            return;
        }
        // What this instance still serves or has in flight from an earlier
        // tenure: the new tenure replaces it. A stopped tenure's requests are
        // aborted now (unless `retake_spares_stopped`: at their own deadline).
        if s.inst[i as usize].own.is_some() {
            let d = s.now;
            self.stop(s, i, d);
        }
        if !cfg.holes.retake_spares_stopped {
            self.abort_older(s, i, None, None, u8::MAX);
        }
        if let Some(p) = prev {
            if p != i && !s.inst[p as usize].up {
                s.flags |= flag::TAKEOVER_AFTER_DEATH;
            }
            if p != i {
                s.flags |= flag::TAKEN_OVER;
            }
        }
        let from_window = if cfg.holes.window_from_confirm {
            s.now
        } else {
            sent
        };
        let old = s.inst[i as usize].hold;
        s.inst[i as usize].hold = Some(Hold {
            gen: g,
            renewals: 0,
            start: old.map_or(from_window, |h| h.start.max(from_window)),
            last_sent: old.map_or(sent, |h| h.last_sent.max(sent)),
            retake: false,
            leaving: false,
            wait: false,
        });
        // Recovery: the older generations' in-flight records are in doubt.
        for rec in s.db.recs.iter_mut().flatten() {
            if rec.state == RecState::InFlight && rec.gen < g {
                rec.state = RecState::InDoubt;
            }
        }
        let cluster = cfg.instances > 1;
        let from_other = prev.is_some_and(|p| p != i);
        let mut fences = [Fence::default(); MAX_LEASES];
        for (l, f) in fences.iter_mut().enumerate().take(cfg.leases as usize) {
            let mark = if cluster {
                s.db.mark[l].max(Self::latest_epoch(s, l as u8))
            } else {
                s.db.mark[l]
            };
            s.db.mark[l] = mark;
            let settle = mark > 0 && !(cluster && from_other && cfg.holes.no_takeover_settle);
            let settled = if settle && !cfg.holes.forget_drain {
                s.db.drained[l].min(mark)
            } else {
                mark
            };
            *f = Fence {
                mark,
                barrier: mark,
                settled,
                settle_until: if settle {
                    s.now + cfg.drain_timeout
                } else {
                    s.now
                },
                raise: None,
            };
        }
        s.inst[i as usize].own = Some(Own {
            gen: g,
            fences,
            closing: None,
        });
    }

    /// Instance i's row write was answered.
    fn answered(&self, s: &mut St, i: u8, op: Op, answer: Answer) {
        match (op.kind, answer) {
            (OpKind::Take(..), Answer::Took(Some((g, prev)))) => self.took(s, i, g, prev, op.sent),
            (OpKind::Renew(gen), Answer::Renewed(Some(n))) => {
                let from_window = if self.cfg.holes.window_from_confirm {
                    s.now
                } else {
                    op.sent
                };
                let serving = s.inst[i as usize].own.is_some();
                if let Some(h) = s.inst[i as usize].hold.as_mut().filter(|h| h.gen == gen) {
                    h.renewals = n;
                    h.start = h.start.max(from_window);
                    // Stopped while its renewals failed, owned still: a new
                    // tenure under a new generation.
                    if !serving && !h.leaving {
                        h.retake = true;
                    }
                }
            }
            // Its row changed: the shard is lost, stopped now.
            (OpKind::Renew(gen), Answer::Renewed(None))
                if s.inst[i as usize].hold.is_some_and(|h| h.gen == gen) =>
            {
                s.inst[i as usize].hold = None;
                let d = s.now;
                self.stop(s, i, d);
            }
            _ => {}
        }
    }

    /// Applies instance i's row write at the database.
    fn apply(&self, s: &mut St, i: u8) {
        let op = s.inst[i as usize].op.expect("op");
        let at = if self.cfg.holes.take_on_db_clock {
            Self::db_now(s)
        } else {
            0
        };
        let r = &mut s.row;
        let answer = match op.kind {
            OpKind::Renew(gen) => {
                if r.gen == gen && r.owner == Some(i) && !r.released {
                    r.renewals += 1;
                    r.at = at;
                    Answer::Renewed(Some(r.renewals))
                } else {
                    Answer::Renewed(None)
                }
            }
            OpKind::Take(0, _) => {
                if r.gen == 0 {
                    *r = Row {
                        gen: 1,
                        renewals: 0,
                        owner: Some(i),
                        released: false,
                        at,
                    };
                    Answer::Took(Some((1, None)))
                } else {
                    Answer::Took(None)
                }
            }
            OpKind::Take(gen, n) => {
                if r.gen == gen && (r.renewals == n || self.cfg.holes.take_unconditioned) {
                    let prev = r.owner;
                    *r = Row {
                        gen: gen + 1,
                        renewals: 0,
                        owner: Some(i),
                        released: false,
                        at,
                    };
                    Answer::Took(Some((gen + 1, prev)))
                } else {
                    Answer::Took(None)
                }
            }
            OpKind::Release(gen) => {
                if r.gen == gen && r.owner == Some(i) {
                    r.released = true;
                }
                Answer::Released
            }
        };
        s.inst[i as usize].op = Some(Op {
            applied: Some((s.now, answer)),
            ..op
        });
        // Contenders read the row continuously: each running one without a
        // slow read in flight sees the change at once (a paused one when it
        // wakes, `Look`).
        let row = s.row;
        for j in 0..self.cfg.instances {
            let n = &s.inst[j as usize];
            if self.running(s, j) && n.hold.is_none() && n.look.is_none() && n.seen.is_some() {
                Self::saw(s, j, row);
            }
        }
    }

    /// Instance i sends a row write (applied at once when the database has no
    /// delay).
    fn send_op(&self, s: &mut St, i: u8, kind: OpKind) {
        s.inst[i as usize].op = Some(Op {
            kind,
            sent: s.now,
            applied: None,
        });
        if self.cfg.db_delay == 0 {
            self.apply(s, i);
            if self.cfg.db_losses == 0 {
                let op = s.inst[i as usize].op.take().expect("op");
                let (_, answer) = op.applied.expect("applied");
                self.answered(s, i, op, answer);
            }
        }
    }

    /// Instance i's read arrives, showing `row`: `since` moves if it changed.
    fn saw(s: &mut St, i: u8, row: Row) {
        let now = s.now;
        let n = &mut s.inst[i as usize];
        n.seen = Some(match n.seen {
            Some(old) if same_row(&old.row, &row) => Seen { row, ..old },
            _ => Seen { row, since: now },
        });
    }

    /// Instance i's enabled steps (all urgent).
    fn inst_actions(&self, s: &St, i: u8, out: &mut Vec<Action>) {
        let cfg = &self.cfg;
        let n = &s.inst[i as usize];
        if let (Some(o), Some(h)) = (n.own, n.hold) {
            let forward_deadline = h.start + cfg.gate_ttl - cfg.margin;
            if cfg.holes.sequential_close {
                let due = match o.closing {
                    None => s.now >= forward_deadline,
                    Some((l, deadline)) => {
                        s.now >= deadline || !Self::older_passes(s, i, o.gen, l, u8::MAX, cfg)
                    }
                };
                if due {
                    out.push(Action::CloseStep(i));
                }
            } else if s.now >= forward_deadline {
                out.push(Action::Stop(i));
            }
        }
        for (r, q) in s.reqs.iter().enumerate() {
            if q.phase.pass_of(i) && q.abort_at.is_some_and(|d| s.now >= d) {
                out.push(Action::Abort(r as u8));
            }
        }
        // The database's answer (urgent only once overdue: `may_tick`).
        if n.op.is_some_and(|op| op.applied.is_some()) {
            out.push(Action::Answer(i));
        }
        // A contender reads the row continuously: every change is seen at
        // once, unless a slow read is in flight.
        if n.hold.is_none() {
            match n.look {
                None if n.seen.is_none_or(|v| !same_row(&v.row, &s.row)) => {
                    out.push(Action::Look(i))
                }
                None => {}
                Some(_) => out.push(Action::LookAnswer(i)),
            }
        }
        let may_write = n.op.is_none() && !n.cut && s.writes < cfg.row_writes;
        if let Some(h) = n.hold {
            let drained = !s.reqs.iter().any(|q| q.phase.pass_of(i));
            if h.leaving && n.op.is_none() && (drained || !h.wait) {
                out.push(Action::SendRelease(i));
            }
            if h.retake && may_write {
                out.push(Action::SendTake(i));
            }
            if may_write && !h.retake && cfg.renew && s.now >= h.last_sent + cfg.gate_ttl / 3 {
                out.push(Action::SendRenew(i));
            }
        } else if n.deciding {
            if may_write {
                out.push(Action::SendTake(i));
            }
        } else if may_write && n.look.is_none() && self.free_for(s, i).is_some() {
            out.push(if cfg.holes.take_from_latest_read {
                Action::DecideTake(i)
            } else {
                Action::SendTake(i)
            });
        }
        if let Some(o) = n.own {
            for (l, f) in o.fences.iter().enumerate().take(cfg.leases as usize) {
                let l = l as u8;
                let Some(rz) = f.raise else { continue };
                let ready = match rz.phase {
                    RaisePhase::Settling => s.now >= f.settle_until,
                    RaisePhase::Draining { deadline, aborted } => {
                        !Self::older_passes(s, i, o.gen, l, rz.epoch, cfg)
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

    /// Time may pass only when no running instance has a step to take and
    /// nothing at the database is overdue.
    fn may_tick(&self, s: &St) -> bool {
        let cfg = &self.cfg;
        if s.now >= cfg.horizon {
            return false;
        }
        let mut acts = Vec::new();
        for i in 0..cfg.instances {
            let n = &s.inst[i as usize];
            if let Some(op) = n.op {
                match op.applied {
                    None if s.now >= op.sent + cfg.db_delay => return false,
                    Some((a, _)) if self.running(s, i) && s.now >= a + cfg.db_delay => {
                        return false
                    }
                    _ => {}
                }
            }
            if let Some(l) = n.look {
                if self.running(s, i) && s.now >= l.read + cfg.look_delay {
                    return false;
                }
            }
            if self.running(s, i) {
                acts.clear();
                self.inst_actions(s, i, &mut acts);
                if acts
                    .iter()
                    .any(|a| !matches!(a, Action::Answer(_) | Action::LookAnswer(_)))
                {
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
        let o = s.inst[i as usize].own.expect("in window");
        let f = o.fences[l];
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
        if !Self::db_write(s, o.gen) {
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
        let gen = s.inst[i as usize].own.expect("owner").gen;
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
            RaisePhase::Draining { deadline, .. }
                if Self::older_passes(s, i, gen, l, rz.epoch, cfg) =>
            {
                self.abort_older(s, i, Some(gen), Some(l), rz.epoch);
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
                if Self::db_write(s, gen) {
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

    fn init(&self) -> St {
        let cfg = &self.cfg;
        let wep = std::array::from_fn(|l| {
            let mut w = vec![];
            if l < cfg.leases as usize {
                w = vec![None; cfg.worker_epochs[l] as usize];
                w[0] = Some(0);
            }
            w
        });
        St {
            now: 0,
            wep,
            row: Row {
                gen: 0,
                renewals: 0,
                owner: None,
                released: false,
                at: 0,
            },
            db_skew: 0,
            db: Db {
                mark: [0; MAX_LEASES],
                drained: [0; MAX_LEASES],
                recs: vec![None; cfg.keys()],
            },
            inst: vec![
                Inst {
                    up: true,
                    paused_until: 0,
                    cut: false,
                    hold: None,
                    own: None,
                    op: None,
                    look: None,
                    seen: None,
                    deciding: false,
                };
                cfg.instances as usize
            ],
            reqs: vec![
                Req {
                    phase: Phase::Unsent,
                    passed: 0,
                    gen: 0,
                    abort_at: None,
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
            writes: 0,
            losses: 0,
            slow: 0,
            handovers: 0,
            flags: 0,
        }
    }
}

impl Model for Proto {
    type State = St;
    type Action = Action;

    fn init_states(&self) -> Vec<St> {
        vec![self.init()]
    }

    fn actions(&self, s: &St, out: &mut Vec<Action>) {
        let cfg = &self.cfg;
        for i in 0..cfg.instances {
            let n = &s.inst[i as usize];
            if self.running(s, i) {
                self.inst_actions(s, i, out);
            }
            if let Some(op) = n.op {
                if op.applied.is_none() {
                    out.push(Action::Apply(i));
                }
                if s.losses < cfg.db_losses {
                    out.push(Action::LoseAnswer(i));
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
            if self.running(s, i) && n.hold.is_none() && n.look.is_none() && s.slow < cfg.slow_reads
            {
                out.push(Action::SlowRead(i));
            }
            let handing =
                n.hold.is_some_and(|h| !h.leaving) && n.own.is_none_or(|o| o.closing.is_none());
            if self.running(s, i) && handing && s.handovers < cfg.handovers {
                out.push(Action::Handover(i));
            }
        }
        if s.db_skew == 0 {
            for k in 1..=cfg.db_jump {
                out.push(Action::DbJump(k));
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
                    if self.running(s, i) && Self::serving(s, i) {
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
                    cut: s.inst[i as usize].cut,
                    hold: None,
                    own: None,
                    op: None,
                    look: None,
                    seen: None,
                    deciding: false,
                };
                for q in s.reqs.iter_mut() {
                    if q.phase.at() == Some(i) {
                        q.phase = Phase::Gone;
                        q.abort_at = None;
                    }
                }
            }
            Action::Restart(i) => s.inst[i as usize].up = true,
            Action::CutStore(i) => {
                s.cuts += 1;
                s.inst[i as usize].cut = true;
            }
            Action::DbJump(k) => s.db_skew = k,
            Action::Pause(i, k) => {
                s.pauses += 1;
                s.inst[i as usize].paused_until = s.now + k;
            }
            Action::Look(i) => {
                let row = s.row;
                Self::saw(&mut s, i, row);
            }
            Action::SlowRead(i) => {
                s.slow += 1;
                s.inst[i as usize].look = Some(Look {
                    row: s.row,
                    read: s.now,
                });
            }
            Action::LookAnswer(i) => {
                let l = s.inst[i as usize].look.take().expect("look");
                Self::saw(&mut s, i, l.row);
            }
            Action::SendRenew(i) => {
                s.writes += 1;
                let h = s.inst[i as usize].hold.as_mut().expect("hold");
                h.last_sent = s.now;
                let gen = h.gen;
                self.send_op(&mut s, i, OpKind::Renew(gen));
            }
            Action::DecideTake(i) => s.inst[i as usize].deciding = true,
            Action::SendTake(i) => {
                s.writes += 1;
                let n = &mut s.inst[i as usize];
                let (g, k) = if let Some(h) = n.hold.as_mut() {
                    h.retake = false;
                    (h.gen, h.renewals)
                } else if n.deciding {
                    n.deciding = false;
                    let r = n.seen.expect("seen").row;
                    (r.gen, r.renewals)
                } else {
                    self.free_for(&s, i).expect("free")
                };
                self.send_op(&mut s, i, OpKind::Take(g, k));
            }
            Action::SendRelease(i) => {
                let h = s.inst[i as usize].hold.take().expect("hold");
                self.send_op(&mut s, i, OpKind::Release(h.gen));
            }
            Action::Apply(i) => self.apply(&mut s, i),
            Action::Answer(i) => {
                let op = s.inst[i as usize].op.take().expect("op");
                let (_, answer) = op.applied.expect("applied");
                self.answered(&mut s, i, op, answer);
            }
            Action::LoseAnswer(i) => {
                s.losses += 1;
                s.inst[i as usize].op = None;
            }
            Action::Stop(i) => {
                let h = s.inst[i as usize].hold.expect("hold");
                self.stop(&mut s, i, h.start + cfg.gate_ttl);
            }
            Action::Handover(i) => {
                s.handovers += 1;
                let serving = s.inst[i as usize].own.is_some();
                let h = s.inst[i as usize].hold.as_mut().expect("hold");
                h.leaving = true;
                h.wait = serving || !cfg.holes.handover_spares_stopped;
                let deadline = (s.now + cfg.drain_timeout).min(h.start + cfg.gate_ttl);
                if serving {
                    self.stop(&mut s, i, deadline);
                } else if !cfg.holes.handover_spares_stopped {
                    // Stopped already: what it still has in flight is held to
                    // the handover's deadline too, and released after.
                    for q in s.reqs.iter_mut() {
                        if q.phase.pass_of(i) {
                            q.abort_at = Some(q.abort_at.map_or(deadline, |d| d.min(deadline)));
                        }
                    }
                }
            }
            Action::Abort(r) => self.abort(&mut s, r),
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
                if let Some(k) = cfg.reqs[r as usize].key {
                    if Self::db_write(&s, s.reqs[r as usize].gen) {
                        if let Some(rec) = s.db.recs[k as usize].as_mut() {
                            rec.state = RecState::Done;
                        }
                    }
                }
                s.reqs[r as usize].phase = Phase::Gone;
                s.reqs[r as usize].abort_at = None;
            }
            Action::RouteTimeout(r) => {
                let i = s.reqs[r as usize].phase.at().expect("forwarded");
                self.doubt(&mut s, r);
                if cfg.holes.timeout_leaves {
                    s.reqs[r as usize].phase = Phase::Gone;
                    s.reqs[r as usize].abort_at = None;
                } else {
                    s.reqs[r as usize].phase = Phase::Lingering(i);
                }
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
