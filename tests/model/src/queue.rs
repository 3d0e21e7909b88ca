//! A `stateright` model of queued delivery (SPEC §11) across owners: one
//! lease's queue in the database, the deliverers of one to three instances,
//! takeovers, an operator's retry and drop, and a destination that records
//! what arrived.
//!
//! It models the *protocol* of `src/queue/deliver.rs` and `src/queue/edits.rs`,
//! not their code. What the main model ([`crate::Proto`]) shows is taken as
//! given here: a take comes only after the previous owner's window closed (it
//! self-fences at `gate_ttl − margin`; its attempt out is cut at its tenure's
//! abort deadline, before anyone may take), and a message's place is taken
//! under its request's gate pass, so the queue as accepted is in epoch order
//! ([`QCfg::epochs`]; acceptance is not modelled).
//!
//! A deliverer goes through the steps of one attempt, each an action of its
//! own so that any other instance, the operator or the nemesis can act between
//! them:
//! 1. *read* the head: the message with the lowest place among the `pending`
//!    and `delivering` ones (a `delivering` head had an attempt out whose
//!    outcome is unknown: it is sent again first);
//! 2. *check*, under the instance's edits lock, that the message is as read
//!    (an operator may have changed it since);
//! 3. *start*: write it `delivering` — the whole message as read, its place
//!    included — and raise the lease's sent epoch, conditioned on the owner
//!    generation; the lock is released;
//! 4. *send*, only while the instance's window is open (the last check, right
//!    before the send): else the attempt is *not sent* and written `pending`
//!    again;
//! 5. the destination *answers*: 2xx (`delivered`), a status worth another
//!    attempt (`pending`), or a 4xx (`failed`, [`QCfg::fails`]); a window that
//!    closes meanwhile cuts the attempt (`pending`, outcome unknown);
//! 6. *settle*: the outcome written, conditioned on the owner generation.
//!
//! A write whose generation is not the row's fails, and the instance learns it
//! was deposed. The nemesis closes an owner's window ([`QCfg::expiries`]; the
//! owner renews it while its generation is the row's), takes the shard for
//! another instance or for the same one restarted (losing what it had in
//! memory, a write it had not made among it) ([`QCfg::takes`]). The operator
//! retries a failed message (refused when a message of a newer epoch of the
//! lease was ever started or waits) and drops a pending or failed one, on the
//! instance that owns the shard, under its edits lock, conditioned on its
//! generation.
//!
//! Properties ([`QProto::properties`]), at the destination:
//! - **Q1** epochs never go back.
//! - **Q2** places never go back: a message arrives only once every message
//!   placed before it is settled (an attempt sent again, after an unknown
//!   outcome, arrives at the place it had; an operator's retry gives a new
//!   place at the end).
//! - **Q3** a message written `delivered` or `dropped` never arrives again.
//! - **Q4** every message settles: a state with nothing left to do has every
//!   message settled.
//! - reachability: a message sent again after a takeover; a retried message
//!   delivered.

use stateright::{Model, Property};

/// Designs other than the protocol's, each breaking one property.
#[derive(Clone, Debug, Default)]
pub struct QHoles {
    /// The deliverer's writes (start, not sent, settle) are not conditioned on
    /// the owner generation: a deposed owner's stale write lands.
    pub ignore_generation: bool,
    /// An operator's retry does not look for a newer epoch's message sent or
    /// waiting.
    pub retry_past_newer: bool,
    /// The start is not preceded by the check under the edits lock: an
    /// operator's drop between the read and the start is overwritten.
    pub no_recheck: bool,
    /// A `delivering` head (an attempt whose outcome is unknown) is passed over
    /// as if settled.
    pub skip_delivering: bool,
}

/// The bounds and the nemesis's budget.
#[derive(Clone, Debug)]
pub struct QCfg {
    pub instances: u8,
    /// The lease's messages as accepted, in place order: each one's epoch.
    pub epochs: Vec<u8>,
    /// Takes of the shard (by another instance, or a restart of its owner).
    pub takes: u8,
    /// Windows closed (an owner's renewals late past `gate_ttl − margin`).
    pub expiries: u8,
    /// Answers that fail a message for good (a 4xx).
    pub fails: u8,
    /// An operator's retries.
    pub retries: u8,
    /// An operator's drops.
    pub drops: u8,
    pub holes: QHoles,
}

