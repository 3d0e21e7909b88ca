//! Issue 29 §2, SPEC §9 `client_cert`, `client_key`: a route shows a TLS client
//! certificate to an https upstream that demands one — a real TLS server (Python's
//! `ssl`, `CERT_REQUIRED`) with certificates this test makes. Without one the
//! server refuses the handshake: 502 with the cause in the warn line and the
//! access line. A renewed certificate is picked up by SIGHUP; the key is never
//! logged; `check-config` names a missing file and a key that is not the
//! certificate's (exit 2), and hides signing secrets.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};

use crate::support::egress::{reload_with, PyServer};
use crate::support::*;

/// A test CA that issues certificates.
pub(crate) struct Ca {
    pub(crate) pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl Ca {
    pub(crate) fn new() -> Ca {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, "fencegate test CA");
        let pem = params.self_signed(&key).unwrap().pem();
        Ca {
            pem,
            issuer: Issuer::new(params, key),
        }
    }

    /// A certificate named `cn` (and `sans`) and its key, both PEM.
    pub(crate) fn issue(&self, cn: &str, sans: &[&str]) -> (String, String) {
        let key = KeyPair::generate().unwrap();
        let mut params =
            CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
        params.distinguished_name.push(DnType::CommonName, cn);
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }
}

pub(crate) fn write(dir: &Path, name: &str, text: &str) {
    std::fs::write(dir.join(name), text).unwrap();
}

/// A stretch of a PEM key's base64, to look for in logs.
fn key_body(pem: &str) -> &str {
    let line = pem.lines().nth(1).unwrap();
    &line[..line.len().min(40)]
}

