//! Not polling a socket that cannot have anything new.
//!
//! A poll of a tokio socket that finds nothing costs about 150–230
//! instructions (the budget, the readiness check, the waiter's
//! registration), and hyper polls sockets that have nothing on every event
//! of a stream: the upstream's response body again right after each frame
//! and after its write (nineteenth round), and the client's side on each
//! poll of the connection, to hear whether the client left (twenty-sixth
//! round). A
//! [`Gate`] polls the socket with a waker of its own, which records the
//! wake-up and passes it on to the task's. Once a poll found nothing, the
//! gate answers `Pending` at once until that waker was woken — or until
//! it is polled with another task's waker, which the socket does not know
//! yet. [`GatedRead`] puts a gate on the read side of a client's stream,
//! holds the bytes of its first read ([`GatedRead::read_first`]) for the
//! server to read again, notes whether its last write found the socket
//! full ([`SocketFull`]), and leaves the write side's end to the socket's
//! close.

use std::io;
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Waker};

use bytes::{Buf, Bytes};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Whether a socket can have anything new for a poll, without polling it
/// (see the module docs).
pub(crate) struct Gate {
    shared: Arc<GateShared>,
    /// `shared` as a waker, made once.
    waker: Waker,
    /// The task waker last passed on to (the one in `shared`), kept here
    /// too to compare without a lock.
    outer: Option<Waker>,
    /// The last poll of the socket found nothing, and registered `waker`.
    parked: bool,
}

#[derive(Default)]
struct GateShared {
    woken: AtomicBool,
    outer: Mutex<Option<Waker>>,
    /// [`SocketFull`]'s flag: kept in this allocation, which each
    /// connection has anyway, rather than in one of its own.
    socket_full: AtomicBool,
}

impl std::task::Wake for GateShared {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::Release);
        let outer = self.outer.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(outer) = outer.as_ref() {
            outer.wake_by_ref();
        }
    }
}

impl Gate {
    pub(crate) fn new() -> Gate {
        let shared = Arc::new(GateShared::default());
        Gate {
            waker: Waker::from(Arc::clone(&shared)),
            shared,
            outer: None,
            parked: false,
        }
    }

    /// Nothing can have come since the socket was last polled for the
    /// task that polls now.
    pub(crate) fn closed(&mut self, cx: &Context<'_>) -> bool {
        if !self.parked {
            return false;
        }
        // Cleared before the socket is polled again, so that a wake-up
        // from then on is seen by the next check.
        let woken = self.shared.woken.swap(false, Ordering::AcqRel);
        let same_task = self.outer.as_ref().is_some_and(|w| w.will_wake(cx.waker()));
        if !woken && same_task {
            return true;
        }
        self.parked = false;
        false
    }

    /// Polls the socket (`read`) with the gate's waker, which passes
    /// wake-ups on to `cx`'s; a poll that finds nothing closes the gate.
    pub(crate) fn poll<T>(
        &mut self,
        cx: &Context<'_>,
        read: impl FnOnce(&mut Context<'_>) -> Poll<T>,
    ) -> Poll<T> {
        if !self.outer.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            let outer = cx.waker().clone();
            *self
                .shared
                .outer
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = Some(outer.clone());
            self.outer = Some(outer);
        }
        let polled = read(&mut Context::from_waker(&self.waker));
        self.parked = polled.is_pending();
        polled
    }
}

/// Whether a client's connection found its socket full at its last
/// write, so that bytes it was given still wait to be written: set and
/// cleared by its `GatedRead`; cheap to clone (one `Arc`).
///
/// hyper writes until what it holds is written or the socket is full, so
/// once it has tried, not full means it holds nothing. A response body
/// that must end with an error (its upstream failed) waits while this is
/// set: hyper drops what it has not written when the error reaches it
/// (see `proxy::body`).
#[derive(Clone)]
pub struct SocketFull(Arc<GateShared>);

impl std::fmt::Debug for SocketFull {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("SocketFull").field(&self.get()).finish()
    }
}

impl SocketFull {
    /// The connection's last write found the socket full.
    pub fn get(&self) -> bool {
        self.0.socket_full.load(Ordering::Relaxed)
    }

