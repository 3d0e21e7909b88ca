//! The processes a bench runs (origin, pass-through, fencegate, nginx), what the
//! kernel says about them (/proc), and the lease store they share.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fencegate::epoch::{Epoch, EpochRecord, LeaseName};
use fencegate::lease::{dir::DirStore, Epochs};

/// A child process, killed (and reaped) when dropped: on success, on error and on
/// panic alike. The kernel kills it too if this process dies (`PR_SET_PDEATHSIG`).
pub struct Proc {
    pub name: String,
    pub pid: u32,
    pub addr: SocketAddr,
    pub admin: Option<SocketAddr>,
    pub log: PathBuf,
    child: Child,
}

impl Drop for Proc {
    fn drop(&mut self) {
        // SIGTERM first (fencegate shuts down cleanly; a profiler wrapper writes its
        // output), then SIGKILL if it lingers.
        let patience = if std::env::var_os("BENCH_WRAP").is_some() {
            Duration::from_secs(60)
        } else {
            Duration::from_secs(3)
        };
        // SAFETY: kill(2) on our own child's pid, which we have not reaped yet.
        unsafe {
            libc::kill(self.pid as libc::pid_t, libc::SIGTERM);
        }
        let deadline = Instant::now() + patience;
        while Instant::now() < deadline {
            if !matches!(self.child.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    /// The last lines of the child's stderr, for error messages.
    pub fn log_tail(&self) -> String {
        format!("[{} log]\n{}", self.name, log_tail(&self.log))
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

/// Makes the child die with us, even if we are SIGKILLed.
fn die_with_parent(cmd: &mut Command) {
    // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
}

/// An optional command prefix for the proxies under test, e.g.
/// `BENCH_WRAP="valgrind --tool=callgrind"` (profiling; timings become meaningless).
fn wrapped(program: &Path, args: &[String]) -> Command {
    let wrap = std::env::var("BENCH_WRAP").unwrap_or_default();
    let mut words = wrap.split_whitespace();
    match words.next() {
        Some(first) => {
            let mut c = Command::new(first);
            c.args(words).arg(program).args(args);
            c
        }
        None => {
            let mut c = Command::new(program);
            c.args(args);
            c
        }
    }
}

/// Starts a process that prints one JSON line `{"event":"listening","proxy":..}`
/// (and `"admin"` for fencegate) on stdout when ready.
pub fn spawn_listening(
    name: &str,
    program: &Path,
    args: &[String],
    dir: &Path,
    wrap: bool,
    envs: &[(&str, &str)],
) -> Result<Proc, String> {
    let log = dir.join(format!("{name}.log"));
    let stderr = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
    let mut cmd = if wrap {
        wrapped(program, args)
    } else {
        let mut c = Command::new(program);
        c.args(args);
        c
    };
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(stderr);
    cmd.env_remove("FENCEGATE_LOG").env_remove("RUST_LOG");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    die_with_parent(&mut cmd);
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("starting {name} ({}): {e}", program.display()))?;
    let pid = child.id();
    let stdout = child.stdout.take().expect("piped stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut r = BufReader::new(stdout);
        let mut line = String::new();
        let _ = r.read_line(&mut line);
        let _ = tx.send(line);
        // Keep draining so the child never blocks on (or dies of) a closed pipe.
        let mut sink = String::new();
        while r.read_line(&mut sink).unwrap_or(0) > 0 {
            sink.clear();
        }
    });
    let line = rx
        .recv_timeout(Duration::from_secs(120))
        .unwrap_or_default();
    let mut proc_ = Proc {
        name: name.to_owned(),
        pid,
        addr: SocketAddr::from(([127, 0, 0, 1], 0)),
        admin: None,
        log,
        child,
    };
    let v: serde_json::Value = match serde_json::from_str(line.trim()) {
        Ok(v) => v,
        Err(_) => {
            return Err(format!(
                "{name} did not report listening (stdout {line:?}); its log:\n{}",
                proc_.log_tail()
            ))
        }
    };
    let parse = |k: &str| {
        v.get(k)
            .and_then(|a| a.as_str())
            .and_then(|a| a.parse().ok())
    };
    proc_.addr = parse("proxy").ok_or_else(|| format!("{name}: no address in {line:?}"))?;
    proc_.admin = parse("admin");
    Ok(proc_)
}

/// This bench binary again, in a role (`origin`, `passthrough`).
pub fn spawn_role(name: &str, role_args: &[&str], dir: &Path, wrap: bool) -> Result<Proc, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut args: Vec<String> = vec!["--role".into()];
    args.extend(role_args.iter().map(|s| s.to_string()));
    spawn_listening(name, &exe, &args, dir, wrap, &[])
}

/// One route of a generated fencegate config.
pub struct RouteSpec {
    pub name: String,
    pub prefix: String,
    pub lease: String,
    /// `content` or `none`.
    pub derive_key: &'static str,
    /// More lines of the route's table (`delivery = "queued"`, `retry = …`).
    pub extra: String,
    /// The upstream's address, if not the origin's (a port where nothing
    /// listens yet: the queue backlog).
    pub upstream: Option<SocketAddr>,
}

/// Writes a fencegate config (dir store, listeners on port 0) and starts fencegate.
#[allow(clippy::too_many_arguments)]
pub fn spawn_fencegate(
    exe: &Path,
    name: &str,
    dir: &Path,
    store: &Path,
    data_dir: &Path,
    origin: SocketAddr,
    routes: &[RouteSpec],
    extra: &str,
    envs: &[(&str, &str)],
) -> Result<Proc, String> {
    spawn_fencegate_with(
        exe,
        name,
        dir,
        store,
        data_dir,
        origin,
        routes,
        extra,
        envs,
        &[],
    )
}

/// [`spawn_fencegate`] with more `serve` arguments (`--claim-state` for a
/// data_dir the bench filled itself: records no gate object names).
#[allow(clippy::too_many_arguments)]
pub fn spawn_fencegate_with(
    exe: &Path,
    name: &str,
    dir: &Path,
    store: &Path,
    data_dir: &Path,
    origin: SocketAddr,
    routes: &[RouteSpec],
    extra: &str,
    envs: &[(&str, &str)],
    more_args: &[&str],
) -> Result<Proc, String> {
    let mut cfg = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\ndata_dir = {data:?}\n\
         {extra}\n[store]\nkind = \"dir\"\npath = {store:?}\nprefix = \"fencegate/\"\n",
        data = data_dir.display().to_string(),
        store = store.display().to_string(),
    );
    for r in routes {
        cfg.push_str(&format!(
            "\n[[route]]\nname = {:?}\npath_prefix = {:?}\nupstream = \"http://{origin}/v1/\"\n\
             lease = {:?}\ntimeout_ms = 10000\nderive_key = {:?}\n{}\n",
            r.name,
            r.prefix,
            r.lease,
            r.derive_key,
            r.extra,
            origin = r.upstream.unwrap_or(origin),
        ));
    }
    let path = dir.join(format!("{name}.toml"));
    std::fs::File::create(&path)
        .and_then(|mut f| f.write_all(cfg.as_bytes()))
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let mut args = vec![
        "serve".to_string(),
        "--config".into(),
        path.display().to_string(),
    ];
    args.extend(more_args.iter().map(|a| a.to_string()));
    // Default logging (info) unless `envs` says otherwise: the per-request span is
    // part of what is measured. The access line is off, as nginx's `access_log
    // off` is in this bench (a filter, so an older build B takes it too).
    let mut envs = envs.to_vec();
    if !envs.iter().any(|(k, _)| *k == "FENCEGATE_LOG") {
        envs.push(("FENCEGATE_LOG", "info,fencegate::access=off"));
    }
    spawn_listening(name, exe, &args, dir, true, &envs)
}

/// How a `default*` target departs from the shipped config.
#[derive(Clone, Copy)]
pub struct Departure {
    /// `derive_key = "none"` on the route (fencing only).
    pub fencing_only: bool,
    /// `[server] access_log = false`.
    pub quiet: bool,
}

/// fencegate as a user starts it from `config/fencegate.toml` (issue 47): the
/// shipped file itself, its log settings untouched (no `FENCEGATE_LOG`), only
/// what must change on this machine rewritten — listeners on port 0, the data
/// and lease directories, the upstream (the origin) and the route's prefix
/// (`/bench/`, which the load generator sends) — and `departure`. An error if
/// the file no longer has a line this rewrites (the target would measure
/// something else).
pub fn spawn_default(
    exe: &Path,
    name: &str,
    dir: &Path,
    store: &Path,
    origin: SocketAddr,
    departure: Departure,
) -> Result<Proc, String> {
    let shipped = concat!(env!("CARGO_MANIFEST_DIR"), "/config/fencegate.toml");
    let mut cfg = std::fs::read_to_string(shipped).map_err(|e| format!("{shipped}: {e}"))?;
    let data = dir.join(format!("state-{name}"));
    let swaps = [
        (
            "listen = \"127.0.0.1:8080\"",
            "listen = \"127.0.0.1:0\"".to_owned(),
        ),
        (
            "admin_listen = \"127.0.0.1:9090\"",
            "admin_listen = \"127.0.0.1:0\"".to_owned(),
        ),
        (
            "data_dir = \"../data/state\"",
            format!("data_dir = {:?}", data.display().to_string()),
        ),
        (
            "path = \"../data/leases\"",
            format!("path = {:?}", store.display().to_string()),
        ),
        (
            "upstream = \"http://127.0.0.1:8081/v1/\"",
            format!("upstream = \"http://{origin}/v1/\""),
        ),
        (
            "path_prefix = \"/billing/\"",
            "path_prefix = \"/bench/\"".to_owned(),
        ),
    ];
    for (from, to) in swaps {
        if !cfg.contains(from) {
            return Err(format!("{shipped} has no line `{from}` to rewrite"));
        }
        cfg = cfg.replacen(from, &to, 1);
    }
    if departure.quiet {
        cfg = cfg.replacen("[server]\n", "[server]\naccess_log = false\n", 1);
    }
    if departure.fencing_only {
        let lease = "\nlease = \"billing\"\n";
        if !cfg.contains(lease) {
            return Err(format!("{shipped} has no route on lease \"billing\""));
        }
        cfg = cfg.replacen(lease, "\nlease = \"billing\"\nderive_key = \"none\"\n", 1);
    }
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, &cfg).map_err(|e| format!("{}: {e}", path.display()))?;
    let args = vec![
        "serve".to_string(),
        "--config".into(),
        path.display().to_string(),
    ];
    spawn_listening(name, exe, &args, dir, true, &[])
}

