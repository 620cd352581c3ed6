//! Allocations on `serve`'s per-event path in steady state (issue 6: "no
//! per-event allocation in steady state"), counted by this test binary's
//! global allocator: the system allocator, with a per-thread count of the
//! allocations and reallocations made.
//!
//! Each test warms up first (buffers reach their working size, the tool
//! call's name is stored once), then counts over the events that follow.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::time::Instant;

use aalis_proxy::encode::{InjectMode, OutputFormat};
use aalis_proxy::framing::Framing;
use aalis_proxy::pipeline::{Annotator, AnnotatorConfig};
use aalis_proxy::proxy::body::OutBuf;
use aalis_proxy::proxy::sessions::{SessionRegistry, StreamHandle};
use bytes::Bytes;

struct Counting;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

fn count() {
    // `try_with`: a thread being torn down may still free and allocate.
    let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
}

// SAFETY: every call is passed on to the system allocator unchanged; the
// count is a thread-local `Cell`, which neither allocates nor locks.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Allocations this thread made while `f` ran.
fn allocations(f: impl FnOnce()) -> u64 {
    let before = ALLOCATIONS.with(Cell::get);
    f();
    ALLOCATIONS.with(Cell::get) - before
}

/// Event `i` of a streamed tool call, as an OpenAI-compatible upstream
/// sends it: 3–12 characters of arguments, some of them escaped or not
/// ASCII; every third repeats the tool's name, as some providers do.
fn delta_event(i: usize) -> Vec<u8> {
    const PIECES: [&str; 6] = [
        "{\\\"path\\\"",
        ": \\\"src/",
        "main.rs\\\", ",
        "\\\"text\\\": \\\"",
        "héllo wörld 🙂",
        "\\n    let x",
    ];
    let piece = PIECES[i % PIECES.len()];
    let name = if i.is_multiple_of(3) {
        "\"name\":\"write_file\","
    } else {
        ""
    };
    format!(
        "data: {{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1700000000,\
         \"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{{\"tool_calls\":[{{\"index\":0,\
         \"function\":{{{name}\"arguments\":\"{piece}\"}}}}]}},\"finish_reason\":null}}]}}\n\n"
    )
    .into_bytes()
}

const FIRST_EVENT: &[u8] = b"data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\
    \"created\":1700000000,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\
    \"tool_calls\":[{\"index\":0,\"id\":\"call_1\",\"type\":\"function\",\"function\":\
    {\"name\":\"write_file\",\"arguments\":\"\"}}]},\"finish_reason\":null}]}\n\n";

/// The connection's pattern: the piece taken for one event is still held
/// (queued for its write) while the next event is written, then dropped.
#[test]
fn an_output_buffer_whose_last_piece_is_still_held_does_not_allocate() {
    let events: Vec<Vec<u8>> = (0..600).map(delta_event).collect();
    let mut out = OutBuf::default();
    // The piece the connection holds, and the event it is.
    let mut held: Option<(Bytes, usize)> = None;
    let mut pieces = Vec::new();
    let step = |out: &mut OutBuf, held: &mut Option<(Bytes, usize)>, i: usize| {
        out.room_for(events[i].len()).extend_from_slice(&events[i]);
        let piece = out.take();
        // The previous piece is written and dropped only now: writing this
        // event left it as it was.
        if let Some((previous, at)) = held.replace((piece.clone(), i)) {
            assert_eq!(
                previous, events[at],
                "event {at} after event {i} was written"
            );
        }
        piece
    };
    for i in 0..100 {
        pieces.push(step(&mut out, &mut held, i));
    }
    // The pieces kept above hold their own buffers; from here on only the
    // connection's one held piece does.
    pieces.clear();
    let mut written = Vec::with_capacity(events.len());
    let n = allocations(|| {
        for i in 100..events.len() {
            let piece = step(&mut out, &mut held, i);
            written.push(piece.len());
        }
    });
    assert_eq!(n, 0, "allocations over 500 events with the last piece held");
    let expected: Vec<usize> = events[100..].iter().map(Vec::len).collect();
    assert_eq!(written, expected);

    // With nothing held, one buffer is enough, and a held piece keeps its
    // bytes while the buffer is written again.
    let mut out = OutBuf::default();
    out.room_for(events[0].len()).extend_from_slice(&events[0]);
    let kept = out.take();
    for event in &events[1..50] {
        out.room_for(event.len()).extend_from_slice(event);
        drop(out.take());
    }
    assert_eq!(kept, Bytes::from(events[0].clone()));
    let n = allocations(|| {
        for event in &events[50..] {
            out.room_for(event.len()).extend_from_slice(event);
            let piece = out.take();
            assert_eq!(piece.len(), event.len());
        }
    });
    assert_eq!(n, 0, "allocations over 550 events, nothing held");
}