pub(crate) fn origin_events(log: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Route `mtls` (client certificate `client-one`, paths relative to the config
/// file) and route `nocert` (none) to one https server demanding a certificate
/// from the test CA. `mtls` is answered with the server's view of the client
/// (`client-one`); `nocert` gets 502 `upstream_unreachable`, the server having
/// refused the handshake and answered nothing; its warn line and access line
/// say the server refused the certificate. The files are replaced with
/// `client-two` and SIGHUP makes the next request show it. No key appears in
/// the log.
///
/// Fails if the certificate is not presented (502 on `mtls`), if a
/// refused handshake is reported as an unknown outcome (504, in doubt), if the
/// cause is not logged, or if a reload keeps the old certificate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_certificate_is_shown_refused_without_it_and_renewed_by_reload() {
    skip_without_python!();
    let ca = Ca::new();
    let server_dir = tempfile::tempdir().unwrap();
    let (srv_cert, srv_key) = ca.issue("localhost", &["localhost", "127.0.0.1"]);
    write(server_dir.path(), "server.pem", &srv_cert);
    write(server_dir.path(), "server.key", &srv_key);
    write(server_dir.path(), "ca.pem", &ca.pem);
    let log = server_dir.path().join("events.jsonl");
    let p = |n: &str| server_dir.path().join(n).display().to_string();
    let server = PyServer::start(
        "mtls_origin.py",
        &[
            &p("server.pem"),
            &p("server.key"),
            &p("ca.pem"),
            &log.display().to_string(),
        ],
        &[],
    );
    let store = tempfile::tempdir().unwrap();
    let upstream = format!("https://127.0.0.1:{}/api/", server.port);
    let mut fg = Fencegate::unstarted(
        "127.0.0.1:0",
        "",
        &format!(
            "{}\n[[route]]\nname = \"mtls\"\npath_prefix = \"/mtls/\"\nupstream = \"{upstream}\"\n\
             lease = \"partner\"\nca_file = \"ca.pem\"\nclient_cert = \"client.pem\"\nclient_key = \"client.key\"\n\n\
             [[route]]\nname = \"nocert\"\npath_prefix = \"/nocert/\"\nupstream = \"{upstream}\"\n\
             lease = \"partner\"\nca_file = \"ca.pem\"\n",
            dir_store_toml(store.path())
        ),
        &[],
    );
    let (one_cert, one_key) = ca.issue("client-one", &["client-one.test"]);
    let (two_cert, two_key) = ca.issue("client-two", &["client-two.test"]);
    write(fg.dir.path(), "ca.pem", &ca.pem);
    write(fg.dir.path(), "client.pem", &one_cert);
    write(fg.dir.path(), "client.key", &one_key);
    fg.spawn(None).expect("fencegate did not start");
    let h = acquire(
        &dir_epochs(store.path()),
        "partner",
        "worker",
        Duration::from_secs(120),
    )
    .await;

    let shown = post(&fg, "/mtls/orders", &h, r#"{"n":1}"#).await;
    assert_eq!(shown.status, 200, "{:?}", shown.body);
    assert_eq!(shown.json()["client_cn"], "client-one");

    let refused = post(&fg, "/nocert/orders", &h, r#"{"n":2}"#).await;
    refused.assert_error(502, "upstream_unreachable");
    let events = origin_events(&log);
    let requests: Vec<_> = events.iter().filter(|e| e["event"] == "request").collect();
    assert_eq!(
        requests.len(),
        1,
        "only mtls's request was answered: {events:?}"
    );
    assert!(
        events.iter().any(|e| e["event"] == "handshake_failed"),
        "{events:?}"
    );
    let stderr = fg.stderr();
    let warn = stderr
        .lines()
        .find(|l| l.contains("upstream request failed") && l.contains("route=nocert"))
        .unwrap_or_else(|| panic!("no warn line for nocert:\n{stderr}"));
    let access = stderr
        .lines()
        .find(|l| l.contains("fencegate::access") && l.contains("path=\"/nocert/orders\""))
        .unwrap_or_else(|| panic!("no access line for nocert:\n{stderr}"));
    for line in [warn, access] {
        assert!(
            line.contains("client certificate"),
            "the cause is named: {line}"
        );
    }
    assert!(access.contains("status=502"), "{access}");

    // Renewed in place (as a certificate manager does), the config unchanged:
    // a reload reads the files again.
    write(fg.dir.path(), "client.pem", &two_cert);
    write(fg.dir.path(), "client.key", &two_key);
    reload_with(&fg, |t| t).await;
    let renewed = post(&fg, "/mtls/orders", &h, r#"{"n":3}"#).await;
    assert_eq!(renewed.status, 200, "{:?}", renewed.body);
    assert_eq!(renewed.json()["client_cn"], "client-two");

    let stderr = fg.stderr();
    for key in [&one_key, &two_key] {
        assert!(!stderr.contains(key_body(key)), "a key in the log");
    }
}

/// `fencegate check-config` on a file, its stdout and stderr together and its
/// exit code.
fn check_config(dir: &Path, route_extra: &str, env: &[(&str, &str)]) -> (Option<i32>, String) {
    let cfg = dir.join("fencegate.toml");
    std::fs::write(
        &cfg,
        format!(
            "[server]\ndata_dir = \"state\"\n[store]\npath = \"leases\"\n\n[[route]]\nname = \"partner\"\n\
             path_prefix = \"/partner/\"\nupstream = \"https://partner.example/hooks/\"\nlease = \"partner\"\n{route_extra}\n"
        ),
    )
    .unwrap();
    let mut cmd = Command::new(bin());
    cmd.args(["check-config", "--config"]).arg(&cfg);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    (
        out.status.code(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// `check-config` exits 2 naming a missing key file, a key that is not the
/// certificate's, a certificate without its key, and a key file given as the
/// certificate (the http-upstream rule is a unit test in src/config.rs); a good
/// pair is summarized with its paths and no key; signing secrets are counted,
/// never shown, and a bad or unset one is named by position or variable.
#[test]
fn check_config_names_bad_client_certificate_files_and_hides_signing_secrets() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new();
    let (cert, key) = ca.issue("client-one", &["client-one.test"]);
    let (_, other_key) = ca.issue("client-two", &["client-two.test"]);
    write(dir.path(), "client.pem", &cert);
    write(dir.path(), "client.key", &key);
    write(dir.path(), "other.key", &other_key);

    let bad = [
        (
            "client_cert = \"client.pem\"\nclient_key = \"missing.key\"",
            "missing.key",
        ),
        (
            "client_cert = \"client.pem\"\nclient_key = \"other.key\"",
            "is not the key of client_cert",
        ),
        ("client_cert = \"client.pem\"", "set both or neither"),
        (
            "client_cert = \"client.key\"\nclient_key = \"client.key\"",
            "client_cert",
        ),
    ];
    for (extra, needle) in bad {
        let (code, out) = check_config(dir.path(), extra, &[]);
        assert_eq!(code, Some(2), "{extra}: {out}");
        assert!(out.contains(needle), "{extra}: {out}");
        assert!(!out.contains(key_body(&key)) && !out.contains(key_body(&other_key)));
    }
    let (code, out) = check_config(
        dir.path(),
        "client_cert = \"client.pem\"\nclient_key = \"client.key\"",
        &[],
    );
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains("client certificate") && out.contains("client.pem"),
        "{out}"
    );

    let env_secret = "whsec_QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVphYmNkZWY=";
    let literal = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    let (code, out) = check_config(
        dir.path(),
        &format!("signing_secrets = [\"${{FG_TEST_WHSEC}}\", \"{literal}\"]"),
        &[("FG_TEST_WHSEC", env_secret)],
    );
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("2 secret(s) (values hidden)"), "{out}");
    for s in [env_secret, literal] {
        assert!(!out.contains(&s[6..]), "a secret shown: {out}");
    }
    // A secret too short, or unset: named by position, never shown.
    let (code, out) = check_config(
        dir.path(),
        "signing_secrets = [\"${FG_TEST_WHSEC}\", \"whsec_c2hvcnQ=\"]",
        &[("FG_TEST_WHSEC", env_secret)],
    );
    assert_eq!(code, Some(2), "{out}");
    assert!(
        out.contains("signing_secrets[1]") && !out.contains("c2hvcnQ"),
        "{out}"
    );
    let (code, out) = check_config(dir.path(), "signing_secrets = [\"${FG_TEST_WHSEC}\"]", &[]);
    assert_eq!(code, Some(2), "{out}");
    assert!(out.contains("FG_TEST_WHSEC"), "{out}");
}
