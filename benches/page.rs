//! The operator's page and the in-doubt listing at scale (issue 16: "fast with
//! 10,000 leases and 100,000 in-doubt keys"): a real fencegate process with that
//! many routes and leases, its sled state filled beforehand with that many
//! in-doubt records (and as many `done` ones, which the listing scans past), timed
//! from a client on loopback.
//!
//! ```text
//! cargo bench --bench page                  # 10,000 leases, 100,000 in-doubt keys
//! cargo bench --bench page -- --small       # the 1/10 set-up only
//! ```
//! It prints, for the full and a 1/10 set-up, the median wall time of `GET /`
//! (first page, and a page deep into the keys), of `GET /v1/dedup?state=in_doubt`,
//! and the ratio full ÷ small (how it grows). Under `cargo test --all-targets`
//! (no `--bench` in argv) it runs a smoke of 50 leases and 500 keys, asserting
//! only that the pages answer.

// Benches may read the wall clock and sleep (clippy.toml bans both in the
// library, where time is injected).
#![allow(clippy::disallowed_methods)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use fencegate::dedup::{Record, RequestLine, State};
use fencegate::epoch::Epoch;
use fencegate::state::sled::SledState;
use fencegate::state::{RecordKey, StateStore};

const TOKEN: &str = "page-bench-admin-token";

struct Reply {
    status: u16,
    headers: String,
    body: String,
}

/// One HTTP/1.1 request on a fresh connection (`Connection: close`).
fn http(addr: &str, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Reply {
    let mut s = TcpStream::connect(addr).expect("connect");
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (n, v) in headers {
        req.push_str(&format!("{n}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    s.write_all(req.as_bytes()).expect("write");
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read");
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    // Bodies are chunked or not; the timing is what matters here.
    Reply {
        status,
        headers: head.to_owned(),
        body: body.to_owned(),
    }
}

/// Fills `data_dir`'s sled with `keys` in-doubt and `keys` done records, spread
/// over `routes` routes, one millisecond apart.
fn prepopulate(data_dir: &Path, routes: usize, keys: usize) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let st = SledState::open(data_dir).expect("sled");
        let t0 = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64
            - 3_600_000;
        for i in 0..keys * 2 {
            let route = format!("r{}", i % routes);
            let rec = Record {
                state: if i % 2 == 0 {
                    State::InDoubt
                } else {
                    State::Done
                },
                fingerprint: [7; 32],
                epoch: Epoch::new(1),
                created_ms: t0 + i as u64,
                updated_ms: t0 + i as u64,
                response: None,
                request: Some(RequestLine::new("POST", &format!("/{route}/charges"))),
            };
            let k = RecordKey {
                route,
                key: format!("key-{i:08}"),
            };
            st.put_record(&k, &rec).expect("put");
        }
        st.commit().await.expect("commit");
        st.close().await.expect("close");
    });
}

struct Running {
    child: Child,
    admin: String,
    _dir: tempfile::TempDir,
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A fencegate with `leases` routes (one lease each) and `keys` in-doubt keys.
fn start(leases: usize, keys: usize) -> (Running, Duration) {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("state");
    prepopulate(&data, leases, keys);
    let (proxy, admin) = (free_port(), free_port());
    let mut cfg = format!(
        "[server]\nlisten = \"127.0.0.1:{proxy}\"\nadmin_listen = \"127.0.0.1:{admin}\"\ndata_dir = \"{}\"\nadmin_token = \"{TOKEN}\"\n\n[store]\nkind = \"dir\"\npath = \"{}\"\nprefix = \"fencegate/\"\n\n",
        data.display(),
        dir.path().join("leases").display()
    );
    for i in 0..leases {
        cfg.push_str(&format!(
            "[[route]]\nname = \"r{i}\"\npath_prefix = \"/r{i}/\"\nupstream = \"http://127.0.0.1:9/\"\nlease = \"l{i}\"\n\n"
        ));
    }
    let file = dir.path().join("fencegate.toml");
    std::fs::write(&file, cfg).unwrap();
    let started = Instant::now();
    let child = Command::new(env!("CARGO_BIN_EXE_fencegate"))
        .args(["serve", "--config"])
        .arg(&file)
        // Its records were written by `prepopulate`, not by a set-up whose
        // gate objects name them (SPEC §10, one data_dir, one set-up).
        .arg("--claim-state")
        .env("FENCEGATE_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn fencegate");
    let admin = format!("127.0.0.1:{admin}");
    let run = Running {
        child,
        admin,
        _dir: dir,
    };
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        if TcpStream::connect(&run.admin).is_ok()
            && http(&run.admin, "GET", "/readyz", &[], "").status == 200
        {
            break;
        }
        assert!(Instant::now() < deadline, "fencegate did not become ready");
        std::thread::sleep(Duration::from_millis(50));
    }
    (run, started.elapsed())
}

fn median_ms(reps: usize, mut f: impl FnMut()) -> f64 {
    let mut v: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1000.0
        })
        .collect();
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

