//! A TCP relay between fencegate and PostgreSQL whose test can break it at chosen
//! moments: hold the bytes of one direction (they reach the other side only when
//! released, or never if the connection is cut meanwhile), cut every open
//! connection at once, and refuse new ones.
//!
//! With it a test can put the database's COMMIT and the client's knowledge of it
//! on two sides of a cut: hold the replies, let a statement reach the server and
//! commit (seen through another connection), then cut — "the connection dropped
//! right after COMMIT". Holding the requests instead keeps a statement from ever
//! reaching the server before the cut.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// Which directions hold their bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Hold {
    /// fencegate → PostgreSQL (statements).
    requests: bool,
    /// PostgreSQL → fencegate (results, COMMIT acknowledgements).
    replies: bool,
}

pub struct Relay {
    pub addr: SocketAddr,
    hold: watch::Sender<Hold>,
    /// Incremented by [`Relay::cut`]: every connection open before it ends.
    cuts: watch::Sender<u64>,
    refuse: Arc<AtomicBool>,
    held_requests: Arc<AtomicUsize>,
    held_replies: Arc<AtomicUsize>,
    accepted: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Clone, Copy)]
enum Dir {
    Requests,
    Replies,
}

impl Relay {
    /// Relays connections to 127.0.0.1:`port`.
    pub async fn start(port: u16) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (hold, _) = watch::channel(Hold::default());
        let (cuts, _) = watch::channel(0u64);
        let refuse = Arc::new(AtomicBool::new(false));
        let held_requests = Arc::new(AtomicUsize::new(0));
        let held_replies = Arc::new(AtomicUsize::new(0));
        let accepted = Arc::new(AtomicUsize::new(0));
        let task = {
            let (hold, cuts) = (hold.clone(), cuts.clone());
            let (refuse, accepted) = (refuse.clone(), accepted.clone());
            let (hq, hr) = (held_requests.clone(), held_replies.clone());
            tokio::spawn(async move {
                loop {
                    let Ok((client, _)) = listener.accept().await else {
                        continue;
                    };
                    if refuse.load(Ordering::SeqCst) {
                        drop(client);
                        continue;
                    }
                    accepted.fetch_add(1, Ordering::SeqCst);
                    let (hold, cut) = (hold.subscribe(), cuts.subscribe());
                    let (hq, hr) = (hq.clone(), hr.clone());
                    tokio::spawn(async move {
                        let Ok(server) = TcpStream::connect(("127.0.0.1", port)).await else {
                            return;
                        };
                        let _ = client.set_nodelay(true);
                        let _ = server.set_nodelay(true);
                        let (cr, cw) = client.into_split();
                        let (sr, sw) = server.into_split();
                        // Either direction ending (a cut, or a side closing) ends
                        // both: the sockets close when the halves drop.
                        tokio::select! {
                            _ = pump(cr, sw, Dir::Requests, hold.clone(), cut.clone(), hq) => {}
                            _ = pump(sr, cw, Dir::Replies, hold, cut, hr) => {}
                        }
                    });
                }
            })
        };
        Relay {
            addr,
            hold,
            cuts,
            refuse,
            held_requests,
            held_replies,
            accepted,
            task,
        }
    }

    /// A connection string for `dbname` through the relay.
    pub fn url(&self, dbname: &str) -> String {
        format!(
            "host=127.0.0.1 port={} user=fg dbname={dbname} sslmode=disable connect_timeout=5",
            self.addr.port()
        )
    }

    /// Replies (results, COMMIT acknowledgements) wait in the relay while `on`.
    pub fn hold_replies(&self, on: bool) {
        self.hold.send_modify(|h| h.replies = on);
    }

    /// Statements wait in the relay, before the server, while `on`.
    pub fn hold_requests(&self, on: bool) {
        self.hold.send_modify(|h| h.requests = on);
    }

    /// Bytes of statements read and held since the last [`Relay::cut`].
    pub fn held_requests(&self) -> usize {
        self.held_requests.load(Ordering::SeqCst)
    }

    /// Bytes of replies read and held since the last [`Relay::cut`].
    pub fn held_replies(&self) -> usize {
        self.held_replies.load(Ordering::SeqCst)
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }

    /// Ends every open connection at once; held bytes are dropped, never
    /// delivered. Holds are lifted for the connections that come after.
    pub fn cut(&self) {
        // The cut first: a pump that sees its hold lifted finds the cut too.
        self.cuts.send_modify(|n| *n += 1);
        self.hold.send_replace(Hold::default());
        self.held_requests.store(0, Ordering::SeqCst);
        self.held_replies.store(0, Ordering::SeqCst);
    }

    /// Ends every open connection at once, dropping what they hold, and keeps
    /// the holds for the connections that come after (a cut attempt's bytes
    /// never leave; its successor's wait like it did).
    pub fn cut_keeping_holds(&self) {
        self.cuts.send_modify(|n| *n += 1);
        self.held_requests.store(0, Ordering::SeqCst);
        self.held_replies.store(0, Ordering::SeqCst);
    }

    /// New connections are closed at once while `on` (the database is "down").
    pub fn refuse(&self, on: bool) {
        self.refuse.store(on, Ordering::SeqCst);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
        self.cuts.send_modify(|n| *n += 1);
    }
}

/// Copies `from` to `to` until either side closes or a cut; while `dir` is held,
/// what was read waits (counted in `held`).
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    dir: Dir,
    mut hold: watch::Receiver<Hold>,
    mut cut: watch::Receiver<u64>,
    held: Arc<AtomicUsize>,
) {
    let held_now = |h: &Hold| match dir {
        Dir::Requests => h.requests,
        Dir::Replies => h.replies,
    };
    // `cut` was subscribed as the connection was accepted: any change ends it.
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = tokio::select! {
            r = from.read(&mut buf) => match r {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            },
            _ = cut.changed() => return,
        };
        if held_now(&hold.borrow_and_update()) {
            held.fetch_add(n, Ordering::SeqCst);
            loop {
                tokio::select! {
                    r = hold.changed() => if r.is_err() { return },
                    _ = cut.changed() => return,
                }
                if !held_now(&hold.borrow_and_update()) {
                    break;
                }
            }
        }
        // A cut releases the holds too: what was held is dropped, not written.
        if cut.has_changed().unwrap_or(true) || to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