/// A paced stream's output goes to the same memory every event: once the
/// connection has dropped the last piece, the next is written at the start
/// of the buffer (still in the cache), not after it, even where the
/// buffer has room after it (here, a buffer grown by a burst at the
/// stream's start). No allocation.
#[test]
fn a_paced_streams_output_is_written_where_the_last_was_once_it_is_dropped() {
    let events: Vec<Vec<u8>> = (0..60).map(delta_event).collect();
    let mut out = OutBuf::default();
    // A burst, gathered read by read: the buffer grows once to a whole
    // burst's size, far more than one event needs.
    for event in &events[..20] {
        out.room_for(event.len()).extend_from_slice(event);
    }
    let burst = out.take();
    assert_eq!(
        burst.len(),
        events[..20].iter().map(Vec::len).sum::<usize>()
    );
    let start = burst.as_ptr();
    drop(burst);
    let n = allocations(|| {
        for event in &events[20..] {
            out.room_for(event.len()).extend_from_slice(event);
            let piece = out.take();
            assert_eq!(&piece[..], &event[..]);
            assert_eq!(piece.as_ptr(), start, "written where the last piece was");
        }
    });
    assert_eq!(n, 0, "allocations over 40 paced events");
}

/// An unpaced stream's pattern: events are gathered up to 64 KiB before a
/// piece goes out (`COALESCE_BYTES`; less when the upstream pauses), and
/// the connection may queue several pieces before it writes them.
/// Allocations of the output buffer over 8 bursts after a warm-up of 4,
/// with `held_at_once` pieces held at a time: to find room for each burst
/// (its first event, and the take), and while gathering it. Bursts of
/// 64 KiB but every other one, which is of `small` bytes.
fn gather_bursts(held_at_once: usize, small: usize) -> (u64, u64) {
    const BURST: usize = 64 * 1024;
    type Held = std::collections::VecDeque<(Bytes, Vec<u8>)>;
    let events: Vec<Vec<u8>> = (0..600).map(delta_event).collect();
    let mut out = OutBuf::default();
    let mut held = Held::new();
    let mut next = 0;
    let mut count = 0;
    let mut burst = |out: &mut OutBuf, held: &mut Held| {
        let size = if count % 2 == 1 { small } else { BURST };
        count += 1;
        let mut expected = Vec::with_capacity(BURST + 1024);
        let first = &events[next % events.len()];
        expected.extend_from_slice(first);
        next += 1;
        let mut finding = allocations(|| out.room_for(first.len()).extend_from_slice(first));
        let room = out.room_for(0).capacity();
        let gathering = allocations(|| {
            while out.len() < size {
                let event = &events[next % events.len()];
                out.room_for(event.len()).extend_from_slice(event);
                next += 1;
                // Within capacity: the test's own copy does not allocate.
                expected.extend_from_slice(event);
            }
        });
        let mut piece = Bytes::new();
        finding += allocations(|| piece = out.take());
        held.push_back((piece, expected));
        if held.len() > held_at_once {
            let (piece, expected) = held.pop_front().expect("held");
            assert!(piece == expected, "a held piece changed");
        }
        // All the burst fits where it starts, after a warm-up: it is
        // neither grown nor moved (`bytes` moves what it holds back to the
        // start of a buffer that runs out of room at its end).
        (finding, gathering, room >= size)
    };
    for _ in 0..4 {
        burst(&mut out, &mut held);
    }
    let (mut finding, mut gathering) = (0, 0);
    for _ in 0..8 {
        let (f, g, fits) = burst(&mut out, &mut held);
        assert!(fits, "a burst found too little room at its start");
        finding += f;
        gathering += g;
    }
    for (piece, expected) in held {
        assert!(piece == expected, "a held piece changed");
    }
    (finding, gathering)
}

