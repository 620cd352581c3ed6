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
//! yet. [`GatedRead`] puts a gate on the read side of a client's stream.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Waker};

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

/// A stream whose reads pass through a [`Gate`]; writes go straight to it.
///
/// `serve` wraps each client connection in one. While a response streams,
/// hyper's server reads the client's side on each poll of the connection
/// (every event), to hear whether the client closed it (its
/// `mid_message_detect_eof`), and that read nearly always finds nothing.
pub(crate) struct GatedRead<T> {
    io: T,
    gate: Gate,
}

impl<T> GatedRead<T> {
    pub(crate) fn new(io: T) -> GatedRead<T> {
        GatedRead {
            io,
            gate: Gate::new(),
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for GatedRead<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
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
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
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
}