    /// Notes how a write ended: full when it wrote nothing (`Pending`),
    /// not full when it wrote (an error ends the connection anyway).
    #[inline]
    fn note<T>(&self, polled: &Poll<io::Result<T>>) {
        let full = polled.is_pending();
        if self.get() != full {
            self.0.socket_full.store(full, Ordering::Relaxed);
        }
    }
}

/// The most a connection's first read takes ([`GatedRead::read_first`]):
/// a request head with its headers, and a small body.
const FIRST_READ_BYTES: usize = 4096;

/// A stream whose reads pass through a [`Gate`]; writes go straight to it,
/// noting whether the socket was full ([`SocketFull`]).
///
/// `serve` wraps each client connection in one. While a response streams,
/// hyper's server reads the client's side on each poll of the connection
/// (every event), to hear whether the client closed it (its
/// `mid_message_detect_eof`), and that read nearly always finds nothing.
pub(crate) struct GatedRead<T> {
    io: T,
    gate: Gate,
    /// Bytes read from `io` that the next reads return before `io`'s own:
    /// what [`GatedRead::read_first`] took.
    unread: Bytes,
    socket_full: SocketFull,
}

impl<T> GatedRead<T> {
    pub(crate) fn new(io: T) -> GatedRead<T> {
        let gate = Gate::new();
        let socket_full = SocketFull(Arc::clone(&gate.shared));
        GatedRead {
            io,
            gate,
            unread: Bytes::new(),
            socket_full,
        }
    }

    /// Whether the last write found the socket full.
    pub(crate) fn socket_full(&self) -> &SocketFull {
        &self.socket_full
    }

    /// What was read and not yet read again.
    #[cfg(test)]
    fn unread(&self) -> &[u8] {
        &self.unread
    }
}

