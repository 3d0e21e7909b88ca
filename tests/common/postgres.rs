//! A real PostgreSQL for tests: `initdb` into a temporary directory and `postgres`
//! on a free loopback port, run as the unprivileged `postgres` user when the tests
//! run as root (the server refuses root). Binaries from Debian's `postgresql`
//! package (`pg_config --bindir`, else the PATH); `scripts/test.sh` installs it.
//!
//! [`PgServer::shared`] is one server per test process, with a fresh database per
//! call ([`PgServer::database`]); a test that stops, pauses or kills the server
//! starts its own with [`PgServer::start`]: [`PgServer::pause`] and
//! [`PgServer::kill9`] reach every process of the server (postmaster and
//! backends), as a frozen or crashed machine would. The server dies with the test
//! process (parent-death signal) and is killed when dropped.
//!
//! [`PgServer::standby`] makes a streaming standby of a server (`pg_basebackup`)
//! and [`PgServer::promote`] turns it into a primary: a failover.

use super::ports::free_port;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

#[path = "freeze.rs"]
#[allow(dead_code)]
pub mod freeze;

pub struct PgServer {
    child: Mutex<Option<Child>>,
    dir: tempfile::TempDir,
    bin: PathBuf,
    pub port: u16,
    /// The unprivileged account the server runs as (`None`: this user).
    account: Option<(u32, u32)>,
    /// More `-c name=value` settings (a standby's).
    settings: Vec<String>,
}

/// SQL that takes a schema-13 database's dedup indexes back to schema 12's:
/// the first step of every test that rebuilds an older schema by hand.
pub const UNDO_SCHEMA_13: &str = "DROP INDEX fencegate_dedup_done_by_claim_time, \
     fencegate_dedup_in_doubt_by_age; \
     CREATE INDEX fencegate_dedup_by_state_age ON fencegate_dedup (state, created_ms, route, key); \
     CREATE INDEX fencegate_dedup_done_by_done_time ON fencegate_dedup (updated_ms) WHERE state = 1; ";

/// The folder of PostgreSQL's server binaries, if installed.
pub fn bindir() -> Option<PathBuf> {
    let from_pg_config = Command::new("pg_config")
        .arg("--bindir")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()));
    let candidates = from_pg_config.into_iter().chain(
        std::fs::read_dir("/usr/lib/postgresql")
            .into_iter()
            .flatten()
            .filter_map(Result::ok)
            .map(|e| e.path().join("bin")),
    );
    candidates
        .chain(std::iter::once(PathBuf::from("/usr/local/bin")))
        .find(|d| d.join("initdb").is_file() && d.join("postgres").is_file())
}

/// Why PostgreSQL tests cannot run here, if they cannot.
pub fn unavailable() -> Option<String> {
    if std::env::var_os("FENCEGATE_TEST_NO_POSTGRES").is_some() {
        return Some("FENCEGATE_TEST_NO_POSTGRES is set".into());
    }
    bindir().is_none().then(|| {
        "no PostgreSQL server binaries (initdb, postgres); scripts/test.sh installs Debian's postgresql package".into()
    })
}

/// False, after printing why, when PostgreSQL tests cannot run here: the caller
/// returns (skips). With `FENCEGATE_TEST_REQUIRE_POSTGRES` set (CI), panics
/// instead, so that a missing install fails rather than skips.
pub fn available_or_skip() -> bool {
    let Some(why) = unavailable() else {
        return true;
    };
    if std::env::var_os("FENCEGATE_TEST_REQUIRE_POSTGRES").is_some() {
        panic!("PostgreSQL is required here: {why}");
    }
    eprintln!("SKIPPED (PostgreSQL): {why}");
    false
}

fn postgres_account() -> Option<(u32, u32)> {
    // Only root needs another account; `id` avoids unsafe code for getuid().
    let uid = Command::new("id").arg("-u").output().ok()?;
    if String::from_utf8_lossy(&uid.stdout).trim() != "0" {
        return None;
    }
    let id = |flag: &str| -> Option<u32> {
        let o = Command::new("id").args([flag, "postgres"]).output().ok()?;
        String::from_utf8_lossy(&o.stdout).trim().parse().ok()
    };
    Some((id("-u")?, id("-g")?))
}