/// One piece held while the next burst is gathered: the two buffers take
/// turns, each made whole at its turn, and nothing is allocated. (Growing
/// a buffer copies all that was gathered; before this round, three to five
/// times per burst.)
#[test]
fn bursts_with_one_piece_held_take_turns_without_allocating() {
    for small in [64 * 1024, 8 * 1024] {
        let (finding, gathering) = gather_bursts(1, small);
        assert_eq!(gathering, 0, "small {small}: allocations while gathering");
        assert_eq!(finding, 0, "small {small}: allocations to find room");
    }
}

/// More pieces held than there are buffers: each burst needs a new one,
/// made once at the size of the last burst and never grown while gathering.
#[test]
fn bursts_with_several_pieces_held_get_a_buffer_each_and_never_grow_it() {
    for held in [2, 3] {
        let (finding, gathering) = gather_bursts(held, 64 * 1024);
        assert_eq!(gathering, 0, "{held} held: allocations while gathering");
        // A new buffer, and the header `bytes` gives it when it is split.
        assert!(
            finding <= 2 * 8,
            "{held} held: {finding} allocations to find room"
        );
    }
}

/// A new stream's first burst, read as an unpaced upstream's socket gives
/// it (reads of 8, 16, 32 and 64 KiB, as the upstream connection's read
/// buffer doubles): its output buffer is allocated for the first read and
/// grown at most twice while the burst gathers, where doubling as it
/// filled took six growths, each a copy of all gathered so far.
#[test]
fn a_new_streams_first_burst_grows_its_buffer_at_most_twice() {
    const BURST: usize = 64 * 1024;
    let events: Vec<Vec<u8>> = (0..2000).map(delta_event).collect();
    let mut next = 0;
    let mut reads = Vec::new();
    for size in [8 * 1024, 16 * 1024, 32 * 1024, 64 * 1024] {
        let mut read = Vec::with_capacity(size + 1024);
        while read.len() + events[next].len() <= size {
            read.extend_from_slice(&events[next]);
            next += 1;
        }
        reads.push(read);
    }
    let mut out = OutBuf::default();
    let mut gathered = 0;
    let n = allocations(|| {
        for read in &reads {
            out.room_for(read.len()).extend_from_slice(read);
            gathered += 1;
            if out.len() >= BURST {
                break;
            }
        }
    });
    assert_eq!(gathered, reads.len(), "the burst took all four reads");
    assert!(n <= 3, "{n} allocations for the first burst");
    let piece = out.take();
    assert!(piece == reads.concat(), "the burst's output changed");
}

/// A stream as `serve` sets it up for an SSE response: its session (which
/// nobody watches) and its annotator, with field injection.
fn proxied_stream(session_id: &str) -> (SessionRegistry, StreamHandle, Annotator) {
    let registry = SessionRegistry::new();
    let session = registry.begin_stream(session_id);
    let annotator = Annotator::new(AnnotatorConfig {
        output: OutputFormat::Sse,
        inject: InjectMode::Field,
        session_id: Some(session_id.to_owned()),
        framing: Some(Framing::Sse),
        max_event_bytes: 1 << 20,
        collect_events: true,
    });
    (registry, session, annotator)
}

/// What `serve` does with each event of a stream besides reading and
/// writing it (`TapBody`'s work between its upstream and its client):
/// annotate (parse, inject, count), gather into the output buffer, publish
/// to the session, which nobody watches here (frames for subscribers are
/// made, and allocated, only when someone listens). Tool-call deltas; text
/// deltas are the next test's.
#[test]
fn annotating_and_publishing_an_event_does_not_allocate_in_steady_state() {
    let (_registry, mut session, mut annotator) = proxied_stream("alloc-test");
    let mut out = OutBuf::default();
    let mut held: Option<Bytes> = None;
    let mut step = |event: &[u8]| {
        annotator.collect_events(session.listened());
        annotator.push(event, 1_700_000_000_000, out.room_for(event.len()));
        let missed = annotator.events_missed();
        let (tracker, events) = annotator.collected();
        session.publish_at(tracker, events, missed, Instant::now());
        annotator.clear_events();
        let piece = out.take();
        drop(held.replace(piece.clone()));
        piece
    };
    let first = step(FIRST_EVENT);
    assert!(
        first
            .windows(b"toolCallProgress".len())
            .any(|w| w == b"toolCallProgress"),
        "the first event carries progress: {:?}",
        String::from_utf8_lossy(&first)
    );
    let events: Vec<Vec<u8>> = (0..600).map(delta_event).collect();
    for event in &events[..100] {
        step(event);
    }
    let mut last = Bytes::new();
    let n = allocations(|| {
        for event in &events[100..] {
            last = step(event);
        }
    });
    assert_eq!(n, 0, "allocations over 500 events");
    // The events were annotated, not passed through: the last one says how
    // many characters of arguments have come.
    let text = String::from_utf8_lossy(&last);
    assert!(text.contains("\"charsAccumulated\":"), "{text}");
}

