//! What a new user meets first (issue 14's "stumbles"): check-config catching what
//! serve would fail on, config paths relative to the file, host names and both
//! duration forms in a config, one-line start-up errors said once, the lease
//! commands' TTL check, `--format env` and help texts.

use std::path::Path;
use std::process::{Command, Output, Stdio};

use crate::support::*;

fn run(args: &[&str], cwd: &Path) -> Output {
    run_with_env(args, cwd, &[])
}

/// `run` with no AWS credentials in the environment but those in `env`.
fn run_with_env(args: &[&str], cwd: &Path, env: &[(&str, &str)]) -> Output {
    Command::new(bin())
        .args(args)
        .current_dir(cwd)
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .env_remove("AWS_ACCESS_KEY_ID")
        .env_remove("AWS_SECRET_ACCESS_KEY")
        .env_remove("AWS_PROFILE")
        .env("FENCEGATE_LOG", "info")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .output()
        .expect("running fencegate")
}

/// What `serve` said on stderr, without its first log line (`config loaded`,
/// naming the file it runs on): the lines a failed start adds to it.
fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr)
        .lines()
        .filter(|l| !l.contains("config loaded"))
        .map(|l| format!("{l}\n"))
        .collect()
}

const ROUTE: &str = "[[route]]\nname = \"billing\"\npath_prefix = \"/billing/\"\nupstream = \"http://127.0.0.1:9/\"\nlease = \"billing\"\n";

/// `listen == admin_listen` passed check-config and then failed serve with
/// "Address already in use" twice. Now check-config refuses it, naming the key.
#[test]
fn check_config_refuses_listen_equal_to_admin_listen() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("f.toml");
    std::fs::write(
        &cfg,
        format!(
            "[server]\nlisten = \"127.0.0.1:18080\"\nadmin_listen = \"127.0.0.1:18080\"\n{ROUTE}"
        ),
    )
    .unwrap();
    let o = run(
        &["check-config", "--config", cfg.to_str().unwrap()],
        dir.path(),
    );
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("admin_listen"), "{}", stderr(&o));
}

/// A host name in `listen` ("localhost:0") is accepted, and one file mixes
/// `*_ms` integers, humantime strings and the names without `_ms`. Breaks if
/// either is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listen_takes_a_host_name_and_durations_take_both_forms() {
    let origin = Origin::start().await;
    let store = tempfile::tempdir().unwrap();
    let fg = Fencegate::start_with_server(
        "header_read_timeout = \"5s\"",
        &format!(
            "{}{}",
            dir_store_toml(store.path()).replace("grace_ms = 200", "grace = \"200ms\""),
            route_toml("billing", "billing", &origin, "drain_timeout = 2500")
        ),
        &[],
    );
    fg.edit_config(|t| t.replacen("listen = \"127.0.0.1:0\"", "listen = \"localhost:0\"", 1));
    let mut fg = fg;
    fg.restart();
    assert!(fg.proxy.ip().is_loopback());
    let a = acquire(
        &dir_epochs(store.path()),
        "billing",
        "w",
        std::time::Duration::from_secs(30),
    )
    .await;
    assert_eq!(post(&fg, "/billing/x", &a, "hi").await.status, 200);
}

/// A second fencegate on the same data_dir used to say "could not acquire lock
/// … WouldBlock", twice (once as `fencegate: …`, once as an ERROR log line). Now
/// one line, once, saying what it means; exit 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_instance_on_one_data_dir_says_so_once() {
    let origin = Origin::start().await;
    let store = tempfile::tempdir().unwrap();
    let fg = Fencegate::start(&format!(
        "{}{}",
        dir_store_toml(store.path()),
        route_toml("billing", "billing", &origin, "")
    ));
    let o = run(
        &["serve", "--config", fg.config.to_str().unwrap()],
        fg.dir.path(),
    );
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("another fencegate process uses this data_dir"),
        "{err}"
    );
    assert!(!err.contains("WouldBlock"), "{err}");
    assert_eq!(
        err.matches("another fencegate process").count(),
        1,
        "said once: {err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
}

