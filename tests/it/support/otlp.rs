//! An OTLP/HTTP collector for the trace tests: `scripts/otlp_receiver.py`, which
//! decodes each export with the official `opentelemetry-proto` bindings and
//! writes the spans as JSON lines, read here.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::{repo_root, test_python};

/// A running receiver.
pub struct Receiver {
    child: Child,
    pub port: u16,
    out: PathBuf,
    raw: PathBuf,
    _dir: tempfile::TempDir,
}

/// One exported span, as the receiver decoded it.
#[derive(Debug, Clone)]
pub struct Span(pub Value);

impl Span {
    pub fn name(&self) -> &str {
        self.0["name"].as_str().unwrap_or_default()
    }
    pub fn trace_id(&self) -> &str {
        self.0["trace_id"].as_str().unwrap_or_default()
    }
    pub fn span_id(&self) -> &str {
        self.0["span_id"].as_str().unwrap_or_default()
    }
    /// Empty for a root span.
    pub fn parent(&self) -> &str {
        self.0["parent_span_id"].as_str().unwrap_or_default()
    }
    pub fn kind(&self) -> &str {
        self.0["kind"].as_str().unwrap_or_default()
    }
    pub fn attr(&self, key: &str) -> &Value {
        &self.0["attributes"][key]
    }
    pub fn resource(&self, key: &str) -> &Value {
        &self.0["resource"][key]
    }
    /// OTLP `Status.code`: 0 unset, 2 error.
    pub fn status(&self) -> u64 {
        self.0["status_code"].as_u64().unwrap_or_default()
    }
}

impl Receiver {
    /// A receiver that answers every export 200 (`hang`: never answers).
    pub fn start(hang: bool) -> Receiver {
        let dir = tempfile::tempdir().unwrap();
        let (out, raw) = (dir.path().join("spans.jsonl"), dir.path().join("raw.bin"));
        let mut cmd = Command::new(test_python());
        cmd.arg(repo_root().join("scripts/otlp_receiver.py"))
            .arg("--out")
            .arg(&out)
            .arg("--raw")
            .arg(&raw);
        if hang {
            cmd.arg("--hang");
        }
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting scripts/otlp_receiver.py");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .expect("reading the receiver's port");
        let port = serde_json::from_str::<Value>(&line)
            .ok()
            .and_then(|v| v["port"].as_u64())
            .unwrap_or_else(|| panic!("unexpected receiver output {line:?}"))
            as u16;
        Receiver {
            child,
            port,
            out,
            raw,
            _dir: dir,
        }
    }

    /// The `[telemetry]` section exporting to this receiver, with extra keys.
    pub fn toml(&self, extra: &str) -> String {
        format!(
            "\n[telemetry]\notlp_endpoint = \"http://127.0.0.1:{}\"\n{extra}\n",
            self.port
        )
    }

    /// Every span received so far; panics on an export the receiver refused.
    pub fn spans(&self) -> Vec<Span> {
        let text = std::fs::read_to_string(&self.out).unwrap_or_default();
        text.lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .inspect(|v| assert!(v.get("error").is_none(), "a bad export: {v}"))
            .map(Span)
            .collect()
    }

    /// The raw bytes of every export received.
    pub fn raw(&self) -> Vec<u8> {
        std::fs::read(&self.raw).unwrap_or_default()
    }

    /// Waits (bounded, polling the file) until the spans satisfy `done`.
    pub fn wait_until(&self, what: &str, done: impl Fn(&[Span]) -> bool) -> Vec<Span> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let spans = self.spans();
            if done(&spans) {
                return spans;
            }
            assert!(
                Instant::now() < deadline,
                "receiver: waited 20 s for {what}; have {spans:#?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The spans of trace `trace_id`, once `requests` request spans of it have
    /// arrived (a request's span is queued after its children).
    pub fn trace(&self, trace_id: &str, requests: usize) -> Vec<Span> {
        self.wait_until(&format!("{requests} requests of trace {trace_id}"), |s| {
            s.iter()
                .filter(|s| s.trace_id() == trace_id && s.kind() == "SPAN_KIND_SERVER")
                .count()
                >= requests
        })
        .into_iter()
        .filter(|s| s.trace_id() == trace_id)
        .collect()
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The span named `name` among `spans` (exactly one).
pub fn one<'a>(spans: &'a [Span], name: &str) -> &'a Span {
    let found: Vec<&Span> = spans.iter().filter(|s| s.name() == name).collect();
    assert_eq!(found.len(), 1, "one {name:?} span in {spans:#?}");
    found[0]
}
