//! Cutting an upstream exchange short (SPEC §5: an abort stops writing at once).
//!
//! Dropping a hyper-util client request does not stop the connection task from
//! writing the request it already took: with a 12 MiB body and a slow reader,
//! ~8 MiB were written after fencegate had answered `drain_aborted`. So every
//! connection fencegate opens to an upstream carries a [`Cut`] in its `Connected`
//! extras, and an abort (drain timeout, route timeout, shutdown) finds the
//! exchange's connection through `capture_connection` and cuts it: the socket's
//! linger is set to zero and every later read or write on it fails, so the
//! connection task drops the socket at once and the kernel answers with RST,
//! discarding what it had queued. The destination may still have received the
//! request whole before that (an abort is in doubt, never "not delivered").
//!
//! A plain-HTTP upstream's connection, driven by its request
//! (`forward::inline`), is cut through the exchange's own [`CutHandle`]
//! instead; handles count exchanges, so one kept past its exchange cannot cut
//! the connection's next. A cut stream closes with a reset when dropped.
//!
//! An HTTP/2 connection is not cut: it carries other requests, and dropping the
//! request already resets its stream and discards its queued data.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use atomic_waker::AtomicWaker;
use http::Uri;
use hyper::rt::{Read, ReadBufCursor, Write};
use hyper_util::client::legacy::connect::{
    CaptureConnection, Connected, Connection, HttpConnector,
};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

#[derive(Debug, Default)]
struct Cut {
    /// The exchange the connection carries (shifted left by one) and, in the low
    /// bit, whether it was cut. A connection fencegate pools itself
    /// ([`crate::forward::inline`]) counts its exchanges, so that a handle kept
    /// past its exchange's end cannot cut the next one; hyper-util's stay at 0.
    state: AtomicU64,
    /// The task driving the connection, as last seen reading and writing: woken
    /// by a cut so that it notices at once, whatever it was waiting for.
    read: AtomicWaker,
    write: AtomicWaker,
}

impl Cut {
    fn is_cut(&self) -> bool {
        self.state.load(Ordering::SeqCst) & 1 == 1
    }
}

/// The handle an abort cuts a connection with (kept in its `Connected` extras,
/// or by the exchange of a connection fencegate pools itself).
#[derive(Debug, Clone)]
pub(crate) struct CutHandle {
    cut: Arc<Cut>,
    exchange: u64,
}

impl CutHandle {
    /// Cuts the connection, if it still carries this handle's exchange (true
    /// then).
    pub(crate) fn cut(&self) -> bool {
        let ours = self.exchange << 1;
        let cut = self
            .cut
            .state
            .compare_exchange(ours, ours | 1, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok();
        if cut {
            self.cut.read.wake();
            self.cut.write.wake();
        }
        cut
    }

    /// The exchange is over and the connection idle: the next one gets a new
    /// number. False when it was cut (it must not be reused).
    pub(crate) fn next_exchange(&mut self) -> bool {
        let ours = self.exchange << 1;
        let next = self.exchange + 1;
        let moved = self
            .cut
            .state
            .compare_exchange(ours, next << 1, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok();
        if moved {
            self.exchange = next;
        }
        moved
    }
}

/// Cuts the HTTP/1 connection a request was sent on, if it got one.
pub(crate) fn cut(captured: &CaptureConnection) {
    let meta = captured.connection_metadata();
    let Some(conn) = meta.as_ref() else {
        return; // Still connecting: nothing of the request was written.
    };
    if conn.is_negotiated_h2() {
        return;
    }
    let mut ext = http::Extensions::new();
    conn.get_extras(&mut ext);
    if let Some(h) = ext.get::<CutHandle>() {
        h.cut();
    }
}

/// A TCP connection to an upstream that a [`CutHandle`] can cut.
#[derive(Debug)]
pub(crate) struct CuttableStream {
    io: TokioIo<TcpStream>,
    cut: Arc<Cut>,
}

impl CuttableStream {
    fn new(io: TokioIo<TcpStream>) -> CuttableStream {
        CuttableStream {
            io,
            cut: Arc::default(),
        }
    }

    /// Fails once cut; the first failure also sets the zero linger, so that the
    /// close that follows is a reset, not an orderly FIN after the queued bytes.
    fn check(&self) -> io::Result<()> {
        if !self.cut.is_cut() {
            return Ok(());
        }
        let _ = self.io.inner().set_zero_linger();
        Err(io::Error::new(
            io::ErrorKind::ConnectionAborted,
            "the exchange was aborted by fencegate",
        ))
    }
}

impl CuttableStream {
    /// The handle that cuts this connection (its first exchange).
    pub(crate) fn handle(&self) -> CutHandle {
        CutHandle {
            cut: self.cut.clone(),
            exchange: 0,
        }
    }
}

/// A cut connection closes with a reset even when nobody wrote to it since
/// the cut: the bytes the kernel still holds for the upstream are dropped.
impl Drop for CuttableStream {
    fn drop(&mut self) {
        if self.cut.is_cut() {
            let _ = self.io.inner().set_zero_linger();
        }
    }
}

impl Connection for CuttableStream {
    fn connected(&self) -> Connected {
        self.io.connected().extra(self.handle())
    }
}

impl Read for CuttableStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        // Registered before the check: a cut after it wakes this task.
        this.cut.read.register(cx.waker());
        this.check()?;
        Pin::new(&mut this.io).poll_read(cx, buf)
    }
}

impl Write for CuttableStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.cut.write.register(cx.waker());
        this.check()?;
        Pin::new(&mut this.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.cut.write.register(cx.waker());
        this.check()?;
        Pin::new(&mut this.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.cut.write.register(cx.waker());
        this.check()?;
        Pin::new(&mut this.io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

/// `HttpConnector` whose connections can be cut.
#[derive(Clone)]
pub(crate) struct CuttableConnector(pub(crate) HttpConnector);

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Connecting = Pin<Box<dyn Future<Output = Result<CuttableStream, BoxError>> + Send>>;

impl tower_service::Service<Uri> for CuttableConnector {
    type Response = CuttableStream;
    type Error = BoxError;
    type Future = Connecting;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, dst: Uri) -> Self::Future {
        let connecting = self.0.call(dst);
        Box::pin(async move { Ok(CuttableStream::new(connecting.await?)) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A handle kept past its exchange (a drain abort's watcher, after the
    /// answer was read whole) cannot cut the connection's next exchange; a
    /// connection cut is never given the next one.
    #[test]
    fn a_handle_cuts_only_its_own_exchange() {
        let cut = Arc::new(Cut::default());
        let first = CutHandle {
            cut: cut.clone(),
            exchange: 0,
        };
        let mut next = first.clone();
        assert!(next.next_exchange());
        first.cut();
        assert!(!cut.is_cut(), "the first exchange's handle cut the second");
        let mut later = next.clone();
        next.cut();
        assert!(cut.is_cut());
        assert!(
            !later.next_exchange(),
            "a cut connection went back to the pool"
        );
    }
}