/// Issue 45: where instance metadata answers but refuses (a host whose IMDS
/// denies the caller, as a newcomer's had), the chain's last error was printed
/// ("IMDS is disabled or the caller has insufficient permissions") with a
/// provider's warning and its Debug dump. Now the same one line as with no
/// metadata service at all.
#[test]
fn a_store_without_credentials_behind_a_refusing_imds_is_one_line_with_the_fix() {
    use std::io::{Read, Write};
    let imds = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", imds.local_addr().unwrap());
    std::thread::spawn(move || {
        for s in imds.incoming() {
            let Ok(mut s) = s else { return };
            let mut buf = [0u8; 4096];
            let _ = s.read(&mut buf);
            let _ = s.write_all(
                b"HTTP/1.1 403 Forbidden\r\ncontent-length: 6\r\nconnection: close\r\n\r\ndenied",
            );
        }
    });
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("f.toml");
    std::fs::write(&cfg, s3_at_discard_port()).unwrap();
    let o = run_with_env(
        &["serve", "--config", cfg.to_str().unwrap()],
        dir.path(),
        &[
            ("AWS_EC2_METADATA_DISABLED", "false"),
            ("AWS_EC2_METADATA_SERVICE_ENDPOINT", &url),
        ],
    );
    let err = stderr(&o);
    assert_ne!(o.status.code(), Some(0), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    assert!(err.contains("no AWS credentials found"), "{err}");
    assert!(err.contains("at http://127.0.0.1:9"), "which store: {err}");
    assert!(!err.contains("IMDS"), "{err}");
}

/// An S3 store with no credentials used to print ~1.5 KB of nested Debug
/// (`DispatchFailure(DispatchFailure { source: ConnectorError {…`) twice. Now one
/// line: the cause and what to do.
#[test]
fn a_store_without_credentials_is_one_line_with_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("f.toml");
    std::fs::write(&cfg, s3_at_discard_port()).unwrap();
    let o = run(&["serve", "--config", cfg.to_str().unwrap()], dir.path());
    let err = stderr(&o);
    assert_ne!(o.status.code(), Some(0), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    assert!(err.contains("no AWS credentials found"), "{err}");
    assert!(err.contains("AWS_ACCESS_KEY_ID"), "what to do: {err}");
    assert!(!err.contains("DispatchFailure"), "no Debug dump: {err}");
}

/// The other half of that: credentials set, but nothing listens at the endpoint.
/// One line: which store, the cause, then where to look.
#[test]
fn an_unreachable_store_is_one_line_naming_the_endpoint_to_check() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("f.toml");
    std::fs::write(&cfg, s3_at_discard_port()).unwrap();
    let o = run_with_env(
        &["serve", "--config", cfg.to_str().unwrap()],
        dir.path(),
        &[("AWS_ACCESS_KEY_ID", "k"), ("AWS_SECRET_ACCESS_KEY", "s")],
    );
    let err = stderr(&o);
    assert_ne!(o.status.code(), Some(0), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    assert!(err.contains("at http://127.0.0.1:9"), "which store: {err}");
    // Refused, or the SDK's retries out of time when the machine is slow.
    assert!(
        err.contains("Connection refused") || err.contains("timed out"),
        "the cause: {err}"
    );
    assert!(
        err.contains("check [store] endpoint and region"),
        "what to do: {err}"
    );
    assert!(!err.contains("DispatchFailure"), "no Debug dump: {err}");
    assert!(!err.contains("ConnectorError"), "no Debug dump: {err}");
}

/// A config whose S3 store is at a port where nothing listens (9, discard).
fn s3_at_discard_port() -> String {
    format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
         [store]\nkind = \"s3\"\nbucket = \"b\"\nendpoint = \"http://127.0.0.1:9\"\nforce_path_style = true\n{ROUTE}"
    )
}

/// Relative paths in a config file follow the file, not the working directory:
/// `lease show --config /abs/f.toml` from elsewhere reads the store the file
/// names (it used to report a free lease and create ./data/leases). Also: a TTL of
/// 0 is refused, `--format env` prints shell assignments, and the options have
/// help texts.
#[test]
fn lease_commands_follow_the_config_file_and_check_their_arguments() {
    let home = tempfile::tempdir().unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    let cfg = home.path().join("f.toml");
    std::fs::write(
        &cfg,
        "[store]\nkind = \"dir\"\npath = \"leases\"\ngrace_ms = 200\n",
    )
    .unwrap();
    let cfg = cfg.to_str().unwrap();
    let acquire = run(
        &[
            "lease", "acquire", "--config", cfg, "--lease", "jobs", "--holder", "w1", "--format",
            "env",
        ],
        elsewhere.path(),
    );
    assert_eq!(acquire.status.code(), Some(0), "{}", stderr(&acquire));
    let out = String::from_utf8_lossy(&acquire.stdout);
    assert!(out.contains("FENCEGATE_EPOCH='1'"), "{out}");
    assert!(out.contains("FENCEGATE_TOKEN='"), "{out}");
    assert!(home.path().join("leases").is_dir(), "beside the config");
    let show = run(
        &["lease", "show", "--config", cfg, "--lease", "jobs"],
        home.path().parent().unwrap(),
    );
    let v: serde_json::Value = serde_json::from_slice(&show.stdout).unwrap();
    assert_eq!(v["epoch"], 1, "{v}");
    assert_eq!(v["holder"], "w1", "{v}");
    assert_eq!(
        std::fs::read_dir(elsewhere.path()).unwrap().count(),
        0,
        "nothing created in the working directory"
    );

    let zero = run(
        &[
            "lease", "acquire", "--config", cfg, "--lease", "other", "--holder", "w", "--ttl-ms",
            "0",
        ],
        home.path(),
    );
    assert_eq!(zero.status.code(), Some(2), "{}", stderr(&zero));
    assert!(stderr(&zero).contains("--ttl-ms 0"), "{}", stderr(&zero));

    let help = run(&["lease", "acquire", "--help"], home.path());
    let help = String::from_utf8_lossy(&help.stdout);
    for opt in ["--lease", "--holder", "--config", "--ttl-ms", "--format"] {
        let line = help
            .lines()
            .find(|l| l.trim_start().starts_with(opt))
            .unwrap_or_else(|| panic!("{opt} in {help}"));
        assert!(
            line.split_whitespace().count() > 2,
            "{opt} has a help text: {line}"
        );
    }
}