impl PgServer {
    /// One server for the whole test process.
    pub fn shared() -> &'static PgServer {
        static SHARED: OnceLock<PgServer> = OnceLock::new();
        SHARED.get_or_init(|| {
            // The parent-death signal fires when the *thread* that spawned the
            // server exits: start it from one that lives as long as the process.
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let _ = tx.send(PgServer::start());
                loop {
                    std::thread::park();
                }
            });
            rx.recv().expect("starting the shared PostgreSQL")
        })
    }

    /// A new server of its own (for tests that stop or kill it).
    pub fn start() -> PgServer {
        let bin = bindir().expect("PostgreSQL binaries (see unavailable())");
        let account = postgres_account();
        let dir = tempfile::tempdir().expect("tempdir");
        if let Some((uid, gid)) = account {
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid)).expect("chown");
        }
        let data = dir.path().join("data");
        let out = Self::command(&bin, "initdb", account)
            .args(["-D"])
            .arg(&data)
            .args(["-A", "trust", "-U", "fg", "--no-sync", "-E", "UTF8"])
            .output()
            .expect("running initdb");
        assert!(
            out.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let server = PgServer {
            child: Mutex::new(None),
            dir,
            bin,
            port: free_port(),
            account,
            settings: Vec::new(),
        };
        server.spawn();
        server
    }

    /// A hot standby of this server, named `name` (its `application_name`, the
    /// one `synchronous_standby_names` lists): a base backup taken through a
    /// replication slot of that name, then streaming from 127.0.0.1:`stream_from`
    /// (this server's port, or a relay in front of it). It is a standby of this
    /// server's WAL only; [`PgServer::promote`] ends that.
    pub fn standby(&self, name: &str, stream_from: u16) -> PgServer {
        let dir = tempfile::tempdir().expect("tempdir");
        if let Some((uid, gid)) = self.account {
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid)).expect("chown");
        }
        let data = dir.path().join("data");
        let out = Self::command(&self.bin, "pg_basebackup", self.account)
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-U", "fg"])
            .arg("-D")
            .arg(&data)
            .args([
                "-X",
                "stream",
                "-c",
                "fast",
                "--create-slot",
                "--slot",
                name,
            ])
            .output()
            .expect("running pg_basebackup");
        assert!(
            out.status.success(),
            "pg_basebackup failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        // Recovery as a standby until promoted (PostgreSQL deletes the file then).
        let signal = data.join("standby.signal");
        std::fs::write(&signal, "").expect("standby.signal");
        if let Some((uid, gid)) = self.account {
            std::os::unix::fs::chown(&signal, Some(uid), Some(gid)).expect("chown");
        }
        let server = PgServer {
            child: Mutex::new(None),
            dir,
            bin: self.bin.clone(),
            port: free_port(),
            account: self.account,
            settings: vec![
                format!(
                    "primary_conninfo=host=127.0.0.1 port={stream_from} user=fg application_name={name}"
                ),
                format!("primary_slot_name={name}"),
                "hot_standby=on".into(),
            ],
        };
        server.spawn();
        server
    }

    /// Promotes a standby to a primary (`pg_ctl promote`), waiting until it
    /// accepts writes.
    pub fn promote(&self) {
        let out = Self::command(&self.bin, "pg_ctl", self.account)
            .args(["promote", "-w", "-t", "60", "-D"])
            .arg(self.dir.path().join("data"))
            .output()
            .expect("running pg_ctl promote");
        assert!(
            out.status.success(),
            "pg_ctl promote failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn command(bin: &Path, name: &str, account: Option<(u32, u32)>) -> Command {
        let mut cmd = Command::new(bin.join(name));
        if let Some((uid, gid)) = account {
            cmd.uid(uid).gid(gid);
        }
        cmd.env_remove("PGDATA").env("LC_ALL", "C");
        cmd
    }

    fn spawn(&self) {
        let data = self.dir.path().join("data");
        let mut cmd = Self::command(&self.bin, "postgres", self.account);
        cmd.arg("-D")
            .arg(&data)
            .args(["-p", &self.port.to_string(), "-k"])
            .arg(self.dir.path())
            .args([
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "max_connections=200",
                "-c",
                "fsync=on",
            ])
            .args(self.settings.iter().flat_map(|s| ["-c", s.as_str()]))
            // Extra settings for an experiment (e.g. `autovacuum=off` under the
            // load bench), space-separated `name=value`.
            .args(
                std::env::var("FENCEGATE_TEST_PG_SETTINGS")
                    .unwrap_or_default()
                    .split_whitespace()
                    .flat_map(|s| ["-c".to_owned(), s.to_owned()]),
            )
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // Dies with the thread that spawned it (see `shared`).
        // SAFETY: prctl is async-signal-safe; nothing else runs in the child.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = cmd.spawn().expect("starting postgres");
        *self.child.lock().unwrap() = Some(child);
        self.wait_ready();
    }

    fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ok = Command::new(self.bin.join("pg_isready"))
                .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-U", "fg"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if ok {
                return;
            }
            assert!(Instant::now() < deadline, "postgres did not become ready");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.lock().unwrap().as_ref().map_or(0, Child::id)
    }

    fn signal(pid: u32, sig: libc::c_int) {
        if pid == 0 {
            return;
        }
        // SAFETY: kill(2) on a pid of this server's.
        unsafe {
            libc::kill(pid as libc::pid_t, sig);
        }
    }

    /// SIGSTOP of the postmaster and every backend: the database stops answering,
    /// on open connections as on new ones (which the kernel still accepts).
    pub fn pause(&self) {
        // The postmaster first, so that it forks no backend we would miss.
        Self::signal(self.pid(), libc::SIGSTOP);
        let children = children_of(self.pid());
        for &c in &children {
            Self::signal(c, libc::SIGSTOP);
        }
        for c in children.into_iter().chain([self.pid()]) {
            freeze::wait_stopped(c);
        }
    }

    pub fn resume(&self) {
        for c in children_of(self.pid()) {
            Self::signal(c, libc::SIGCONT);
        }
        Self::signal(self.pid(), libc::SIGCONT);
    }

    /// kill -9 of the whole server at once (postmaster and every backend, as in a
    /// machine's crash), then waits until none of them runs. Open connections
    /// break; new ones are refused until [`PgServer::restart`].
    pub fn kill9(&self) {
        let Some(mut postmaster) = self.child.lock().unwrap().take() else {
            return;
        };
        Self::signal(postmaster.id(), libc::SIGSTOP);
        let children = children_of(postmaster.id());
        for &c in &children {
            Self::signal(c, libc::SIGKILL);
        }
        let _ = postmaster.kill();
        let _ = postmaster.wait();
        let deadline = Instant::now() + Duration::from_secs(30);
        // Orphans are reparented and reaped elsewhere: gone, or a zombie, is dead.
        while children
            .iter()
            .any(|&c| proc_stat(c).is_some_and(|(state, _)| state != 'Z'))
        {
            assert!(
                Instant::now() < deadline,
                "postgres backends outlived kill -9"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Starts again on the same data directory (crash recovery): kills what still
    /// runs first. The stale `postmaster.pid` of a killed server is PostgreSQL's
    /// to clear (its pid no longer runs).
    pub fn restart(&self) {
        self.kill9();
        self.spawn();
    }

    /// A connection string for `dbname` as the test superuser.
    pub fn url(&self, dbname: &str) -> String {
        format!(
            "host=127.0.0.1 port={} user=fg dbname={dbname} sslmode=disable connect_timeout=5",
            self.port
        )
    }

    /// A fresh, empty database on this server; returns its connection string.
    pub fn database(&self) -> String {
        self.new_database().1
    }

    /// A fresh, empty database: its name and connection string.
    pub fn new_database(&self) -> (String, String) {
        static N: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "t{}_{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        );
        self.psql("postgres", &format!("CREATE DATABASE {name}"));
        let url = self.url(&name);
        (name, url)
    }

    /// Runs one SQL command with psql; panics on failure.
    pub fn psql(&self, dbname: &str, sql: &str) -> String {
        self.try_psql(dbname, sql)
            .unwrap_or_else(|e| panic!("psql {sql:?}: {e}"))
    }

    /// [`PgServer::psql`], with the error (psql's stderr) returned.
    pub fn try_psql(&self, dbname: &str, sql: &str) -> Result<String, String> {
        let out = Command::new(self.bin.join("psql"))
            .args([
                "-X",
                "-q",
                "-A",
                "-t",
                "-v",
                "ON_ERROR_STOP=1",
                "-h",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-U",
                "fg",
                "-d",
                dbname,
                "-c",
                sql,
            ])
            .output()
            .expect("running psql");
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }
}

impl PgServer {
    /// `pg_dump` of `db` (plain SQL, one consistent snapshot: what a nightly
    /// backup of a running database holds).
    pub fn dump(&self, db: &str) -> Vec<u8> {
        let out = Command::new(self.bin.join("pg_dump"))
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-U",
                "fg",
                "-d",
                db,
            ])
            .output()
            .expect("running pg_dump");
        assert!(
            out.status.success(),
            "pg_dump: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        out.stdout
    }

    /// Drops `db` (no one connected) and restores `dump` into a new one of
    /// the same name: a database restored from a backup.
    pub fn restore(&self, db: &str, dump: &[u8]) {
        self.psql("postgres", &format!("DROP DATABASE {db} WITH (FORCE)"));
        self.psql("postgres", &format!("CREATE DATABASE {db}"));
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), dump).unwrap();
        let out = Command::new(self.bin.join("psql"))
            .args(["-X", "-q", "-v", "ON_ERROR_STOP=1", "-h", "127.0.0.1"])
            .args(["-p", &self.port.to_string(), "-U", "fg", "-d", db, "-f"])
            .arg(file.path())
            .output()
            .expect("running psql");
        assert!(
            out.status.success(),
            "restore: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Makes every UPDATE of `db`'s `fencegate_identity` (a raise of the
    /// state's generation) fail while `when` (a PL/pgSQL condition over
    /// `NEW`, `OLD`) holds, until [`PgServer::allow_raises`]: a raise lost at
    /// the worst moment.
    pub fn refuse_raises(&self, db: &str, when: &str) {
        self.psql(
            db,
            &format!(
                "CREATE SEQUENCE IF NOT EXISTS refused_raises; \
                 CREATE FUNCTION refuse_raise() RETURNS trigger LANGUAGE plpgsql AS \
                 $$ BEGIN IF {when} THEN RAISE EXCEPTION 'injected: no raise'; END IF; \
                 RETURN NEW; END $$; \
                 CREATE TRIGGER refuse_raise BEFORE UPDATE ON fencegate_identity \
                 FOR EACH ROW EXECUTE FUNCTION refuse_raise()"
            ),
        );
    }

    /// Undoes [`PgServer::refuse_raises`].
    pub fn allow_raises(&self, db: &str) {
        self.psql(db, "DROP TRIGGER refuse_raise ON fencegate_identity");
    }

    /// Whether a backend of `db` waits on a lock in a statement that starts with
    /// `sql` (`pg_stat_activity`).
    /// Whether a statement starting with `sql` is still running on `db`
    /// (waiting or working): once it is not, it has committed or aborted.
    pub fn runs(&self, db: &str, sql: &str) -> bool {
        self.psql(
            db,
            &format!(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = '{db}' \
                 AND state = 'active' AND query LIKE '{sql}%'"
            ),
        ) != "0"
    }

    pub fn waits_on_a_lock(&self, db: &str, sql: &str) -> bool {
        self.psql(
            db,
            &format!(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = '{db}' \
                 AND wait_event_type = 'Lock' AND query LIKE '{sql}%'"
            ),
        ) != "0"
    }
}

/// A transaction of the test's own holding an uncommitted dedup record of `key`
/// on `route`: fencegate's claim of that key waits on it inside the database —
/// after the claim's owner check, before its commit — until
/// [`KeyHold::release`]. What a slow commit (a WAL flush, a descheduled backend)
/// does to a claim, for as long as a test needs; a relay cannot, since a claim
/// is one autocommitted statement.
pub struct KeyHold {
    client: tokio_postgres::Client,
}

impl KeyHold {
    pub async fn start(url: &str, route: &str, shard: u32, key: &str) -> KeyHold {
        let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
            .await
            .expect("connecting to hold a key");
        tokio::spawn(conn);
        client
            .batch_execute(&format!(
                "BEGIN; INSERT INTO fencegate_dedup (route, key, shard, state, fingerprint, \
                   epoch, owner_generation, created_ms, updated_ms) \
                 VALUES ('{route}', '{key}', {shard}, 2, decode(repeat('00', 32), 'hex'), \
                   0, 0, 0, 0)"
            ))
            .await
            .expect("holding a key");
        KeyHold { client }
    }

    /// Rolls the transaction back: the waiting claim goes on.
    pub async fn release(self) {
        self.client
            .batch_execute("ROLLBACK")
            .await
            .expect("releasing a key");
    }
}

/// The postmaster's children (backends, checkpointer, WAL writer, …), from
/// `/proc`: the processes that answer queries on open connections.
fn children_of(parent: u32) -> Vec<u32> {
    if parent == 0 {
        return Vec::new();
    }
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| proc_stat(pid).is_some_and(|(_, ppid)| ppid == parent))
        .collect()
}

/// `(state, ppid)` of a process, from `/proc/PID/stat`.
fn proc_stat(pid: u32) -> Option<(char, u32)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "PID (COMM) STATE PPID …"; COMM may hold spaces and parentheses.
    let rest = &stat[stat.rfind(')')? + 2..];
    let mut f = rest.split(' ');
    let state = f.next()?.chars().next()?;
    let ppid = f.next()?.parse().ok()?;
    Some((state, ppid))
}

impl Drop for PgServer {
    fn drop(&mut self) {
        self.kill9();
    }
}