impl<T: AsyncRead + Unpin> GatedRead<T> {
    /// Reads once what has arrived (up to [`FIRST_READ_BYTES`]), to look
    /// at it before anyone reads it, and keeps it for the reads that
    /// follow; says whether the stream starts with `until`. While what
    /// came is a strict beginning of `until` (and the peer has not
    /// closed), it reads on, to tell.
    ///
    /// `serve` looks for HTTP/2's preface this way. hyper-util's server
    /// read the first 24 bytes alone for it, and hyper then read the rest
    /// of the request: two reads where one does (BENCHMARKS.md,
    /// forty-fifth round). hyper also grew its read buffer from 8 to
    /// 16 KiB for its second read, and a connection keeps that buffer
    /// while it lives: an idle stream held 11 KiB more. The read lands on
    /// the stack and only what came is kept, in an allocation of its size.
    pub(crate) async fn read_first(&mut self, until: &[u8]) -> io::Result<bool> {
        let mut first = Vec::new();
        loop {
            let before = first.len();
            std::future::poll_fn(|cx| {
                let mut space = [MaybeUninit::<u8>::uninit(); FIRST_READ_BYTES];
                let mut buf = ReadBuf::uninit(&mut space);
                let polled = Pin::new(&mut *self).poll_read(cx, &mut buf);
                if let Poll::Ready(Ok(())) = polled {
                    first.extend_from_slice(buf.filled());
                }
                polled
            })
            .await?;
            if first.len() == before || first.len() >= until.len() || !until.starts_with(&first) {
                break;
            }
        }
        let starts = first.starts_with(until);
        self.unread = Bytes::from(first);
        Ok(starts)
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for GatedRead<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.unread.is_empty() {
            let n = this.unread.len().min(buf.remaining());
            buf.put_slice(&this.unread[..n]);
            this.unread.advance(n);
            if this.unread.is_empty() {
                // Its buffer goes now, not with the connection.
                this.unread = Bytes::new();
            }
            return Poll::Ready(Ok(()));
        }
        if this.gate.closed(cx) {
            return Poll::Pending;
        }
        let io = &mut this.io;
        this.gate.poll(cx, |cx| Pin::new(io).poll_read(cx, buf))
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for GatedRead<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_write(cx, buf);
        this.socket_full.note(&polled);
        polled
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        this.socket_full.note(&polled);
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    /// Does nothing: the socket's close sends the same FIN. hyper shuts a
    /// client's connection down only as the last thing before it lets go
    /// of it (its HTTP/1.1 dispatcher once the connection is done, h2
    /// after its GOAWAY), and `serve` then drops the socket, which closes
    /// it: `shutdown` followed by `close` was one system call a stream
    /// more than `close` alone (BENCHMARKS.md, forty-fifth round).
    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;
    use tokio::io::AsyncWriteExt;
    use tokio::net::{TcpListener, TcpStream};

    /// A stream that counts the polls of its read side.
    struct Counted {
        io: TcpStream,
        polls: Arc<AtomicUsize>,
    }

    impl AsyncRead for Counted {
        fn poll_read(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            let this = self.get_mut();
            this.polls.fetch_add(1, Ordering::Relaxed);
            Pin::new(&mut this.io).poll_read(cx, buf)
        }
    }

    /// A task's waker that records that it was woken.
    #[derive(Default)]
    struct Flag(AtomicBool);

    impl std::task::Wake for Flag {
        fn wake(self: Arc<Self>) {
            self.0.store(true, Ordering::Release);
        }
    }

    async fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (client, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        (client.expect("connect"), accepted.expect("accept").0)
    }

    /// Lets the runtime's driver run until `flag`'s task was woken.
    async fn woken(flag: &Flag, by: &str) {
        tokio::time::timeout(Duration::from_secs(5), async {
            while !flag.0.load(Ordering::Acquire) {
                tokio::task::yield_now().await;
            }
        })
        .await
        .unwrap_or_else(|_| panic!("{by} did not wake the task"));
    }

    fn poll_once(
        gated: &mut GatedRead<Counted>,
        waker: &Waker,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        let mut read = ReadBuf::new(buf);
        let mut cx = Context::from_waker(waker);
        Pin::new(gated)
            .poll_read(&mut cx, &mut read)
            .map_ok(|()| read.filled().len())
    }

    /// After a read that found nothing, the same task's reads do not
    /// touch the socket until its wake-up comes; then the read gets what
    /// came. Another task's read goes to the socket at once.
    #[tokio::test]
    async fn a_read_that_found_nothing_waits_for_the_wake_up() {
        let (mut peer, io) = pair().await;
        let polls = Arc::new(AtomicUsize::new(0));
        let mut gated = GatedRead::new(Counted {
            io,
            polls: Arc::clone(&polls),
        });
        let flag = Arc::new(Flag::default());
        let waker = Waker::from(Arc::clone(&flag));
        let mut buf = [0u8; 16];

        assert!(poll_once(&mut gated, &waker, &mut buf).is_pending());
        assert_eq!(polls.load(Ordering::Relaxed), 1);
        for _ in 0..3 {
            assert!(poll_once(&mut gated, &waker, &mut buf).is_pending());
        }
        assert_eq!(
            polls.load(Ordering::Relaxed),
            1,
            "the socket was polled again"
        );

        peer.write_all(b"hi").await.expect("write");
        woken(&flag, "the peer's write").await;
        match poll_once(&mut gated, &waker, &mut buf) {
            Poll::Ready(Ok(n)) => assert_eq!(&buf[..n], b"hi"),
            other => panic!("after the wake-up: {other:?}"),
        }
        assert_eq!(polls.load(Ordering::Relaxed), 2);

        // Found nothing again; another task's read is not answered for it.
        assert!(poll_once(&mut gated, &waker, &mut buf).is_pending());
        let other = Waker::from(Arc::new(Flag::default()));
        assert!(poll_once(&mut gated, &other, &mut buf).is_pending());
        assert_eq!(polls.load(Ordering::Relaxed), 4);

        // The peer's close is heard through the gate as well.
        flag.0.store(false, Ordering::Release);
        assert!(poll_once(&mut gated, &waker, &mut buf).is_pending());
        assert_eq!(polls.load(Ordering::Relaxed), 5);
        drop(peer);
        woken(&flag, "the peer's close").await;
        match poll_once(&mut gated, &waker, &mut buf) {
            Poll::Ready(Ok(0)) => {}
            other => panic!("after the close: {other:?}"),
        }
    }

    use crate::proxy::server::H2_PREFACE as PREFACE;

    /// The socket's reads through `gated`, counted by `Counted`.
    fn counted(io: TcpStream) -> (GatedRead<Counted>, Arc<AtomicUsize>) {
        let polls = Arc::new(AtomicUsize::new(0));
        let gated = GatedRead::new(Counted {
            io,
            polls: Arc::clone(&polls),
        });
        (gated, polls)
    }

    /// Everything `gated` gives until the peer closes.
    async fn rest(gated: &mut GatedRead<Counted>) -> Vec<u8> {
        let mut all = Vec::new();
        tokio::io::AsyncReadExt::read_to_end(gated, &mut all)
            .await
            .expect("read");
        all
    }

    /// A request that has arrived is taken with one read, and given again
    /// whole, before what comes after it, to the reads that follow.
    #[tokio::test]
    async fn the_first_read_takes_what_has_arrived_and_gives_it_again() {
        let (mut peer, io) = pair().await;
        let request =
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: a\r\ncontent-length: 2\r\n\r\n{}";
        peer.write_all(request).await.expect("write");
        // Let it arrive: the test is about one read taking all of it.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let (mut gated, polls) = counted(io);
        gated.read_first(PREFACE).await.expect("first read");
        assert_eq!(gated.unread(), request);
        assert_eq!(polls.load(Ordering::Relaxed), 1, "one read");

        peer.write_all(b"after").await.expect("write");
        drop(peer);
        let mut expected = request.to_vec();
        expected.extend_from_slice(b"after");
        assert_eq!(rest(&mut gated).await, expected);
        assert!(gated.unread().is_empty());
    }

    /// A first read that is a strict beginning of the preface reads on
    /// until the preface is whole; one that leaves it stops there.
    #[tokio::test]
    async fn the_first_read_reads_on_only_while_it_may_be_the_preface() {
        let (mut peer, io) = pair().await;
        let (mut gated, polls) = counted(io);
        let (head, tail) = PREFACE.split_at(5);
        peer.write_all(head).await.expect("write");
        let writer = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            peer.write_all(tail).await.expect("write");
            peer.write_all(b"frames").await.expect("write");
            peer
        });
        gated.read_first(PREFACE).await.expect("first read");
        assert!(gated.unread().starts_with(PREFACE), "{:?}", gated.unread());
        assert!(polls.load(Ordering::Relaxed) >= 2, "read on");
        drop(writer.await.expect("writer"));

