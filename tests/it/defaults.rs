//! Issue 32, point 7: defaults that work outside the repository's root. Without
//! `--config` the file is `$FENCEGATE_CONFIG`, else the first of
//! `./fencegate.toml`, `./config/fencegate.toml`, `/etc/fencegate/fencegate.toml`
//! (SPEC §8); `check-config` prints the config's own spellings and paths resolved;
//! `serve` keeps stdout to its JSON line and stderr to one log format.

use std::path::Path;
use std::process::{Command, Output};

use crate::support::*;

const ROUTE: &str = "[[route]]\nname = \"billing\"\npath_prefix = \"/billing/\"\nupstream = \"http://127.0.0.1:1/v1/\"\nlease = \"billing\"\nderive_key = \"none\"\nin_doubt = \"resend\"\n";

/// A config whose relative paths point outside its own directory.
fn config_text(tag: &str) -> String {
    format!("# {tag}\n[server]\ndata_dir = \"../data\"\n[store]\npath = \"../leases\"\n{ROUTE}")
}

fn check_config(cwd: &Path, env: Option<&Path>) -> Output {
    let mut cmd = Command::new(bin());
    cmd.arg("check-config")
        .current_dir(cwd)
        .env_remove("FENCEGATE_CONFIG");
    if let Some(p) = env {
        cmd.env("FENCEGATE_CONFIG", p);
    }
    cmd.output().unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Fails on the old fixed default (`config/fencegate.toml` only, relative to
/// the working directory), on `derive_key None, in_doubt Resend`, and on
/// `data_dir config/../data`.
#[test]
fn the_config_is_found_from_anywhere_and_summarized_in_its_own_words() {
    let top = tempfile::tempdir().unwrap();
    let root = std::fs::canonicalize(top.path()).unwrap();
    let repo = root.join("repo");
    std::fs::create_dir_all(repo.join("config")).unwrap();
    std::fs::write(
        repo.join("config/fencegate.toml"),
        config_text("in config/"),
    )
    .unwrap();

    // ./config/fencegate.toml from the directory above it.
    let o = check_config(&repo, None);
    assert!(o.status.success(), "{o:?}");
    let out = stdout(&o);
    assert!(
        out.contains(&format!(
            "config {} (default) is valid",
            repo.join("config/fencegate.toml").display()
        )),
        "{out}"
    );
    assert!(out.contains("derive_key none, in_doubt resend"), "{out}");
    assert!(
        out.contains(&format!("data_dir      {}\n", repo.join("data").display())),
        "{out}"
    );
    assert!(
        out.contains(&format!("dir at {} ", repo.join("leases").display())),
        "{out}"
    );
    assert!(!out.contains(".."), "paths are shown resolved: {out}");

    // ./fencegate.toml comes first.
    std::fs::write(repo.join("fencegate.toml"), config_text("top")).unwrap();
    let out = stdout(&check_config(&repo, None));
    assert!(
        out.contains(&format!(
            "config {} (default)",
            repo.join("fencegate.toml").display()
        )),
        "{out}"
    );
    assert!(
        out.contains(&format!("data_dir      {}\n", root.join("data").display())),
        "{out}"
    );

    // $FENCEGATE_CONFIG before both, relative to the working directory.
    let out = stdout(&check_config(
        &repo,
        Some(Path::new("config/fencegate.toml")),
    ));
    assert!(
        out.contains(&format!(
            "config {} ($FENCEGATE_CONFIG)",
            repo.join("config/fencegate.toml").display()
        )),
        "{out}"
    );

    // Nowhere: exit 2, saying where it looked and what to do.
    if !Path::new("/etc/fencegate/fencegate.toml").exists() {
        let empty = root.join("empty");
        std::fs::create_dir_all(&empty).unwrap();
        let o = check_config(&empty, None);
        assert_eq!(o.status.code(), Some(2));
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            err.contains("none of fencegate.toml, config/fencegate.toml, /etc/fencegate/fencegate.toml exists")
                && err.contains("pass --config PATH or set FENCEGATE_CONFIG"),
            "{err}"
        );
    }
}

/// `serve --log-format json`: every stderr line is a JSON object, the first
/// naming the config file it runs on; so is a start that fails, whether the
/// config does not load or a listener cannot bind. Human logs never carry a
/// JSON line. Fails on a bare `fencegate: …` line among JSON logs.
#[test]
fn serve_keeps_each_stream_to_one_format() {
    let store = tempfile::tempdir().unwrap();
    let toml = format!("{}{ROUTE}", dir_store_toml(store.path()));
    let mut fg =
        Fencegate::start_with_args("127.0.0.1:0", "", &toml, &[], &["--log-format", "json"]);
    assert!(fg.terminate().success());
    let all_json = |err: &str| {
        for l in err.lines() {
            assert!(
                serde_json::from_str::<serde_json::Value>(l).is_ok_and(|v| v.is_object()),
                "not JSON: {l:?} in\n{err}"
            );
        }
    };
    let err = fg.stderr();
    all_json(&err);
    let first: serde_json::Value = serde_json::from_str(err.lines().next().unwrap()).unwrap();
    assert_eq!(first["message"], "config loaded", "{first}");
    assert_eq!(first["via"], "--config");
    assert!(
        first["config"]
            .as_str()
            .is_some_and(|c| c.ends_with("fencegate.toml")),
        "{first}"
    );

    // A config that does not load, in the format asked for.
    let (code, err) = serve_expecting_exit_with(
        &format!("{ROUTE}drain_timout_ms = 5\n"),
        &["--log-format", "json"],
    );
    assert_eq!(code, Some(2));
    all_json(&err);
    assert!(
        err.contains("\"level\":\"ERROR\"") && err.contains("did you mean `drain_timeout_ms`?"),
        "{err}"
    );
    // A listener that cannot bind, after logging began.
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = busy.local_addr().unwrap().to_string();
    let store2 = tempfile::tempdir().unwrap();
    let toml2 = format!("{}{ROUTE}", dir_store_toml(store2.path()));
    let mut fg = Fencegate::unstarted_with_args(&taken, "", &toml2, &[], &["--log-format", "json"]);
    let err = fg.spawn(None).expect_err("the port is taken");
    all_json(&err);
    assert!(
        err.contains("\"level\":\"ERROR\"") && err.contains(&taken),
        "{err}"
    );
    // Human: no JSON line on stderr.
    let (code, err) = serve_expecting_exit(&format!("{ROUTE}drain_timout_ms = 5\n"));
    assert_eq!(code, Some(2));
    assert!(err.lines().all(|l| !l.starts_with('{')), "{err}");
}
