//! Freezing a process for a test (SIGSTOP), and knowing that it is frozen.
//! Included by `postgres.rs` (which the load bench includes alone).

use std::time::{Duration, Instant};

/// SIGSTOP of process `pid`, returning once every one of its threads is stopped.
/// kill(2) returns when the signal is queued: the group stop starts only when one
/// of the process's threads takes the signal, and until then a thread already on
/// another core runs on (a CI run's "frozen" owner read an answer released after
/// the kill and began its write). A test that freezes a process and then changes
/// the world behind its back needs the freeze to have happened.
pub fn freeze(pid: u32) {
    let ok = std::process::Command::new("kill")
        .args(["-STOP", &pid.to_string()])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(ok, "kill -STOP {pid} failed");
    wait_stopped(pid);
}

/// Waits (bounded) until every thread of `pid`, sent SIGSTOP, is stopped.
pub fn wait_stopped(pid: u32) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !all_threads_stopped(pid) {
        assert!(Instant::now() < deadline, "process {pid} did not stop");
        // Not a spin: the thread that must take the signal may need this core.
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Whether every thread of `pid` is in state `T` (stopped) in /proc; a process
/// that has gone counts as stopped (it runs no code either).
fn all_threads_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return true;
    };
    tasks.flatten().all(|t| {
        // `pid (comm) S ...`: the state follows the last ')' (comm may hold any byte).
        std::fs::read_to_string(t.path().join("stat")).map_or(true, |stat| {
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next())
                .is_none_or(|state| matches!(state, "T" | "t" | "Z" | "X"))
        })
    })
}
