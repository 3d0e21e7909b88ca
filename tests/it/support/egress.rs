//! Destinations the egress tests (webhooks.rs, client_cert.rs) run as separate
//! processes, from tests/egress: a webhook receiver verifying with the
//! `standardwebhooks` PyPI package, an https server demanding a client
//! certificate, and the `standardwebhooks` npm package's check of recorded
//! deliveries (installed by scripts/setup-egress-tests.sh, which this runs).

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use super::{eventually, repo_root, test_python, Fencegate, Gateway};

pub fn egress_dir() -> PathBuf {
    repo_root().join("tests/egress")
}

/// A Python server from tests/egress on a free loopback port; killed on drop.
pub struct PyServer {
    child: Child,
    pub port: u16,
}

impl PyServer {
    /// Runs `script` with `args` and `env`; waits for its `{"port": N}` line.
    pub fn start(script: &str, args: &[&str], env: &[(&str, &str)]) -> PyServer {
        let mut cmd = Command::new(test_python());
        cmd.arg(egress_dir().join(script))
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("starting a Python test server");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let v: serde_json::Value = serde_json::from_str(line.trim())
            .unwrap_or_else(|e| panic!("{script} did not start ({e}): {line:?}"));
        PyServer {
            port: v["port"].as_u64().unwrap() as u16,
            child,
        }
    }
}

impl Drop for PyServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Checks `arrivals` (as the webhook origin recorded them) with the npm
/// `standardwebhooks` package against each of `secrets` (name → secret): one
/// entry per arrival (tests/egress/verify.mjs says what is in it).
pub fn verify_with_npm(
    secrets: &[(&str, &str)],
    arrivals: &[serde_json::Value],
) -> Vec<serde_json::Value> {
    let status = Command::new("bash")
        .arg(repo_root().join("scripts/setup-egress-tests.sh"))
        .status()
        .expect("running scripts/setup-egress-tests.sh");
    assert!(status.success(), "scripts/setup-egress-tests.sh failed");
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("deliveries.json");
    let secrets: serde_json::Map<String, serde_json::Value> = secrets
        .iter()
        .map(|(n, s)| (n.to_string(), serde_json::Value::from(*s)))
        .collect();
    std::fs::write(
        &input,
        serde_json::json!({ "secrets": secrets, "arrivals": arrivals }).to_string(),
    )
    .unwrap();
    let out = Command::new("node")
        .arg(egress_dir().join("verify.mjs"))
        .arg(&input)
        .output()
        .expect("node is needed for the webhook tests");
    assert!(
        out.status.success(),
        "verify.mjs failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Rewrites the config through `edit`, sends SIGHUP and waits for the reload to
/// be counted as applied.
pub async fn reload_with(fg: &Fencegate, edit: impl FnOnce(String) -> String) {
    let metric = "fencegate_config_reloads_total{result=\"applied\"}";
    let before = fg.series(metric).await;
    fg.edit_config(edit);
    fg.hup();
    eventually("the reload to be applied", || async {
        fg.series(metric).await > before
    })
    .await;
}