struct Figures {
    startup_s: f64,
    page_ms: f64,
    deep_page_ms: f64,
    listing_ms: f64,
    page_bytes: usize,
}

fn measure(leases: usize, keys: usize, reps: usize) -> Figures {
    let (fg, startup) = start(leases, keys);
    let a = &fg.admin;
    let login = http(
        a,
        "POST",
        "/login",
        &[("Content-Type", "application/x-www-form-urlencoded")],
        &format!("token={TOKEN}"),
    );
    assert_eq!(login.status, 303, "{}", login.headers);
    let cookie = login
        .headers
        .lines()
        .find_map(|l| l.strip_prefix("set-cookie: "))
        .and_then(|c| c.split(';').next())
        .expect("a session cookie")
        .to_owned();
    let page = |path: &str| {
        let r = http(
            a,
            "GET",
            path,
            &[("Accept", "text/html"), ("Cookie", &cookie)],
            "",
        );
        assert_eq!(r.status, 200);
        assert!(r.body.contains(&format!("({keys} in all, oldest first)")));
        r
    };
    let bytes = page("/").body.len();
    // A cursor halfway through the in-doubt keys (they are `key-{even i}`, 1 ms apart).
    let bearer = format!("Bearer {TOKEN}");
    let half = http(
        a,
        "GET",
        &format!(
            "/v1/dedup?state=in_doubt&limit={}",
            (keys / 2).clamp(1, 1000)
        ),
        &[("Authorization", &bearer)],
        "",
    );
    assert_eq!(half.status, 200);
    let next = half
        .body
        .split("\"next\": \"")
        .nth(1)
        .and_then(|s| s.split('"').next())
        .unwrap_or_default()
        .replace('/', "%2F");
    let deep = format!("/?after={next}&leases={}", leases / 2);
    Figures {
        startup_s: startup.as_secs_f64(),
        page_ms: median_ms(reps, || drop(page("/"))),
        deep_page_ms: median_ms(reps, || drop(page(&deep))),
        listing_ms: median_ms(reps, || {
            let r = http(
                a,
                "GET",
                "/v1/dedup?state=in_doubt&limit=100",
                &[("Authorization", &bearer)],
                "",
            );
            assert_eq!(r.status, 200);
        }),
        page_bytes: bytes,
    }
}

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    if !argv.iter().any(|a| a == "--bench") {
        let f = measure(50, 500, 3);
        println!(
            "page smoke: 50 leases, 500 in-doubt keys: page {:.1} ms, listing {:.1} ms",
            f.page_ms, f.listing_ms
        );
        return;
    }
    let small = argv.iter().any(|a| a == "--small");
    let sizes: &[(usize, usize)] = if small {
        &[(1_000, 10_000)]
    } else {
        &[(1_000, 10_000), (10_000, 100_000)]
    };
    let mut rows = Vec::new();
    println!("| leases | in-doubt keys (+ as many done) | start-up s | GET / ms | GET /?after=… ms | GET /v1/dedup?state=in_doubt ms | page bytes |");
    println!("|---:|---:|---:|---:|---:|---:|---:|");
    for &(leases, keys) in sizes {
        let f = measure(leases, keys, 9);
        println!(
            "| {leases} | {keys} | {:.1} | {:.1} | {:.1} | {:.1} | {} |",
            f.startup_s, f.page_ms, f.deep_page_ms, f.listing_ms, f.page_bytes
        );
        rows.push(f);
    }
    if let [s, b] = rows.as_slice() {
        println!(
            "\n10x the leases and keys: GET / x{:.1}, deep page x{:.1}, listing x{:.1}",
            b.page_ms / s.page_ms,
            b.deep_page_ms / s.deep_page_ms,
            b.listing_ms / s.listing_ms
        );
    }
}
