//! Which process wrote a gate object, and whether it is provably gone (SPEC
//! §10.1). The instance guard takes a gate lease held under its own instance id
//! back at once only from a process that can no longer write: a copied
//! `instance-id` (a cloned volume or VM, a migration started before the old
//! process stopped) must not let two live processes take the guard from each
//! other.
//!
//! A process is named by the machine's boot id
//! (`/proc/sys/kernel/random/boot_id`), its pid namespace (`/proc/self/ns/pid`),
//! its user, its pid and its start time in clock ticks since boot (field 22 of
//! `/proc/PID/stat`, against pid reuse). Another process is provably gone only
//! when it ran on this boot of this machine, in this pid namespace, as this user
//! (`/proc` mounted with `hidepid` hides other users' processes), and no process
//! with its pid and start time exists now (a zombie counts as gone: it runs no
//! code). Anything else is no proof — another machine, a reboot, another pid
//! namespace (another container), another user, a gate object without these
//! fields (an older fencegate), no `/proc` — and the caller waits for the
//! lease's expiry like any contender.

use std::fmt;

use serde::{Deserialize, Serialize};

/// One process, as recorded in the gate objects it writes (`process`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessId {
    /// `/proc/sys/kernel/random/boot_id`: this boot of this machine (shared by
    /// the containers on it).
    pub boot_id: String,
    /// `/proc/self/ns/pid`, e.g. `pid:[4026531836]`: pids are only comparable
    /// within one pid namespace.
    pub pid_ns: String,
    /// The real user id (`Uid:` in `/proc/self/status`).
    pub uid: u32,
    /// The process id, meaningful with `boot_id` and `pid_ns`.
    pub pid: u32,
    /// Field 22 of `/proc/PID/stat`: clock ticks after boot at which it started.
    pub start_ticks: u64,
}

/// What `/proc` says of a pid now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seen {
    /// No such process, or a zombie.
    Gone,
    /// A process that started at `start_ticks`.
    Running {
        /// When the process now at that pid started, to tell it from the writer.
        start_ticks: u64,
    },
    /// `/proc` could not tell (permissions, a read racing the exit).
    Unknown,
}

impl ProcessId {
    /// This process, or `None` when `/proc` cannot say (not Linux, no `/proc`, or
    /// a `/proc` of another pid namespace, whose `self` is not this pid).
    pub fn current() -> Option<ProcessId> {
        let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
        let pid_ns = std::fs::read_link("/proc/self/ns/pid").ok()?;
        let stat = parse_stat(&std::fs::read_to_string("/proc/self/stat").ok()?)?;
        let uid = parse_uid(&std::fs::read_to_string("/proc/self/status").ok()?)?;
        let pid = std::process::id();
        (stat.pid == pid).then(|| ProcessId {
            boot_id: boot_id.trim().to_owned(),
            pid_ns: pid_ns.to_string_lossy().into_owned(),
            uid,
            pid,
            start_ticks: stat.start_ticks,
        })
    }

    /// Whether this (recorded) process is provably gone, seen from `here`, the
    /// process asking, with `look` saying what `/proc` shows of a pid.
    pub fn gone_as_seen_from(&self, here: &ProcessId, look: impl Fn(u32) -> Seen) -> bool {
        if self.boot_id != here.boot_id || self.pid_ns != here.pid_ns || self.uid != here.uid {
            return false;
        }
        match look(self.pid) {
            Seen::Gone => true,
            Seen::Running { start_ticks } => start_ticks != self.start_ticks,
            Seen::Unknown => false,
        }
    }

    /// [`ProcessId::gone_as_seen_from`] with this machine's `/proc`.
    pub fn provably_gone(&self, here: &ProcessId) -> bool {
        self.gone_as_seen_from(here, look)
    }
}

impl fmt::Display for ProcessId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "pid {} started at tick {}, uid {}, boot id {}, pid namespace {}",
            self.pid, self.start_ticks, self.uid, self.boot_id, self.pid_ns
        )
    }
}

