//! The single-instance campaign's clone step (issue 25, point 4): a second
//! fencegate started with a copy of the running instance's `data_dir` — its
//! `instance-id` alone, or the whole directory (sled files included, copied
//! live) — on the same store and prefix, with its address in the workers'
//! `proxy.addr` (half the requests go to it), once while the original runs and
//! once while the original is SIGSTOPped (resumed as soon as the copy's start-up
//! is over: well within the original's gate lease; its connections to the store
//! are cut at the freeze, through its own relay, so that a store call it was in
//! the middle of does not hold the single-threaded S3 server).
//!
//! Expected (SPEC §10.1): the copy exits 2 both times — the guard is held under
//! its own id by a process that is not provably gone — and is logged in the
//! nemesis timeline as refused, with its reason. A build that lets it in (it
//! took its "own" gate back at once) has two processes forwarding with their
//! own marks and dedup records: the copy serves for [`CLONE_SERVES`], then is
//! killed (kill -9, so that it writes no release under the shared id), and the
//! checker judges what reached the destination meanwhile.
//!
//! In runs of a minute or more a third variant follows, 20 s later: the
//! original frozen, its whole `data_dir` copied while it is frozen (the copy
//! has exactly its state), the copy started again every 500 ms until the
//! frozen original's gate lease and grace have ended and it takes the guard
//! over (legitimately: a failover with the same state), then the original
//! resumed beside it for [`CLONE_SERVES`]: it must find its id held by another
//! process, stop forwarding and say so (the step counts the lines). The checker
//! judges both; then the copy is killed, and the original waits out the copy's
//! gate lease before it serves again.

use super::*;
use crate::support::state_dir;

/// The first clone step starts this long after the faults, the stopped variant
/// right after it, and both again this long after the last one.
const CLONE_FIRST: Duration = Duration::from_secs(6);
const CLONE_EVERY: Duration = Duration::from_secs(60);
/// How long a copy that was let in serves beside the original.
const CLONE_SERVES: Duration = Duration::from_secs(6);

/// What the original does while the copy starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Original {
    Running,
    /// SIGSTOPped while the copy starts, resumed at once.
    Stopped,
    /// SIGSTOPped, its whole `data_dir` copied, and kept frozen until the copy
    /// has taken the guard over (after its gate lease and grace: legitimately,
    /// with the same state); then resumed beside the copy.
    FrozenPastTtl,
}

/// Where the clone step is.
pub(super) enum CloneStep {
    /// The next step is due at this instant.
    Idle(Instant, Original),
    /// A copy was let in and serves beside the original until `until`.
    Serving {
        fg: Box<Fencegate>,
        until: Instant,
        original: Original,
        n: usize,
    },
    /// The faults are over.
    Over,
}

impl CloneStep {
    pub(super) fn first() -> CloneStep {
        CloneStep::Idle(Instant::now() + CLONE_FIRST, Original::Running)
    }
}

fn kind(original: Original) -> &'static str {
    match original {
        Original::Running => "clone of the data_dir, original running",
        Original::Stopped => "clone of the data_dir, original SIGSTOPped",
        Original::FrozenPastTtl => "clone of the data_dir, original frozen past its gate lease",
    }
}

/// What a resumed original says once it finds its id held by another process
/// (src/guard.rs).
const SHARED_ID: &str = "two processes share instance id";