/// `nginx` on the PATH, if any.
pub fn find_nginx() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join("nginx"))
        .find(|p| p.is_file())
}

/// A port that was free a moment ago (nginx cannot report a port-0 listener).
fn free_port() -> Result<u16, String> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| e.to_string())
}

/// nginx `proxy_pass` to the origin: one process (`master_process off`), upstream
/// keep-alive ≥ the concurrency and `keepalive_requests` raised on both sides, so
/// it never reconnects (NOTES, "Measuring here").
pub fn spawn_nginx(nginx: &Path, dir: &Path, origin: SocketAddr) -> Result<Proc, String> {
    let prefix = dir.join("nginx");
    std::fs::create_dir_all(prefix.join("logs")).map_err(|e| e.to_string())?;
    let mut last_err = String::new();
    for _ in 0..5 {
        let port = free_port()?;
        let p = prefix.display();
        let conf = format!(
            "daemon off;\nmaster_process off;\nworker_processes 1;\npid {p}/nginx.pid;\n\
             error_log {p}/logs/error.log warn;\nworker_rlimit_nofile 30000;\n\
             events {{ worker_connections 20000; }}\n\
             http {{\n  access_log off;\n  client_body_temp_path {p}/body;\n  proxy_temp_path {p}/proxy;\n\
               fastcgi_temp_path {p}/fastcgi;\n  uwsgi_temp_path {p}/uwsgi;\n  scgi_temp_path {p}/scgi;\n\
               keepalive_requests 1000000;\n  keepalive_timeout 300s;\n\
               upstream origin {{\n    server {origin};\n    keepalive 1024;\n    keepalive_requests 1000000;\n    keepalive_timeout 300s;\n  }}\n\
               server {{\n    listen 127.0.0.1:{port};\n    location / {{\n      proxy_pass http://origin;\n\
                     proxy_http_version 1.1;\n      proxy_set_header Connection \"\";\n    }}\n  }}\n}}\n"
        );
        let conf_path = prefix.join("nginx.conf");
        std::fs::write(&conf_path, conf).map_err(|e| e.to_string())?;
        let log = dir.join("nginx.log");
        let stderr = std::fs::File::create(&log).map_err(|e| e.to_string())?;
        let mut cmd = Command::new(nginx);
        cmd.arg("-p")
            .arg(&prefix)
            .arg("-e")
            .arg(prefix.join("logs/error.log"))
            .arg("-c")
            .arg(&conf_path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr);
        die_with_parent(&mut cmd);
        let child = cmd.spawn().map_err(|e| format!("starting nginx: {e}"))?;
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let mut p = Proc {
            name: "nginx".into(),
            pid: child.id(),
            addr,
            admin: None,
            log,
            child,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline && p.is_running() {
            if TcpStream::connect(addr).is_ok() {
                return Ok(p);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        last_err = format!(
            "nginx did not start: {}\n{}",
            p.log_tail(),
            log_tail(&prefix.join("logs/error.log"))
        );
    }
    Err(last_err)
}

/// utime + stime of a process (all its threads, live and exited), in seconds.
pub fn cpu_secs(pid: u32) -> f64 {
    stat_of(pid).map_or(0.0, |s| s.own as f64 / clk_tck())
}

/// What the bench reads from `/proc/PID/stat`, in clock ticks.
struct Stat {
    ppid: u32,
    /// utime + stime.
    own: u64,
    /// cutime + cstime: children that exited and were waited for.
    reaped: u64,
}

fn stat_of(pid: u32) -> Option<Stat> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may contain spaces: fields start after the last ')'.
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let num = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    // `rest` starts at field 3 of proc(5): 4 ppid, 14 utime, 15 stime, 16 cutime,
    // 17 cstime.
    Some(Stat {
        ppid: u32::try_from(num(1)).unwrap_or(0),
        own: num(11) + num(12),
        reaped: num(13) + num(14),
    })
}

/// CPU seconds of a process tree one level deep, by kind — a PostgreSQL
/// postmaster and every process whose parent it is: each one's utime + stime,
/// plus cutime + cstime, so a process that exits between two readings still
/// counts (its time moves into the postmaster's cutime when it is reaped). The
/// kind is read from the process title PostgreSQL sets (`postgres: walwriter`):
/// `backends` (client connections: the title names the client's address),
/// `postmaster` (with its exited children), or the title (`walwriter`,
/// `checkpointer`, `background writer`, `autovacuum worker`…). Empty if the
/// process is gone.
pub fn tree_cpu_secs(root: u32) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    let Some(top) = stat_of(root) else {
        return out;
    };
    let tck = clk_tck();
    out.insert("postmaster".to_owned(), (top.own + top.reaped) as f64 / tck);
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for e in dir.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            if let Some(s) = stat_of(pid).filter(|s| s.ppid == root) {
                *out.entry(kind_of(pid)).or_default() += (s.own + s.reaped) as f64 / tck;
            }
        }
    }
    out
}

