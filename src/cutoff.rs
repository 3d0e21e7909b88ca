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
//! An HTTP/2 connection is not cut: it carries other requests, and dropping the
//! request already resets its stream and discards its queued data.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
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
    cut: AtomicBool,
    /// The connection task, as last seen reading and writing: woken by a cut so
    /// that it notices at once, whatever it was waiting for.
    read: AtomicWaker,
    write: AtomicWaker,
}

/// The handle an abort cuts a connection with (kept in its `Connected` extras).
#[derive(Debug, Clone)]
pub(crate) struct CutHandle(Arc<Cut>);

impl CutHandle {
    pub(crate) fn cut(&self) {
        self.0.cut.store(true, Ordering::SeqCst);
        self.0.read.wake();
        self.0.write.wake();
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
pub struct CuttableStream {
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
        if !self.cut.cut.load(Ordering::SeqCst) {
            return Ok(());
        }
        let _ = self.io.inner().set_zero_linger();
        Err(io::Error::new(
            io::ErrorKind::ConnectionAborted,
            "the exchange was aborted by fencegate",
        ))
    }
}

impl Connection for CuttableStream {
    fn connected(&self) -> Connected {
        self.io.connected().extra(CutHandle(self.cut.clone()))
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
pub struct CuttableConnector(pub HttpConnector);

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