/// What `/proc/PID/stat` says of `pid` now.
pub fn look(pid: u32) -> Seen {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(text) => match parse_stat(&text) {
            Some(s) if matches!(s.state, 'Z' | 'X') => Seen::Gone,
            Some(s) => Seen::Running {
                start_ticks: s.start_ticks,
            },
            None => Seen::Unknown,
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Seen::Gone,
        Err(_) => Seen::Unknown,
    }
}

/// The fields of `/proc/PID/stat` used here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stat {
    pid: u32,
    state: char,
    start_ticks: u64,
}

/// Parses `pid (comm) state ppid … starttime …`: `comm` may hold any byte,
/// spaces and parentheses included, so the fields are counted after its last
/// `)`; the state is field 3 and the start time field 22.
fn parse_stat(text: &str) -> Option<Stat> {
    let (head, rest) = text.rsplit_once(')')?;
    let pid = head.split_once(" (")?.0.trim().parse().ok()?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let state = fields.first()?.chars().next()?;
    let start_ticks = fields.get(22 - 3)?.parse().ok()?;
    Some(Stat {
        pid,
        state,
        start_ticks,
    })
}

/// The real user id from `/proc/PID/status` (`Uid:\treal\teffective\t…`).
fn parse_uid(status: &str) -> Option<u32> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(pid: u32, start_ticks: u64) -> ProcessId {
        ProcessId {
            boot_id: "boot-a".into(),
            pid_ns: "pid:[1]".into(),
            uid: 1000,
            pid,
            start_ticks,
        }
    }

    #[test]
    fn stat_fields_are_counted_after_the_command_name() {
        let line = "16641 (a) b (c)) R 16633 16633 9942 0 -1 4194304 100 0 0 0 0 0 0 0 20 0 1 0 514020 3133440 410";
        assert_eq!(
            parse_stat(line),
            Some(Stat {
                pid: 16641,
                state: 'R',
                start_ticks: 514020
            })
        );
        assert_eq!(parse_stat("16641 (x) R 1 2"), None);
        assert_eq!(parse_stat(""), None);
        assert_eq!(
            parse_uid("Name:\tx\nUid:\t1000\t1001\t1000\t1000\nGid:\t5\n"),
            Some(1000)
        );
        assert_eq!(parse_uid("Name:\tx\n"), None);
    }

    #[test]
    fn gone_only_when_proven_on_this_boot_and_pid_namespace() {
        let here = at(10, 500);
        let other = at(20, 700);
        assert!(other.gone_as_seen_from(&here, |_| Seen::Gone));
        // The pid now belongs to a process started later: reused.
        assert!(other.gone_as_seen_from(&here, |_| Seen::Running { start_ticks: 900 }));
        assert!(!other.gone_as_seen_from(&here, |_| Seen::Running { start_ticks: 700 }));
        assert!(!other.gone_as_seen_from(&here, |_| Seen::Unknown));
        // Another boot, another machine, another container: no proof.
        let elsewhere = ProcessId {
            boot_id: "boot-b".into(),
            ..other.clone()
        };
        assert!(!elsewhere.gone_as_seen_from(&here, |_| Seen::Gone));
        let other_ns = ProcessId {
            pid_ns: "pid:[2]".into(),
            ..other.clone()
        };
        assert!(!other_ns.gone_as_seen_from(&here, |_| Seen::Gone));
        // Another user's process may be hidden (`hidepid`): not seeing it is no proof.
        let other_user = ProcessId { uid: 0, ..other };
        assert!(!other_user.gone_as_seen_from(&here, |_| Seen::Gone));
    }

    #[test]
    fn this_process_is_seen_running() {
        let Some(me) = ProcessId::current() else {
            return; // no /proc here
        };
        assert_eq!(me.pid, std::process::id());
        assert!(!me.provably_gone(&me));
        assert_eq!(
            look(me.pid),
            Seen::Running {
                start_ticks: me.start_ticks
            }
        );
    }
}