/// A PostgreSQL child's kind, from its process title.
fn kind_of(pid: u32) -> String {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let title = String::from_utf8_lossy(&raw).replace('\0', " ");
    let title = title.trim();
    let title = title.strip_prefix("postgres: ").unwrap_or(title);
    if title.contains('(') || title.contains("[local]") {
        "backends".into()
    } else if title.starts_with("autovacuum worker") {
        "autovacuum worker".into()
    } else if title.is_empty() {
        "other".into()
    } else {
        title.to_owned()
    }
}

fn clk_tck() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

/// Resident set size in KiB (`VmRSS`), and the thread count.
pub fn rss_kib(pid: u32) -> (u64, u64) {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("Threads:"))
}

/// Pins this process (and so every child started later) to one CPU.
pub fn pin_to_cpu(cpu: usize) -> Result<(), String> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; the calls only read it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(std::io::Error::last_os_error().to_string());
        }
    }
    Ok(())
}

/// Raises the soft open-files limit to `want` (or the hard limit). Returns the
/// soft limit in force afterwards.
pub fn raise_nofile(want: u64) -> u64 {
    // SAFETY: plain getrlimit/setrlimit on a local struct.
    unsafe {
        let mut r: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) != 0 {
            return 0;
        }
        if r.rlim_cur < want {
            let new = libc::rlimit {
                rlim_cur: want.min(r.rlim_max),
                rlim_max: r.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &new) == 0 {
                r.rlim_cur = new.rlim_cur;
            }
        }
        r.rlim_cur
    }
}