impl QCfg {
    /// Two instances, three messages over two epochs, three takes (restarts
    /// among them), three closed windows, two failures, two retries, a drop.
    pub fn two_owners() -> QCfg {
        QCfg {
            instances: 2,
            epochs: vec![1, 1, 2],
            takes: 3,
            expiries: 3,
            fails: 2,
            retries: 2,
            drops: 1,
            holes: QHoles::default(),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Status {
    Pending,
    Delivering,
    Delivered,
    Failed,
    Dropped,
}

impl Status {
    fn settled(self) -> bool {
        matches!(self, Status::Delivered | Status::Failed | Status::Dropped)
    }
}

/// A message's row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Msg {
    pub epoch: u8,
    /// Its place in the lease's queue.
    pub seq: u8,
    pub status: Status,
}

/// What an attempt came to (written at the settle).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    Delivered,
    Again,
    Failed,
}

/// A deliverer's step; each carries the message as it was read (`m`: its
/// index; the row as read).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Step {
    Idle,
    Read(u8, Msg),
    /// Checked under the edits lock (held until the start is written).
    Checked(u8, Msg),
    Started(u8, Msg),
    Sent(u8, Msg),
    Answered(u8, Msg, Outcome),
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct QInst {
    /// The generation it took the shard under (None: it learned it was
    /// deposed, or never took it).
    pub gen: Option<u8>,
    /// Its window is open: it may send.
    pub window: bool,
    pub step: Step,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct QSt {
    /// The shard's owner generation (the row's).
    pub gen: u8,
    pub next_seq: u8,
    /// The newest epoch of which an attempt was ever started.
    pub sent_epoch: u8,
    pub msgs: Vec<Msg>,
    pub insts: Vec<QInst>,
    /// The last arrival at the destination: (epoch, place).
    pub last: Option<(u8, u8)>,
    /// Messages that ever arrived (bits), and those ever written delivered or
    /// dropped.
    pub arrived: u8,
    pub finished: u8,
    pub flags: u8,
    pub takes: u8,
    pub expiries: u8,
    pub fails: u8,
    pub retries: u8,
    pub drops: u8,
}

pub mod qprop {
    pub const Q1: &str = "Q1 epochs never go back at the destination";
    pub const Q2: &str = "Q2 places never go back at the destination";
    pub const Q3: &str = "Q3 a delivered or dropped message never arrives again";
    pub const Q4: &str = "Q4 every message settles";
    pub const RESENT_AFTER_TAKE: &str = "a message is sent again after a take";
    pub const RETRIED_DELIVERED: &str = "a retried message is delivered";
}

mod qflag {
    pub const Q1: u8 = 1;
    pub const Q2: u8 = 2;
    pub const Q3: u8 = 4;
    pub const RESENT_AFTER_TAKE: u8 = 8;
    pub const RETRIED_DELIVERED: u8 = 16;
    /// A take happened (for the reachability above).
    pub const TOOK: u8 = 32;
    /// A retry was written (for the reachability above).
    pub const RETRIED: u8 = 64;
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QAction {
    Read(u8),
    Check(u8),
    Start(u8),
    Send(u8),
    Answer(u8, Outcome),
    Settle(u8),
    Expire(u8),
    Renew(u8),
    Take(u8),
    Retry(u8, u8),
    Drop(u8, u8),
}

pub struct QProto {
    pub cfg: QCfg,
}

impl QProto {
    pub fn new(cfg: QCfg) -> QProto {
        QProto { cfg }
    }

    /// The head a deliverer reads: the lowest place not settled.
    fn head(&self, s: &QSt) -> Option<u8> {
        s.msgs
            .iter()
            .enumerate()
            .filter(|(_, m)| match m.status {
                Status::Pending => true,
                Status::Delivering => !self.cfg.holes.skip_delivering,
                _ => false,
            })
            .min_by_key(|(_, m)| m.seq)
            .map(|(i, _)| i as u8)
    }

    /// The instance holding the row's generation, if one does.
    fn holder(s: &QSt) -> Option<u8> {
        s.insts
            .iter()
            .position(|i| i.gen == Some(s.gen))
            .map(|i| i as u8)
    }

    /// A write of instance `i` conditioned on the owner generation; a refused
    /// one tells the instance it was deposed.
    fn fenced(&self, s: &mut QSt, i: u8, unconditioned: bool) -> bool {
        let inst = &mut s.insts[i as usize];
        if unconditioned || inst.gen == Some(s.gen) {
            return true;
        }
        inst.gen = None;
        inst.window = false;
        inst.step = Step::Idle;
        false
    }

    /// Whether the operator may act on instance `i` now: it serves the shard
    /// (window open) and its edits lock is free.
    fn operator_on(s: &QSt, i: u8) -> bool {
        let inst = &s.insts[i as usize];
        inst.gen.is_some() && inst.window && !matches!(inst.step, Step::Checked(..))
    }

    fn arrive(s: &mut QSt, m: u8) {
        let msg = s.msgs[m as usize];
        if let Some((e, seq)) = s.last {
            if msg.epoch < e {
                s.flags |= qflag::Q1;
            }
            if msg.seq < seq {
                s.flags |= qflag::Q2;
            }
        }
        if s.finished & (1 << m) != 0 {
            s.flags |= qflag::Q3;
        }
        if s.arrived & (1 << m) != 0 && s.flags & qflag::TOOK != 0 {
            s.flags |= qflag::RESENT_AFTER_TAKE;
        }
        s.arrived |= 1 << m;
        s.last = Some((msg.epoch, msg.seq));
    }
}

impl Model for QProto {
    type State = QSt;
    type Action = QAction;

    fn init_states(&self) -> Vec<QSt> {
        let msgs: Vec<Msg> = self
            .cfg
            .epochs
            .iter()
            .enumerate()
            .map(|(i, &epoch)| Msg {
                epoch,
                seq: i as u8,
                status: Status::Pending,
            })
            .collect();
        let mut insts = vec![
            QInst {
                gen: None,
                window: false,
                step: Step::Idle,
            };
            self.cfg.instances as usize
        ];
        insts[0] = QInst {
            gen: Some(1),
            window: true,
            step: Step::Idle,
        };
        vec![QSt {
            gen: 1,
            next_seq: msgs.len() as u8,
            sent_epoch: 0,
            msgs,
            insts,
            last: None,
            arrived: 0,
            finished: 0,
            flags: 0,
            takes: self.cfg.takes,
            expiries: self.cfg.expiries,
            fails: self.cfg.fails,
            retries: self.cfg.retries,
            drops: self.cfg.drops,
        }]
    }

    fn actions(&self, s: &QSt, out: &mut Vec<QAction>) {
        for (i, inst) in s.insts.iter().enumerate() {
            let i = i as u8;
            match inst.step {
                Step::Idle => {
                    if inst.gen.is_some() && inst.window && self.head(s).is_some() {
                        out.push(QAction::Read(i));
                    }
                }
                Step::Read(..) => out.push(QAction::Check(i)),
                Step::Checked(..) => out.push(QAction::Start(i)),
                Step::Started(..) => out.push(QAction::Send(i)),
                Step::Sent(..) => {
                    out.push(QAction::Answer(i, Outcome::Delivered));
                    out.push(QAction::Answer(i, Outcome::Again));
                    if s.fails > 0 {
                        out.push(QAction::Answer(i, Outcome::Failed));
                    }
                }
                Step::Answered(..) => out.push(QAction::Settle(i)),
            }
            if inst.window && s.expiries > 0 {
                out.push(QAction::Expire(i));
            }
            if !inst.window && inst.gen == Some(s.gen) {
                out.push(QAction::Renew(i));
            }
            if Self::operator_on(s, i) {
                for (m, msg) in s.msgs.iter().enumerate() {
                    if msg.status == Status::Failed && s.retries > 0 {
                        out.push(QAction::Retry(i, m as u8));
                    }
                    if matches!(msg.status, Status::Pending | Status::Failed) && s.drops > 0 {
                        out.push(QAction::Drop(i, m as u8));
                    }
                }
            }
        }
        // A take comes once the holder's window closed (the main model's
        // timing: its attempt out was cut by then).
        let free = Self::holder(s).is_none_or(|h| !s.insts[h as usize].window);
        if s.takes > 0 && free {
            for j in 0..self.cfg.instances {
                out.push(QAction::Take(j));
            }
        }
    }

    fn next_state(&self, last: &QSt, action: QAction) -> Option<QSt> {
        let mut s = last.clone();
        let holes = &self.cfg.holes;
        match action {
            QAction::Read(i) => {
                let m = self.head(&s)?;
                s.insts[i as usize].step = Step::Read(m, s.msgs[m as usize]);
            }
            QAction::Check(i) => {
                let Step::Read(m, read) = s.insts[i as usize].step else {
                    return None;
                };
                s.insts[i as usize].step = if holes.no_recheck || s.msgs[m as usize] == read {
                    Step::Checked(m, read)
                } else {
                    Step::Idle
                };
            }
            QAction::Start(i) => {
                let Step::Checked(m, read) = s.insts[i as usize].step else {
                    return None;
                };
                if self.fenced(&mut s, i, holes.ignore_generation) {
                    let mut w = read;
                    w.status = Status::Delivering;
                    s.msgs[m as usize] = w;
                    s.sent_epoch = s.sent_epoch.max(w.epoch);
                    s.insts[i as usize].step = Step::Started(m, w);
                }
            }
            QAction::Send(i) => {
                let Step::Started(m, w) = s.insts[i as usize].step else {
                    return None;
                };
                if s.insts[i as usize].window {
                    Self::arrive(&mut s, m);
                    s.insts[i as usize].step = Step::Sent(m, w);
                } else if self.fenced(&mut s, i, holes.ignore_generation) {
                    // Not sent: pending again, no attempt spent.
                    let mut p = w;
                    p.status = Status::Pending;
                    s.msgs[m as usize] = p;
                    s.insts[i as usize].step = Step::Idle;
                }
            }
            QAction::Answer(i, o) => {
                let Step::Sent(m, w) = s.insts[i as usize].step else {
                    return None;
                };
                if o == Outcome::Failed {
                    s.fails -= 1;
                }
                s.insts[i as usize].step = Step::Answered(m, w, o);
            }
            QAction::Settle(i) => {
                let Step::Answered(m, w, o) = s.insts[i as usize].step else {
                    return None;
                };
                if self.fenced(&mut s, i, holes.ignore_generation) {
                    let mut done = w;
                    done.status = match o {
                        Outcome::Delivered => Status::Delivered,
                        Outcome::Again => Status::Pending,
                        Outcome::Failed => Status::Failed,
                    };
                    if done.status == Status::Delivered {
                        s.finished |= 1 << m;
                        if s.flags & qflag::RETRIED != 0 && done.seq >= self.cfg.epochs.len() as u8
                        {
                            s.flags |= qflag::RETRIED_DELIVERED;
                        }
                    }
                    s.msgs[m as usize] = done;
                    s.insts[i as usize].step = Step::Idle;
                }
            }
            QAction::Expire(i) => {
                s.expiries -= 1;
                let inst = &mut s.insts[i as usize];
                inst.window = false;
                // The tenure's end cuts the attempt out: its outcome unknown.
                if let Step::Sent(m, w) = inst.step {
                    inst.step = Step::Answered(m, w, Outcome::Again);
                }
            }
            QAction::Renew(i) => {
                s.insts[i as usize].window = true;
            }
            QAction::Take(j) => {
                s.takes -= 1;
                s.gen += 1;
                s.flags |= qflag::TOOK;
                // A new tenure (or a restart) starts from the queue's head;
                // what the taker had in memory is gone.
                s.insts[j as usize] = QInst {
                    gen: Some(s.gen),
                    window: true,
                    step: Step::Idle,
                };
            }
            QAction::Retry(i, m) => {
                s.retries -= 1;
                if !self.fenced(&mut s, i, false) {
                    return Some(s);
                }
                let msg = s.msgs[m as usize];
                let newer = s.sent_epoch > msg.epoch
                    || s.msgs.iter().any(|o| {
                        o.epoch > msg.epoch
                            && matches!(o.status, Status::Pending | Status::Delivering)
                    });
                if newer && !holes.retry_past_newer {
                    return Some(s); // 409 delivery_superseded
                }
                s.msgs[m as usize] = Msg {
                    seq: s.next_seq,
                    status: Status::Pending,
                    ..msg
                };
                s.next_seq += 1;
                s.flags |= qflag::RETRIED;
            }
            QAction::Drop(i, m) => {
                s.drops -= 1;
                if self.fenced(&mut s, i, false) {
                    s.msgs[m as usize].status = Status::Dropped;
                    s.finished |= 1 << m;
                }
            }
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(qprop::Q1, |_, s: &QSt| s.flags & qflag::Q1 == 0),
            Property::always(qprop::Q2, |_, s: &QSt| s.flags & qflag::Q2 == 0),
            Property::always(qprop::Q3, |_, s: &QSt| s.flags & qflag::Q3 == 0),
            // On every path's last state: nothing left to do means every
            // message settled.
            Property::always(qprop::Q4, |model: &QProto, s: &QSt| {
                let mut next = Vec::new();
                model.actions(s, &mut next);
                !next.is_empty() || s.msgs.iter().all(|m| m.status.settled())
            }),
            Property::sometimes(qprop::RESENT_AFTER_TAKE, |_, s: &QSt| {
                s.flags & qflag::RESENT_AFTER_TAKE != 0
            }),
            Property::sometimes(qprop::RETRIED_DELIVERED, |_, s: &QSt| {
                s.flags & qflag::RETRIED_DELIVERED != 0
            }),
        ]
    }
}