impl Nemesis<'_> {
    /// Whether a copy serves beside the original now (no fault on the original
    /// meanwhile: a restart would meet the copy's guard).
    pub(super) fn clone_serving(&self) -> bool {
        matches!(self.clone, CloneStep::Serving { .. })
    }

    /// The clone step, one move per call (module doc).
    pub(super) fn clone_step(&mut self) {
        let now = Instant::now();
        match &self.clone {
            CloneStep::Over => {}
            CloneStep::Serving { until, .. } => {
                if now >= *until {
                    self.end_clone();
                }
            }
            CloneStep::Idle(at, original) => {
                let (at, original) = (*at, *original);
                // The original up, with nothing else injected on it: a failpoint
                // abort during the copy's start-up would make the original
                // provably gone, and the copy's takeover legitimate.
                if now < at
                    || self.down.is_some()
                    || self.drain_watch.is_some()
                    || self.store_resume.is_some()
                    || self.armed.is_some()
                    || self.fg.exited()
                {
                    return;
                }
                self.start_clone(original);
            }
        }
    }

    fn start_clone(&mut self, original: Original) {
        let n = self.clones_done + 1;
        let port = crate::support::free_port();
        let addr = format!("127.0.0.1:{port}");
        let mut copy = Fencegate::unstarted_with_args(
            &addr,
            &admin_server_toml(),
            &self.base_config,
            &[],
            &[],
        );
        let pid = self.fg.pid().to_string();
        let signal = |sig: &str| {
            let _ = Command::new("kill").args([sig, &pid]).status();
        };
        let frozen = original != Original::Running;
        let started = Instant::now();
        // A takeover forks the queue's state from here (tests/it/campaign/checker/queued.rs).
        let fork_from = mono_ns();
        if frozen {
            signal("-STOP");
            // Frozen in the middle of a store call, it would hold the
            // single-threaded S3 server: its connections end (its own relay).
            self.store_relay.refuse(true);
            self.store_relay.cut();
        }
        let (from, to) = (state_dir(&self.fg), state_dir(&copy));
        // The id alone (odd steps), or the whole directory (even steps, and
        // always for a takeover: then the copy has the original's state).
        let what = if n % 2 == 1 && original != Original::FrozenPastTtl {
            fs::create_dir_all(&to).unwrap();
            fs::copy(
                from.join(fencegate::cluster::guard::ID_FILE),
                to.join(fencegate::cluster::guard::ID_FILE),
            )
            .unwrap();
            "its instance-id"
        } else {
            let ok = Command::new("cp")
                .arg("-a")
                .arg(&from)
                .arg(&to)
                .status()
                .is_ok_and(|s| s.success());
            assert!(ok, "copying {} to {}", from.display(), to.display());
            if frozen {
                "the whole data_dir (copied while frozen)"
            } else {
                "the whole data_dir (copied live)"
            }
        };
        self.clone_addr = Some(addr.clone());
        self.write_addr();
        let mut refusals = 0;
        let spawned = loop {
            match copy.spawn(None) {
                // Refused while the frozen original's gate lease (and grace)
                // runs: again, until it has ended.
                Err(_)
                    if original == Original::FrozenPastTtl
                        && started.elapsed() < Duration::from_secs(25) =>
                {
                    refusals += 1;
                    std::thread::sleep(Duration::from_millis(500));
                }
                other => break other,
            }
        };
        if frozen {
            self.store_relay.refuse(false);
            signal("-CONT");
        }
        let took = started.elapsed().as_millis();
        self.clones_done = n;
        let refused_first = if refusals > 0 {
            format!(" ({refusals} starts refused first)")
        } else {
            String::new()
        };
        match spawned {
            Err(stderr) => {
                self.clone_addr = None;
                self.write_addr();
                let code = copy
                    .last_exit
                    .and_then(|s| s.code())
                    .map_or(format!("{:?}", copy.last_exit), |c| format!("exit {c}"));
                let reason: String = stderr
                    .lines()
                    .rev()
                    .find(|l| !l.trim().is_empty())
                    .unwrap_or_default()
                    .chars()
                    .take(400)
                    .collect();
                fs::write(self.dir.join(format!("clone-{n}.stderr")), &stderr).unwrap();
                self.note(
                    &format!("{}: refused", kind(original)),
                    format!("{n}: a copy of {what}, {code} after {took} ms: {reason}"),
                );
                self.clone = self.next_clone(original);
            }
            Ok(()) => {
                let how = if original == Original::FrozenPastTtl {
                    self.fork = Some((fork_from, addr.clone()));
                    "took over"
                } else {
                    "LET IN"
                };
                self.note(
                    &format!("{}: {how}", kind(original)),
                    format!("{n}: a copy of {what}, serving at {addr} after {took} ms{refused_first}; half the requests go to it"),
                );
                self.clone = CloneStep::Serving {
                    fg: Box::new(copy),
                    until: Instant::now() + CLONE_SERVES,
                    original,
                    n,
                };
            }
        }
    }

    /// kill -9 of a copy that was let in (no release under the shared id).
    pub(super) fn end_clone(&mut self) {
        let CloneStep::Serving {
            mut fg,
            original,
            n,
            ..
        } = std::mem::replace(&mut self.clone, CloneStep::Over)
        else {
            return;
        };
        self.clone_addr = None;
        self.write_addr();
        // The copy's messages that reached the destination since the fork.
        let fork = self.fork.take().map(|(from, addr)| {
            let messages = QUEUED.messages(fg.admin, &QUEUED.keys(&self.dir, from));
            (from, addr, messages)
        });
        fg.kill9();
        if let Some((from, addr, messages)) = fork {
            self.forks.push(checker::Fork {
                from,
                // The copy's last attempt, in flight when it was killed.
                to: mono_ns() + 1_000_000_000,
                addr,
                messages: messages.unwrap_or_default(),
            });
        }
        fs::write(self.dir.join(format!("clone-{n}.stderr")), fg.stderr()).unwrap();
        // The resumed original must have found its id held by the copy's
        // process, stopped forwarding and said so.
        let said = self.fg.stderr().matches(SHARED_ID).count();
        self.note(
            &format!("{}: killed after serving", kind(original)),
            format!("{n}: the original said {said} times that {SHARED_ID}"),
        );
        self.clone = self.next_clone(original);
    }

    /// Running, then stopped right after; in a run of a minute or more, the
    /// takeover 20 s later (it takes ~25 s: not in the CI smoke); the next
    /// round a minute later.
    fn next_clone(&self, original: Original) -> CloneStep {
        let now = Instant::now();
        match original {
            Original::Running => {
                CloneStep::Idle(now + Duration::from_millis(1500), Original::Stopped)
            }
            Original::Stopped if self.long_run => {
                CloneStep::Idle(now + Duration::from_secs(20), Original::FrozenPastTtl)
            }
            Original::Stopped | Original::FrozenPastTtl => {
                CloneStep::Idle(now + CLONE_EVERY, Original::Running)
            }
        }
    }
}
