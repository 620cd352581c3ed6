//! A request sent once more when an HTTP/2 upstream refused it without
//! processing it (RFC 9113 §8.7): its stream reset with `REFUSED_STREAM`,
//! or above the last stream of a graceful `GOAWAY` (`NO_ERROR`), as a
//! server that drains or rotates its connections does. hyper's HTTP/2
//! client does not give such a request back, so it cannot be sent again
//! as it is: its body is sent through a [`Replayable`], which keeps what
//! it passed on (up to [`MAX_KEPT_BYTES`]) and the rest where it was, so a
//! second body can send all of it again without waiting for the first
//! to have read it whole.
//!
//! A graceful `GOAWAY` also fails, when the connection then closes, a
//! stream at or below its last one that the server did take and did not
//! answer; hyper's error does not say which stream it was. Such a request
//! got no response head either (only then is it sent again), so the
//! client would see a `502` for an answer it never had; a streaming API
//! sends its head at once, before it generates anything.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};

use super::lock;
use super::upstream::{BoxError, ProxyBody, has_cause};

/// The most of a request body kept to be sent again: a larger one is sent
/// once, as before. Chat requests are a few KiB.
pub const MAX_KEPT_BYTES: usize = 1024 * 1024;

/// Whether `err` (or one of its causes) is an HTTP/2 upstream's refusal of
/// a stream it did not process: a `REFUSED_STREAM` reset, or a graceful
/// `GOAWAY`, from the upstream.
pub fn refused_unprocessed(err: &(dyn std::error::Error + 'static)) -> bool {
    has_cause(err, &|err| {
        err.downcast_ref::<h2::Error>().is_some_and(|h2| {
            h2.is_remote()
                && match h2.reason() {
                    Some(h2::Reason::REFUSED_STREAM) => h2.is_reset(),
                    Some(h2::Reason::NO_ERROR) => h2.is_go_away(),
                    _ => false,
                }
        })
    })
}

/// What a replayable body passed on so far, and the rest of it.
struct Kept {
    /// Where the rest of the body is: taken by whichever body reads past
    /// what is kept.
    rest: ProxyBody,
    /// The frames passed on, in order, while they fit.
    frames: Vec<KeptFrame>,
    bytes: usize,
    /// More was passed on than [`MAX_KEPT_BYTES`]: not sent again.
    overflowed: bool,
    /// The body failed: not sent again.
    failed: bool,
    /// The rest ended.
    ended: bool,
    /// Which body sends the request now: an earlier one (hyper may still
    /// poll the body of a refused stream for a moment) fails instead of
    /// taking the rest from the one that replaced it.
    current: u64,
}

enum KeptFrame {
    Data(Bytes),
    Trailers(HeaderMap),
}

/// A request body that keeps what it passes on, so that [`Replay::again`]
/// can make a body that sends all of it again.
pub struct Replayable {
    kept: Arc<Mutex<Kept>>,
    /// The next kept frame this body sends, before it reads the rest.
    next: usize,
    /// This body's number (see [`Kept::current`]).
    number: u64,
}

/// The handle that makes a body send it all again.
pub struct Replay(Arc<Mutex<Kept>>);

impl Replayable {
    /// Wraps `body`.
    pub fn new(body: ProxyBody) -> (Replayable, Replay) {
        let kept = Arc::new(Mutex::new(Kept {
            rest: body,
            frames: Vec::new(),
            bytes: 0,
            overflowed: false,
            failed: false,
            ended: false,
            current: 0,
        }));
        (
            Replayable {
                kept: Arc::clone(&kept),
                next: 0,
                number: 0,
            },
            Replay(kept),
        )
    }
}

impl Replay {
    /// A body that sends the whole request body again, or `None` when
    /// that cannot be (more of it went than is kept, or it failed).
    pub fn again(&self) -> Option<Replayable> {
        let mut kept = lock(&self.0);
        if kept.overflowed || kept.failed {
            return None;
        }
        kept.current += 1;
        Some(Replayable {
            kept: Arc::clone(&self.0),
            next: 0,
            number: kept.current,
        })
    }
}

impl Body for Replayable {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        let mut kept = lock(&this.kept);
        if this.number != kept.current {
            return Poll::Ready(Some(Err("the request was sent again".into())));
        }
        if let Some(frame) = kept.frames.get(this.next) {
            this.next += 1;
            return Poll::Ready(Some(Ok(match frame {
                KeptFrame::Data(data) => Frame::data(data.clone()),
                KeptFrame::Trailers(trailers) => Frame::trailers(trailers.clone()),
            })));
        }
        if kept.ended {
            return Poll::Ready(None);
        }
        let polled = Pin::new(&mut kept.rest).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if !kept.overflowed {
                    let copy = match (frame.data_ref(), frame.trailers_ref()) {
                        (Some(data), _) => Some((KeptFrame::Data(data.clone()), data.len())),
                        (_, Some(trailers)) => Some((KeptFrame::Trailers(trailers.clone()), 0)),
                        _ => None,
                    };
                    if let Some((copy, len)) = copy {
                        kept.bytes += len;
                        if kept.bytes > MAX_KEPT_BYTES {
                            kept.overflowed = true;
                            kept.frames = Vec::new();
                        } else {
                            kept.frames.push(copy);
                            this.next = kept.frames.len();
                        }
                    }
                }
            }
            Poll::Ready(Some(Err(_))) => kept.failed = true,
            Poll::Ready(None) => kept.ended = true,
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        let kept = lock(&self.kept);
        self.next >= kept.frames.len() && (kept.ended || kept.rest.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        let kept = lock(&self.kept);
        let unsent: usize = kept.frames[self.next.min(kept.frames.len())..]
            .iter()
            .map(|frame| match frame {
                KeptFrame::Data(data) => data.len(),
                KeptFrame::Trailers(_) => 0,
            })
            .sum();
        let rest = match kept.ended {
            true => SizeHint::with_exact(0),
            false => kept.rest.size_hint(),
        };
        let unsent = unsent as u64;
        let mut hint = SizeHint::new();
        hint.set_lower(rest.lower().saturating_add(unsent));
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper.saturating_add(unsent));
        }
        hint
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Full};

    /// A body of `frames`, each ready at once.
    struct Frames(std::collections::VecDeque<Result<Frame<Bytes>, BoxError>>);

    impl Body for Frames {
        type Data = Bytes;
        type Error = BoxError;

        fn poll_frame(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
            Poll::Ready(self.get_mut().0.pop_front())
        }
    }

    fn body_of(pieces: &[&'static [u8]]) -> ProxyBody {
        Frames(
            pieces
                .iter()
                .map(|piece| Ok(Frame::data(Bytes::from_static(piece))))
                .collect(),
        )
        .boxed()
    }

    async fn read_all(mut body: Replayable, frames: Option<usize>) -> Vec<u8> {
        let mut out = Vec::new();
        let mut taken = 0;
        while frames != Some(taken) {
            let Some(frame) = body.frame().await else {
                break;
            };
            if let Ok(data) = frame.expect("a frame").into_data() {
                out.extend_from_slice(&data);
            }
            taken += 1;
        }
        out
    }

    /// A body read in part, then made again: the second sends all of it,
    /// what the first passed on and the rest, in order; a third, after the
    /// whole was read, sends it all again.
    #[tokio::test]
    async fn a_body_made_again_sends_all_of_it() {
        let (first, replay) = Replayable::new(body_of(&[b"ab", b"cd", b"ef"]));
        assert_eq!(read_all(first, Some(2)).await, b"abcd");
        let second = replay.again().expect("replayable");
        assert_eq!(second.size_hint().lower(), 4);
        assert_eq!(read_all(second, None).await, b"abcdef");
        // The first, replaced, takes nothing more.
        let (mut first, replay) = Replayable::new(body_of(&[b"ab", b"cd"]));
        assert!(first.frame().await.is_some_and(|f| f.is_ok()));
        let again = replay.again().expect("replayable");
        assert!(first.frame().await.is_some_and(|f| f.is_err()));
        assert_eq!(read_all(again, None).await, b"abcd");
        let (first, replay) = Replayable::new(body_of(&[b"ab", b"cd", b"ef"]));
        assert_eq!(read_all(first, None).await, b"abcdef");
        let third = replay.again().expect("replayable");
        assert!(!third.is_end_stream());
        assert_eq!(read_all(third, None).await, b"abcdef");
        let empty = Replayable::new(Full::new(Bytes::new()).map_err(BoxError::from).boxed()).1;
        let again = empty.again().expect("replayable");
        assert!(again.is_end_stream());
    }

    /// More than is kept, or a failed body, is not made again.
    #[tokio::test]
    async fn a_large_or_failed_body_is_not_made_again() {
        static BIG: [u8; MAX_KEPT_BYTES] = [b'x'; MAX_KEPT_BYTES];
        let (first, replay) = Replayable::new(body_of(&[&BIG, b"y"]));
        assert_eq!(read_all(first, None).await.len(), MAX_KEPT_BYTES + 1);
        assert!(replay.again().is_none());

        let failing =
            Frames([Ok(Frame::data(Bytes::from_static(b"a"))), Err("cut".into())].into()).boxed();
        let (mut first, replay) = Replayable::new(failing);
        assert!(first.frame().await.is_some_and(|f| f.is_ok()));
        assert!(first.frame().await.is_some_and(|f| f.is_err()));
        assert!(replay.again().is_none());
    }

    /// Only the upstream's refusals of a stream it did not process count:
    /// not the same reasons from this side, nor other reasons.
    #[test]
    fn only_an_upstreams_refusal_is_sent_again() {
        let ours = h2::Error::from(h2::Reason::REFUSED_STREAM);
        assert!(!refused_unprocessed(&ours), "{ours:?}");
        let io = std::io::Error::other("reset");
        assert!(!refused_unprocessed(&io));
    }
}