        let (mut peer, io) = pair().await;
        let (mut gated, polls) = counted(io);
        peer.write_all(b"PRX").await.expect("write");
        tokio::time::sleep(Duration::from_millis(50)).await;
        gated.read_first(PREFACE).await.expect("first read");
        assert_eq!(gated.unread(), b"PRX");
        assert_eq!(
            polls.load(Ordering::Relaxed),
            1,
            "stopped at the difference"
        );
    }

    /// A peer that closes before sending anything leaves nothing unread.
    #[tokio::test]
    async fn a_first_read_at_the_end_keeps_nothing() {
        let (peer, io) = pair().await;
        drop(peer);
        let (mut gated, _) = counted(io);
        gated.read_first(PREFACE).await.expect("first read");
        assert!(gated.unread().is_empty());
        assert!(rest(&mut gated).await.is_empty());
    }

    /// A shutdown leaves the socket open; dropping it sends the FIN, and
    /// the peer reads everything written before it, then the end.
    #[tokio::test]
    async fn the_write_side_ends_when_the_socket_closes() {
        let (mut peer, io) = pair().await;
        let mut gated = GatedRead::new(io);
        tokio::io::AsyncWriteExt::write_all(&mut gated, b"bye")
            .await
            .expect("write");
        tokio::io::AsyncWriteExt::shutdown(&mut gated)
            .await
            .expect("shutdown");
        let mut got = [0u8; 8];
        let n = tokio::io::AsyncReadExt::read(&mut peer, &mut got)
            .await
            .expect("read");
        assert_eq!(&got[..n], b"bye");
        let early = tokio::time::timeout(
            Duration::from_millis(100),
            tokio::io::AsyncReadExt::read(&mut peer, &mut got),
        )
        .await;
        assert!(early.is_err(), "the end came before the close: {early:?}");
        drop(gated);
        let mut rest = Vec::new();
        tokio::io::AsyncReadExt::read_to_end(&mut peer, &mut rest)
            .await
            .expect("read to the end");
        assert!(rest.is_empty());
    }
}