/// Text (`content`) or reasoning delta `i` as it comes, and its text as
/// subscribers hear it: escaped, not ASCII, or plain.
fn text_event(i: usize) -> (Vec<u8>, &'static str) {
    const PIECES: [(&str, &str); 5] = [
        ("Hello", "Hello"),
        (", \\\"quoted\\\"", ", \"quoted\""),
        (" wörld 🙂", " wörld 🙂"),
        ("\\n\\tnext line", "\n\tnext line"),
        (" \\u00e9t\\u00e9", " été"),
    ];
    let (json, text) = PIECES[i % PIECES.len()];
    let field = if i % 7 < 3 {
        "reasoning_content"
    } else {
        "content"
    };
    let event = format!(
        "data: {{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1700000000,\
         \"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{{\"{field}\":\"{json}\"}},\
         \"finish_reason\":null}}]}}\n\n"
    );
    (event.into_bytes(), text)
}

/// Text and reasoning deltas, read one to four at a time as a socket
/// hands them over, in a stream that collects its increments (as when its
/// session has a subscriber): each is collected for the subscribers (with
/// its text, unescaped) and published, and none allocates once the
/// collected strings are reused.
#[test]
fn text_deltas_are_collected_and_published_without_allocating() {
    use aalis_proxy::pipeline::StreamEvent;

    let (_registry, mut session, mut annotator) = proxied_stream("alloc-text");
    let events: Vec<(Vec<u8>, &str)> = (0..700).map(text_event).collect();
    // Reads of 1, 2, 3, 4, 1, 2, … events.
    let mut reads: Vec<(Vec<u8>, Vec<&str>)> = Vec::new();
    let mut at = 0;
    while at < events.len() {
        let n = (reads.len() % 4 + 1).min(events.len() - at);
        let batch = &events[at..at + n];
        reads.push((
            batch.iter().flat_map(|(e, _)| e.iter().copied()).collect(),
            batch.iter().map(|(_, t)| *t).collect(),
        ));
        at += n;
    }
    let mut out = OutBuf::default();
    let mut held: Option<Bytes> = None;
    let mut collected = 0usize;
    let mut step = |read: &(Vec<u8>, Vec<&str>)| {
        annotator.push(&read.0, 1_700_000_000_000, out.room_for(read.0.len()));
        let (tracker, events) = annotator.collected();
        let texts = events.iter().filter_map(|event| match event {
            StreamEvent::Content { text, .. } | StreamEvent::Reasoning { text, .. } => {
                Some(text.as_str())
            }
            _ => None,
        });
        assert!(texts.eq(read.1.iter().copied()), "{events:?}");
        collected += events
            .iter()
            .filter(|event| {
                matches!(
                    event,
                    StreamEvent::Content { .. } | StreamEvent::Reasoning { .. }
                )
            })
            .count();
        session.publish_at(tracker, events, false, Instant::now());
        annotator.clear_events();
        drop(held.replace(out.take()));
    };
    let (warm_up, counted) = reads.split_at(reads.len() / 4);
    for read in warm_up {
        step(read);
    }
    let n = allocations(|| {
        for read in counted {
            step(read);
        }
    });
    let counted_events: usize = counted.iter().map(|r| r.1.len()).sum();
    assert!(counted_events > 500, "{counted_events}");
    assert_eq!(n, 0, "allocations over {counted_events} text deltas");
    assert_eq!(collected, events.len(), "each delta was collected once");
}