/// The 1-minute load average.
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|v| v.trim_start_matches([' ', '\t', ':']).to_owned())
        .unwrap_or_default()
}

/// The shared `dir` lease store.
pub fn store(root: &Path) -> Result<Epochs, String> {
    let s = DirStore::open(root, Arc::new(fencegate::clock::SystemClock))
        .map_err(|e| format!("dir store {}: {e}", root.display()))?;
    Ok(Epochs::new(Arc::new(s), "fencegate/"))
}

/// A tenure on `lease` from the dir store, through the worker's algorithm.
pub async fn acquire(epochs: &Epochs, lease: &str) -> Result<(u64, String), String> {
    let l = LeaseName::parse(lease)?;
    let h = fencegate::lease::acquire::acquire(
        epochs,
        &l,
        "bench",
        Duration::from_secs(24 * 3600),
        Duration::ZERO,
        None,
    )
    .await
    .map_err(|e| e.to_string())?;
    Ok((h.epoch.get(), h.token))
}

/// Renews a tenure: the next epoch, with a fresh token.
pub async fn renew(
    epochs: &Epochs,
    lease: &str,
    epoch: u64,
    token: &str,
) -> Result<(u64, String), String> {
    let l = LeaseName::parse(lease)?;
    let h = fencegate::lease::acquire::renew(
        epochs,
        &l,
        "bench",
        Epoch::new(epoch),
        token,
        Duration::from_secs(24 * 3600),
    )
    .await
    .map_err(|e| e.to_string())?;
    Ok((h.epoch.get(), h.token))
}

/// Writes epoch 1 of `lease` straight into the store's layout (SPEC §2), for
/// thousands of leases at once; `acquire` would fsync twice per lease.
pub fn write_epoch_one(root: &Path, lease: &str) -> Result<String, String> {
    let l = LeaseName::parse(lease)?;
    let token = fencegate::lease::acquire::fresh_token();
    let body = EpochRecord::acquire(
        &l,
        Epoch::new(1),
        "bench",
        token.as_bytes(),
        Duration::from_secs(24 * 3600),
    )
    .to_json();
    let dir = root.join("fencegate").join(lease);
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    std::fs::write(dir.join(format!("{:020}.json", 1)), body).map_err(|e| e.to_string())?;
    Ok(token)
}
