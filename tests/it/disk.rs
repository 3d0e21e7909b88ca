//! Disk faults (SPEC §4, §6, §7): fencegate's own durable state cannot be
//! written, or comes back damaged.
//!
//! - An unwritable (`chattr +i`) or full (a small tmpfs) data directory: new
//!   epochs and new dedup keys are refused with 503 `store_unavailable`, nothing
//!   is forwarded, the mark does not move; after the fault is gone a restart
//!   serves again from the intact state. Both mechanisms need root (and a kernel
//!   and filesystem that honour them); without, those tests say SKIPPED and pass.
//! - A truncated or bit-flipped sled file: start-up is refused with a clear
//!   message, never a start from an empty (or any lower) mark.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::time::Duration;

use fencegate::clock::SystemClock;
use fencegate::config::InDoubtPolicy;
use fencegate::dedup::{self, Action, Begin, Dedup, DedupKey, Outcome, RequestLine};
use fencegate::epoch::{Epoch, LeaseName};
use fencegate::lease::acquire::Holding;
use fencegate::state::sled::SledState;
use fencegate::state::{Owner, StateError, StateStore};
use http::Request;

use crate::support::*;

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.path().is_dir() {
            copy_dir(&e.path(), &to.join(e.file_name()));
        } else {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

fn replace_dir(with: &Path, dir: &Path) {
    if dir.exists() {
        std::fs::remove_dir_all(dir).unwrap();
    }
    copy_dir(with, dir);
}

async fn admin_get(addr: SocketAddr, path: &str) -> Reply {
    send(
        Request::get(format!("http://{addr}{path}"))
            .body(body(""))
            .unwrap(),
    )
    .await
}

/// The high-water mark of `lease` as the admin API reports it.
async fn hwm(admin: SocketAddr, lease: &str) -> u64 {
    let v = admin_get(admin, "/v1/leases").await.json();
    v["leases"]
        .as_array()
        .and_then(|a| a.iter().find(|l| l["lease"] == lease))
        .and_then(|l| l["high_water_mark"].as_u64())
        .unwrap_or_else(|| panic!("no lease {lease} in {v}"))
}

/// With the state unwritable, after one forwarded request: a new dedup key (the
/// worker's own, then a derived one) at the admitted epoch and a newer epoch
/// (whose mark cannot be made durable) are refused with 503 `store_unavailable`,
/// nothing more reaches the origin, the mark stays and readyz says 503. Returns
/// the newer epoch's holding.
async fn new_work_is_refused(
    fg: &Fencegate,
    origin: &Origin,
    epochs: &fencegate::lease::Epochs,
    a: &Holding,
) -> Holding {
    send(keyed(fg, "/billing/k", a, "fresh-key", "one"))
        .await
        .assert_error(503, "store_unavailable");
    let r = post(fg, "/billing/derived", a, "two").await;
    r.assert_error(503, "store_unavailable");
    assert!(r.headers.contains_key("retry-after"));
    let b = force_next_epoch(epochs, "billing", "worker-b", Duration::from_secs(60)).await;
    post(fg, "/billing/newer", &b, "three")
        .await
        .assert_error(503, "store_unavailable");
    assert_eq!(origin.count(), 1, "{:?}", origin.log());
    assert_eq!(hwm(fg.admin, "billing").await, a.epoch.get());
    assert_eq!(admin_get(fg.admin, "/readyz").await.status, 503);
    b
}

fn run(cmd: &str, args: &[&str]) -> Result<(), String> {
    match Command::new(cmd).args(args).output() {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => Err(format!(
            "{cmd} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => Err(format!("{cmd}: {e}")),
    }
}

// ---------------------------------------------------------------------------
// Unwritable: chattr +i

/// `chattr -R +i` on a directory for as long as it lives.
struct Immutable(PathBuf);

impl Immutable {
    /// Whether `chattr +i` works here *and* stops writes through a file
    /// descriptor opened before it (sled keeps its files open).
    fn probe(scratch: &Path) -> Result<(), String> {
        use std::os::unix::fs::FileExt;
        let p = scratch.join("chattr-probe");
        let f = std::fs::File::create(&p).map_err(|e| e.to_string())?;
        run("chattr", &["+i", p.to_str().unwrap()])?;
        let write = f.write_all_at(b"x", 0);
        run("chattr", &["-i", p.to_str().unwrap()])?;
        let _ = std::fs::remove_file(&p);
        match write {
            Err(_) => Ok(()),
            Ok(()) => Err(
                "an immutable file still accepts writes through an open descriptor on this kernel"
                    .into(),
            ),
        }
    }

    fn set(dir: &Path) -> Immutable {
        run("chattr", &["-R", "+i", dir.to_str().unwrap()]).unwrap();
        Immutable(dir.to_owned())
    }
}

impl Drop for Immutable {
    fn drop(&mut self) {
        // Before the temporary directory is removed.
        let _ = run("chattr", &["-R", "-i", self.0.to_str().unwrap()]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unwritable_data_directory_refuses_new_epochs_and_keys() {
    skip_without_python!();
    let scratch = tempfile::tempdir().unwrap();
    if let Err(why) = Immutable::probe(scratch.path()) {
        eprintln!("SKIPPED unwritable_data_directory_refuses_new_epochs_and_keys: chattr +i is unavailable here ({why}); needs root (CAP_LINUX_IMMUTABLE) and a filesystem with the immutable flag");
        return;
    }
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let mut fg = Fencegate::start(&format!(
        "{}{}",
        s3.store_toml(200),
        route_toml("billing", "billing", &origin, "")
    ));
    let epochs = s3.epochs().await;
    let a = acquire(&epochs, "billing", "worker-a", Duration::from_secs(60)).await;
    assert_eq!(post(&fg, "/billing/warm", &a, "warm").await.status, 200);
    assert_eq!(hwm(fg.admin, "billing").await, a.epoch.get());

    let frozen = Immutable::set(&fg.dir.path().join("state"));
    let b = new_work_is_refused(&fg, &origin, &epochs, &a).await;

    // The fault goes away; a restart reopens the intact state: the mark is the
    // durable one, and the newer epoch is served.
    drop(frozen);
    fg.restart();
    assert_eq!(hwm(fg.admin, "billing").await, a.epoch.get());
    assert_eq!(post(&fg, "/billing/newer", &b, "three").await.status, 200);
    assert_eq!(hwm(fg.admin, "billing").await, b.epoch.get());
    assert_eq!(origin.count(), 2);
}

// ---------------------------------------------------------------------------
// Full: a small tmpfs under the data directory

/// A tmpfs mounted on a directory for as long as it lives.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(dir: &Path, size: &str) -> Result<Tmpfs, String> {
        run(
            "mount",
            &[
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size}"),
                "tmpfs",
                dir.to_str().unwrap(),
            ],
        )?;
        Ok(Tmpfs(dir.to_owned()))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        // Lazy: fencegate may still have it open when a failing test unwinds.
        let _ = run("umount", &["-l", self.0.to_str().unwrap()]);
    }
}

/// Fills the filesystem of `dir` until ENOSPC.
fn fill(dir: &Path) -> PathBuf {
    use std::io::Write;
    let p = dir.join("filler");
    let mut f = std::fs::File::create(&p).unwrap();
    let chunk = vec![0u8; 64 * 1024];
    let mut small = false;
    loop {
        let buf = if small { &chunk[..512] } else { &chunk[..] };
        match f.write(buf) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::StorageFull && !small => small = true,
            Err(e) if e.kind() == std::io::ErrorKind::StorageFull => break,
            Err(e) => panic!("filling {}: {e}", dir.display()),
        }
    }
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_data_directory_refuses_new_epochs_and_keys() {
    skip_without_python!();
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let routes = format!(
        "{}{}",
        route_toml("billing", "billing", &origin, ""),
        // Nothing listens on port 1: a request here writes its in-flight record,
        // is refused by the connect and deletes it again — it never reaches anyone.
        "[[route]]\nname = \"dead\"\npath_prefix = \"/dead/\"\nupstream = \"http://127.0.0.1:1/\"\nlease = \"billing\"\ntimeout_ms = 2000\n"
    );
    let mut fg = Fencegate::start(&format!("{}{routes}", s3.store_toml(200)));
    // Start again from an empty data directory on a 4 MiB tmpfs (nothing was
    // admitted yet). Not a copy: sled's data file is sparse and must stay so.
    fg.kill9();
    let state = fg.dir.path().join("state");
    let instance_id = std::fs::read(state.join(fencegate::cluster::guard::ID_FILE)).unwrap();
    let gate_key = std::fs::read(state.join(fencegate::cluster::guard::KEY_FILE)).unwrap();
    std::fs::remove_dir_all(&state).unwrap();
    std::fs::create_dir(&state).unwrap();
    let tmpfs = match Tmpfs::mount(&state, "4m") {
        Ok(t) => t,
        Err(why) => {
            eprintln!("SKIPPED full_data_directory_refuses_new_epochs_and_keys: cannot mount a tmpfs here ({why}); needs root (CAP_SYS_ADMIN)");
            return;
        }
    };
    // The same instance (its id kept), so that it takes its instance guard back.
    std::fs::write(state.join(fencegate::cluster::guard::ID_FILE), &instance_id).unwrap();
    std::fs::write(state.join(fencegate::cluster::guard::KEY_FILE), &gate_key).unwrap();
    fg.spawn(None).expect("fencegate on the tmpfs");

    let epochs = s3.epochs().await;
    let a = acquire(&epochs, "billing", "worker-a", Duration::from_secs(60)).await;
    assert_eq!(post(&fg, "/billing/warm", &a, "warm").await.status, 200);
    assert_eq!(hwm(fg.admin, "billing").await, a.epoch.get());

    let filler = fill(&state);
    // sled appends to its log; the last page it touched may still have room for
    // a few records (each of them durable). Use it up through the dead route,
    // where nothing can be forwarded anyway, until the first refusal.
    let mut burned = 0;
    loop {
        let r = send(keyed(&fg, "/dead/burn", &a, &format!("burn-{burned}"), "x")).await;
        if r.status == 503 {
            r.assert_error(503, "store_unavailable");
            break;
        }
        r.assert_error(502, "upstream_unreachable");
        burned += 1;
        assert!(burned < 2000, "the full filesystem never refused a write");
    }
    println!("full tmpfs: {burned} records still fit before the first refusal");

    let b = new_work_is_refused(&fg, &origin, &epochs, &a).await;

    // Space comes back; a restart reopens what was made durable.
    std::fs::remove_file(filler).unwrap();
    fg.restart();
    assert_eq!(hwm(fg.admin, "billing").await, a.epoch.get());
    assert_eq!(post(&fg, "/billing/newer", &b, "three").await.status, 200);
    assert_eq!(hwm(fg.admin, "billing").await, b.epoch.get());
    assert_eq!(origin.count(), 2);
    fg.kill9();
    drop(tmpfs);
}

// ---------------------------------------------------------------------------
// Damaged: truncated or bit-flipped sled files

/// Starts the binary on `fg`'s config: `Ok` with the child and its admin address,
/// or `Err` with the exit status and stderr when it exits instead of listening.
fn try_start(fg: &Fencegate) -> Result<(Child, SocketAddr), (ExitStatus, String)> {
    use std::io::{BufRead, BufReader};
    let stderr_path = fg.dir.path().join("attempt.stderr");
    let mut child = Command::new(bin())
        .args(["serve", "--config"])
        .arg(&fg.config)
        .current_dir(fg.dir.path())
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .env("FENCEGATE_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&stderr_path).unwrap())
        .spawn()
        .unwrap();
    let mut line = String::new();
    let _ = BufReader::new(child.stdout.take().unwrap()).read_line(&mut line);
    if line.trim().is_empty() {
        let status = child.wait().unwrap();
        return Err((
            status,
            std::fs::read_to_string(&stderr_path).unwrap_or_default(),
        ));
    }
    let v: serde_json::Value = serde_json::from_str(line.trim()).unwrap();
    Ok((child, v["admin"].as_str().unwrap().parse().unwrap()))
}

type Damage = fn(&Path);

fn db_file(state: &Path) -> PathBuf {
    state.join("db")
}

/// How much of sled's data file holds data: sled sizes it in whole segments
/// (512 KiB) and leaves the rest a hole of zeros.
fn used(b: &[u8]) -> usize {
    b.iter().rposition(|&x| x != 0).map_or(0, |i| i + 1)
}

fn edit_db(state: &Path, edit: impl Fn(&mut Vec<u8>, usize)) {
    let p = db_file(state);
    let mut b = std::fs::read(&p).unwrap();
    let n = used(&b);
    edit(&mut b, n);
    std::fs::write(&p, b).unwrap();
}

fn damage_patterns() -> Vec<(&'static str, Damage)> {
    vec![
        ("db truncated to 0 bytes", |s| edit_db(s, |b, _| b.clear())),
        ("db truncated to 1/4 of its data", |s| {
            edit_db(s, |b, n| b.truncate(n / 4))
        }),
        ("db truncated to 1/2 of its data", |s| {
            edit_db(s, |b, n| b.truncate(n / 2))
        }),
        ("db truncated to 3/4 of its data", |s| {
            edit_db(s, |b, n| b.truncate(n * 3 / 4))
        }),
        ("db without the last byte of its data", |s| {
            edit_db(s, |b, n| b.truncate(n - 1))
        }),
        ("one byte flipped at 1/4 of the data", |s| {
            edit_db(s, |b, n| b[n / 4] ^= 0xff)
        }),
        ("one byte flipped at 1/2 of the data", |s| {
            edit_db(s, |b, n| b[n / 2] ^= 0xff)
        }),
        ("one bit flipped at 3/4 of the data", |s| {
            edit_db(s, |b, n| b[n * 3 / 4] ^= 0x01)
        }),
        ("one bit flipped in the last byte of data", |s| {
            edit_db(s, |b, n| b[n - 1] ^= 0x01)
        }),
        ("64 zero bytes in the middle of the data", |s| {
            edit_db(s, |b, n| b[n / 2 - 32..n / 2 + 32].fill(0))
        }),
        ("every 97th byte of the data flipped", |s| {
            edit_db(s, |b, n| {
                b[..n].iter_mut().step_by(97).for_each(|x| *x ^= 0x55)
            })
        }),
        ("db deleted", |s| std::fs::remove_file(db_file(s)).unwrap()),
        ("sled's conf deleted", |s| {
            std::fs::remove_file(s.join("conf")).unwrap()
        }),
        ("sled's snapshot files deleted", |s| {
            for e in std::fs::read_dir(s).unwrap() {
                let e = e.unwrap();
                if e.file_name().to_string_lossy().starts_with("snap.") {
                    std::fs::remove_file(e.path()).unwrap();
                }
            }
        }),
        ("witness files deleted", |s| {
            for f in ["witness.0", "witness.1"] {
                let _ = std::fs::remove_file(s.join(f));
            }
        }),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn damaged_state_refuses_to_start_never_an_empty_mark() {
    skip_without_python!();
    let s3 = S3Server::start();
    let origin = Origin::start().await;
    let mut fg = Fencegate::start(&format!(
        "{}{}{}",
        s3.store_toml(200),
        route_toml("billing", "billing", &origin, ""),
        route_toml("ledger", "ledger", &origin, "")
    ));
    let epochs = s3.epochs().await;
    let a = acquire(&epochs, "billing", "worker-a", Duration::from_secs(60)).await;
    assert_eq!(post(&fg, "/billing/1", &a, "one").await.status, 200);
    // An older copy of the whole state, taken after a clean stop.
    assert!(fg.terminate().success());
    let state = fg.dir.path().join("state");
    let older = fg.dir.path().join("state.older");
    copy_dir(&state, &older);
    fg.spawn(None).unwrap();
    let b = force_next_epoch(&epochs, "billing", "worker-b", Duration::from_secs(60)).await;
    let l = acquire(&epochs, "ledger", "worker-l", Duration::from_secs(60)).await;
    assert_eq!(post(&fg, "/billing/2", &b, "two").await.status, 200);
    assert_eq!(post(&fg, "/ledger/1", &l, "three").await.status, 200);
    let expect = [("billing", b.epoch.get()), ("ledger", l.epoch.get())];
    // kill -9: everything acknowledged was flushed by the group commit.
    fg.kill9();
    let pristine = fg.dir.path().join("state.pristine");
    copy_dir(&state, &pristine);

    // Control: the undamaged copy starts with its marks.
    let (mut child, admin) = try_start(&fg).expect("the undamaged state must start");
    for (lease, mark) in expect {
        assert_eq!(hwm(admin, lease).await, mark);
    }
    child.kill().unwrap();
    child.wait().unwrap();

    let mut patterns = damage_patterns();
    patterns.push(("sled's files from an older run, witness current", |s| {
        let older = s.with_file_name("state.older");
        for f in ["db", "conf"] {
            std::fs::copy(older.join(f), s.join(f)).unwrap();
        }
    }));
    let (mut report, mut failures) = (Vec::new(), Vec::new());
    for (name, damage) in patterns {
        replace_dir(&pristine, &state);
        damage(&state);
        match try_start(&fg) {
            Err((status, stderr)) => {
                let why = stderr
                    .lines()
                    .rev()
                    .find(|l| !l.trim().is_empty())
                    .unwrap_or("")
                    .to_owned();
                report.push(format!("{name:<50} refused ({status}): {why}"));
                if status.success() || !why.contains("damaged") {
                    failures.push(format!("{name}: exit {status}, unclear refusal: {stderr}"));
                }
            }
            Ok((mut child, admin)) => {
                let mut marks = Vec::new();
                for (lease, _) in expect {
                    marks.push((lease, hwm(admin, lease).await));
                }
                child.kill().unwrap();
                child.wait().unwrap();
                report.push(format!("{name:<50} started with marks {marks:?}"));
                if marks != expect {
                    failures.push(format!("{name}: started with lost marks {marks:?}"));
                }
            }
        }
    }
    println!("damaged state:\n  {}", report.join("\n  "));
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The same question, byte by byte, in process: flip a byte (or cut the file) at
/// positions spread over all of sled's data file; every open either fails or sees
/// every mark at its committed value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_flipped_or_cut_byte_lowers_a_mark() {
    const POSITIONS: usize = 60;
    let base = tempfile::tempdir().unwrap();
    let pristine = base.path().join("pristine");
    let leases: Vec<LeaseName> = ["alpha", "beta", "gamma"]
        .iter()
        .map(|l| LeaseName::parse(l).unwrap())
        .collect();
    {
        let d = SledState::open(&pristine).unwrap();
        let dd = Dedup::new(d.clone(), Arc::new(SystemClock), Duration::from_secs(3600));
        for round in 1..=5u64 {
            for (i, l) in leases.iter().enumerate() {
                d.raise_mark(Owner::SINGLE, l, Epoch::new(round * 10 + i as u64))
                    .await
                    .unwrap();
            }
            let key = DedupKey::parse(format!("key-{round}").as_bytes()).unwrap();
            let fp = dedup::fingerprint("POST", "/x", b"b");
            let Begin::Forward(t) = dd
                .begin(
                    Owner::SINGLE,
                    "r",
                    &key,
                    Action {
                        fingerprint: fp,
                        request: RequestLine::new("POST", "/x"),
                    },
                    Epoch::new(round),
                    InDoubtPolicy::Reject,
                )
                .await
                .unwrap()
            else {
                panic!("fresh key replayed")
            };
            let body = bytes::Bytes::from_static(b"response");
            dd.finish(
                t,
                Outcome::Response {
                    status: http::StatusCode::OK,
                    headers: &http::HeaderMap::new(),
                    body: &body,
                    retryable: false,
                    max_replay_bytes: 1024,
                },
            )
            .await
            .unwrap();
        }
        d.close().await.unwrap();
    }
    let expect: Vec<Epoch> = (0..3).map(|i| Epoch::new(50 + i)).collect();
    let orig = std::fs::read(pristine.join("db")).unwrap();
    let step = (orig.len() / POSITIONS).max(1);
    let mut tries: Vec<(String, Vec<u8>)> = Vec::new();
    for pos in (0..orig.len()).step_by(step).chain([orig.len() - 1]) {
        let mut flipped = orig.clone();
        flipped[pos] ^= 0xff;
        tries.push((format!("flip {pos}"), flipped));
        tries.push((format!("cut {pos}"), orig[..pos].to_vec()));
    }
    let (mut refused, mut intact) = (0, 0);
    for (what, bytes) in tries {
        let dir = base.path().join("try");
        replace_dir(&pristine, &dir);
        std::fs::write(dir.join("db"), bytes).unwrap();
        match SledState::open(&dir) {
            Err(StateError::Damaged { .. }) | Err(StateError::Open { .. }) => refused += 1,
            Err(e) => panic!("{what}: {e}"),
            Ok(d) => {
                let mut marks = Vec::new();
                for l in &leases {
                    marks.push(d.marks(l).await.unwrap().mark);
                }
                d.close().await.unwrap();
                assert_eq!(
                    marks,
                    expect,
                    "{what} of {}: opened with lost marks",
                    orig.len()
                );
                intact += 1;
            }
        }
    }
    println!(
        "sled data file of {} bytes: {refused} damaged copies refused, {intact} opened with every mark intact",
        orig.len()
    );
}
