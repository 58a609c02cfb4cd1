//! Which connections of the webhook port failed: what is charged to a source's budget of
//! failed connections (`super::bounds::FailureBudget`).
//!
//! A connection fails when
//! - its TLS handshake fails or times out (a kubelet `tcpSocket` probe is one of these); or
//! - it sent bytes after its handshake but never a request the server could route: HTTP/2
//!   spoken to this HTTP/1.1-only port, garbage, headers that never finished.
//!
//! A connection that handshakes and is closed without sending anything (a Go client that dialed
//! for a request another connection served) is not a failure; neither is a connection that
//! carried a request, whatever its answer was. The API server's connections carry requests, so
//! its source is never charged.
//!
//! [`Watching`] wraps the TLS acceptor: it reports a failed handshake at once, and gives the
//! connection a [`Watched`] stream (did bytes arrive?) and a [`Served`] service (did a request
//! arrive?) sharing one [`Outcome`], judged when the connection is dropped.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use axum_server::accept::Accept;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::admission::http::bounds::{Admitted, FailureReport};

/// What one connection did, judged when it closes.
#[derive(Debug)]
struct Outcome {
    report: FailureReport,
    /// Bytes arrived after the handshake.
    sent: AtomicBool,
    /// A request reached the service.
    served: AtomicBool,
}

impl Outcome {
    /// Whether a connection that did this failed.
    fn failed(sent: bool, served: bool) -> bool {
        sent && !served
    }
}

impl Drop for Outcome {
    fn drop(&mut self) {
        if Outcome::failed(self.sent.load(Ordering::Relaxed), self.served.load(Ordering::Relaxed)) {
            self.report.failed();
        } else {
            self.report.ended_well();
        }
    }
}

/// An acceptor (the TLS one) whose failed connections are reported to their gate.
#[derive(Clone, Debug)]
pub(crate) struct Watching<A> {
    inner: A,
}

impl<A> Watching<A> {
    pub(crate) fn new(inner: A) -> Watching<A> {
        Watching { inner }
    }
}

impl<A, I, S> Accept<Admitted<I>, S> for Watching<A>
where
    A: Accept<Admitted<I>, S>,
    A::Future: Send + 'static,
{
    type Stream = Watched<A::Stream>;
    type Service = Served<A::Service>;
    type Future = Pin<Box<dyn Future<Output = io::Result<(Self::Stream, Self::Service)>> + Send>>;

    fn accept(&self, stream: Admitted<I>, service: S) -> Self::Future {
        let report = stream.failure_report();
        let accepted = self.inner.accept(stream, service);
        Box::pin(async move {
            match accepted.await {
                Ok((stream, service)) => {
                    let outcome = Arc::new(Outcome { report, sent: AtomicBool::new(false), served: AtomicBool::new(false) });
                    Ok((Watched { inner: stream, outcome: outcome.clone() }, Served { inner: service, outcome }))
                }
                Err(error) => {
                    report.failed();
                    Err(error)
                }
            }
        })
    }
}

/// A connection's stream after its handshake: notes whether any bytes arrived.
#[derive(Debug)]
pub(crate) struct Watched<S> {
    inner: S,
    outcome: Arc<Outcome>,
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.outcome.sent.store(true, Ordering::Relaxed);
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Watched<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(mut self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// A connection's service: notes that a request arrived.
#[derive(Clone, Debug)]
pub(crate) struct Served<S> {
    inner: S,
    outcome: Arc<Outcome>,
}

impl<S, R> tower_service::Service<R> for Served<S>
where
    S: tower_service::Service<R>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: R) -> S::Future {
        self.outcome.served.store(true, Ordering::Relaxed);
        self.inner.call(request)
    }
}

#[cfg(test)]
mod tests {
    use super::Outcome;

    #[test]
    fn a_connection_fails_when_it_sent_bytes_but_no_request() {
        // (bytes arrived, a request arrived) → failed
        let table = [((false, false), false), ((true, false), true), ((true, true), false), ((false, true), false)];
        for ((sent, served), failed) in table {
            assert_eq!(Outcome::failed(sent, served), failed, "sent {sent}, served {served}");
        }
    }
}
