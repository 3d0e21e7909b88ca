//! Issue 32, point 4: `scripts/cluster.sh` on busy ports. Its fixed ports were
//! taken on a newcomer's machine and the run failed with "pg_ctl: could not start
//! server", the cause only in a log. Now a taken port is replaced by the next free
//! one above it, said on the way, or — with `--fixed-ports` — the script stops
//! naming it. `--preflight` runs only that part (no build, no servers): fast.

use std::collections::BTreeMap;
use std::process::{Command, Output};

use crate::support::*;

/// Runs the script with the test Python first on the PATH (its preflight
/// picks ports with `python3`).
fn cluster_sh(args: &[&str]) -> Output {
    Command::new("bash")
        .arg(repo_root().join("scripts/cluster.sh"))
        .args(args)
        .env("PATH", path_with_test_python())
        .output()
        .unwrap()
}

/// Fails on the old script: it had no preflight, used 9000 whatever held it, and
/// (with the S3 server unable to listen) failed later without naming the port.
#[test]
fn the_cluster_script_moves_off_a_busy_port_or_names_it() {
    skip_without_python!();
    // The S3 test server's port, held here (or by whatever holds it already).
    let _held = std::net::TcpListener::bind("127.0.0.1:9000").ok();

    let o = cluster_sh(&["--preflight"]);
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    );
    assert!(o.status.success(), "{out}{err}");
    assert!(
        out.contains("port 9000 (the S3 test server) is taken"),
        "{out}"
    );
    let ports: BTreeMap<&str, u16> = out
        .lines()
        .find_map(|l| l.strip_prefix("ports: "))
        .unwrap_or_else(|| panic!("no ports line: {out}"))
        .split(' ')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k, v.parse().unwrap()))
        .collect();
    assert_eq!(ports.len(), 9, "{out}");
    assert_ne!(ports["s3"], 9000, "{out}");
    let mut distinct: Vec<u16> = ports.values().copied().collect();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct.len(), 9, "each role its own port: {out}");
    assert!(
        ports.values().all(|p| *p < 32768),
        "below Linux's ephemeral range: {out}"
    );
    assert!(
        out.contains(&format!("using {}", ports["s3"])),
        "says which port it uses instead: {out}"
    );

    let o = cluster_sh(&["--preflight", "--fixed-ports"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("port 9000 (the S3 test server) is taken")
            && err.contains("run without --fixed-ports"),
        "{err}"
    );
}
