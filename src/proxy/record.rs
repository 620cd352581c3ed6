//! `serve --record DIR`: every streamed upstream response, saved as a
//! capture `annotate` and `mock` replay (see [`crate::capture`]).
//!
//! For each stream three files, named `<unix ms>-<session>-<n>` so they
//! sort by time and never collide (a name that exists already, such as
//! another process's recording or a link, is never written through: the
//! next `n` is taken):
//! - `.sse` or `.ndjson`: the upstream body, byte for byte, as it came
//!   (before any injection). It is written as `….partial` and takes its
//!   name once the recording is finished and its sidecars are written, so
//!   a recording its process could not finish (killed, crashed) is never
//!   replayed as a whole capture: `mock` leaves `.partial` files out;
//! - the same name plus `.timing`: when each piece arrived;
//! - `.request.json`: the request body (its first MiB), copied as it
//!   streams to the upstream ([`tee`]). Headers are not recorded, so no
//!   `Authorization`, key or cookie is ever written.
//!
//! All three are made (empty) when the recording starts, to hold the name
//! (`Taken`), and the sidecars are written at its end.
//!
//! The session id comes from a request header: it is reduced to a safe file
//! name part ([`crate::capture::safe_file_part`]) so it cannot escape `DIR`
//! or name a hidden file. Body writes are buffered and small; the closing
//! writes (timing, request, the body's name) go to the blocking pool.
//!
//! An exit finishes every recording still open ([`OpenRecordings`]): what
//! arrived until then is kept, with its sidecars, as when a stream is cut;
//! none begins after; and it waits for the closing writes.

use std::fs::File;
use std::io::{BufWriter, ErrorKind, Write};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use pin_project_lite::pin_project;

use crate::capture::{Timing, safe_file_part};
use crate::filter::unix_ms;

use super::lock;
use crate::framing::Framing;

/// Where recordings go; shared by every stream of the proxy.
#[derive(Debug)]
pub struct Recorder {
    dir: PathBuf,
    counter: AtomicU64,
    open: OpenRecordings,
}

/// The recordings a [`Recorder`] has open, so that an exit that does not
/// wait for their streams can finish them ([`OpenRecordings::finish_all`]),
/// and those being finished, so that an exit can wait for them
/// ([`OpenRecordings::finished`]).
#[derive(Debug, Clone, Default)]
pub struct OpenRecordings {
    list: Arc<Mutex<List>>,
    /// Recordings whose file work (sidecars, the body's name) was handed
    /// to the blocking threads and has not run yet.
    finishing: Arc<AtomicUsize>,
}

/// The list of a [`OpenRecordings`]: the recordings (weakly), and whether
/// it takes no more ([`OpenRecordings::finish_all`] ran: the exit).
#[derive(Debug, Default)]
struct List {
    open: Vec<Weak<Mutex<Open>>>,
    closed: bool,
}

/// A recording counted as being finished until dropped: with its file
/// work, when it is handed on (dropped unrun, as a runtime that ends drops
/// what it has queued, it is no longer counted either: nothing will run).
struct Finishing(Arc<AtomicUsize>);

impl Finishing {
    fn new(count: &Arc<AtomicUsize>) -> Finishing {
        count.fetch_add(1, Ordering::AcqRel);
        Finishing(Arc::clone(count))
    }
}

impl Drop for Finishing {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// How much of a request body is kept for `.request.json`.
pub const MAX_RECORDED_REQUEST_BYTES: usize = 1024 * 1024;

/// The copy a [`tee`] keeps of a request body.
#[derive(Debug, Clone, Default)]
pub struct RequestCopy(Arc<Mutex<Vec<u8>>>);

pin_project! {
    /// A request body passed on unchanged while its first
    /// [`MAX_RECORDED_REQUEST_BYTES`] are copied.
    pub struct TeeBody {
        #[pin]
        inner: Incoming,
        copy: RequestCopy,
    }
}

/// Wraps a request body so that it streams on as before while it is copied.
pub fn tee(inner: Incoming) -> (TeeBody, RequestCopy) {
    let copy = RequestCopy::default();
    (
        TeeBody {
            inner,
            copy: copy.clone(),
        },
        copy,
    )
}

impl Body for TeeBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.project();
        let polled = ready!(this.inner.poll_frame(cx));
        if let Some(Ok(frame)) = &polled
            && let Some(data) = frame.data_ref()
        {
            let mut copy = lock(&this.copy.0);
            let room = MAX_RECORDED_REQUEST_BYTES.saturating_sub(copy.len());
            copy.extend_from_slice(&data[..room.min(data.len())]);
        }
        Poll::Ready(polled)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// One stream being recorded; finished when dropped (or by
/// [`OpenRecordings::finish_all`], whichever comes first).
#[derive(Debug)]
pub struct Recording {
    open: Arc<Mutex<Open>>,
    /// [`OpenRecordings`]' count of those being finished.
    finishing: Arc<AtomicUsize>,
}

/// A recording's files and what is still to be written to them.
#[derive(Debug)]
struct Open {
    body: BufWriter<File>,
    /// Where the body is written: its name and `.partial`.
    body_path: PathBuf,
    /// The body's name once the recording is finished whole.
    done_path: PathBuf,
    timing_path: PathBuf,
    request_path: PathBuf,
    /// `request_path`, made when the recording started: its name is the
    /// stem's (`.request.json` has no `.sse` or `.ndjson`), so holding it
    /// holds the stem against a recording of the other framing.
    request_file: Option<File>,
    /// `timing_path`, made when the recording started.
    timing_file: Option<File>,
    request: RequestCopy,
    timing: Timing,
    started: Instant,
    bytes: u64,
    /// A write failed (reported once): nothing more is written, and the
    /// body is kept as `….partial`, never as a capture with a hole.
    failed: bool,
    /// The response came to its end ([`Recording::ended`]); finished
    /// without it, the timing says the capture was cut.
    ended: bool,
    /// Finished: the body flushed and the sidecars handed on; nothing more
    /// is written.
    finished: bool,
}

/// The files of a recording's name, all made (`create_new`) when it
/// starts, so that its end writes into files of its own.
struct Taken {
    request_path: PathBuf,
    request_file: File,
    timing_path: PathBuf,
    timing_file: File,
    /// The body's name once the recording is finished.
    done_path: PathBuf,
    /// Where the body is written: `done_path` and `.partial`.
    body_path: PathBuf,
    body: File,
}

impl Taken {
    /// Takes `stem`'s files in `dir`, or none of them: the request's (it
    /// holds the stem, which a recording of the other framing shares),
    /// the timing's, and the body's `.partial`, each one that no file has
    /// yet (an existing file, another process's recording, is never
    /// overwritten, and a link planted in DIR never followed out of it:
    /// `create_new` does not follow a symbolic link); and only if the
    /// body's name is free too. A recorder that finished that name holds
    /// it from then on, and one that has not holds the `.partial`, so the
    /// rename that finishes a recording replaces nothing (a link planted
    /// there later is replaced, not followed). `AlreadyExists` when a
    /// name is taken.
    fn new(dir: &Path, stem: &str, extension: &str) -> std::io::Result<Taken> {
        let request_path = dir.join(format!("{stem}.request.json"));
        let done_path = dir.join(format!("{stem}.{extension}"));
        let timing_path = Timing::sidecar(&done_path);
        let body_path = partial(&done_path);
        let mut made: Vec<&Path> = Vec::new();
        let taken = (|| {
            let request_file = create_new(&request_path)?;
            made.push(&request_path);
            let timing_file = create_new(&timing_path)?;
            made.push(&timing_path);
            let body = create_new(&body_path)?;
            made.push(&body_path);
            match std::fs::symlink_metadata(&done_path) {
                Err(err) if err.kind() == ErrorKind::NotFound => {}
                Ok(_) => return Err(ErrorKind::AlreadyExists.into()),
                Err(err) => return Err(err),
            }
            Ok((request_file, timing_file, body))
        })();
        match taken {
            Ok((request_file, timing_file, body)) => Ok(Taken {
                request_path: request_path.clone(),
                request_file,
                timing_path: timing_path.clone(),
                timing_file,
                done_path: done_path.clone(),
                body_path: body_path.clone(),
                body,
            }),
            Err(err) => {
                for path in made {
                    let _ = std::fs::remove_file(path);
                }
                Err(err)
            }
        }
    }
}

impl Recorder {
    /// Records into `dir`, which must exist (the CLI creates it at start,
    /// so a bad directory fails before the port is taken).
    pub fn new(dir: &Path) -> Recorder {
        Recorder {
            dir: dir.to_owned(),
            counter: AtomicU64::new(0),
            open: OpenRecordings::default(),
        }
    }

    /// The recordings this recorder has open, now and later.
    pub fn open_recordings(&self) -> OpenRecordings {
        self.open.clone()
    }

    /// Starts recording a stream of `session`, answered with `status`,
    /// whose request body is being copied into `request`.
    pub fn start(
        &self,
        session: &str,
        framing: Framing,
        status: http::StatusCode,
        request: RequestCopy,
    ) -> std::io::Result<Recording> {
        let extension = match framing {
            Framing::Sse => "sse",
            Framing::Ndjson => "ndjson",
        };
        let part = safe_file_part(session);
        // Only a name nothing has yet (see `Taken::new`); the next number
        // is tried instead.
        let mut tries = 0;
        let taken = loop {
            let n = self.counter.fetch_add(1, Ordering::Relaxed);
            let stem = format!("{}-{part}-{n}", unix_ms());
            match Taken::new(&self.dir, &stem, extension) {
                Ok(taken) => break taken,
                Err(err) if err.kind() == ErrorKind::AlreadyExists && tries < 100 => tries += 1,
                // Which name could not be taken, for the warning.
                Err(err) => {
                    return Err(std::io::Error::new(
                        err.kind(),
                        format!(
                            "{}: {err}",
                            self.dir.join(format!("{stem}.{extension}")).display()
                        ),
                    ));
                }
            }
        };
        let Taken {
            request_path,
            request_file,
            timing_path,
            timing_file,
            done_path,
            body_path,
            body: file,
        } = taken;
        let body = BufWriter::new(file);
        let open = Arc::new(Mutex::new(Open {
            body,
            timing_path,
            timing_file: Some(timing_file),
            body_path,
            done_path,
            request_path,
            request_file: Some(request_file),
            request,
            timing: Timing {
                status: Some(status.as_u16()),
                ..Timing::default()
            },
            started: Instant::now(),
            bytes: 0,
            failed: false,
            ended: false,
            finished: false,
        }));
        if !self.open.add(&open) {
            // The exit finished every recording already: none begins.
            let mut open = lock(&open);
            open.finished = true;
            let _ = std::fs::remove_file(&open.body_path);
            let _ = std::fs::remove_file(&open.timing_path);
            let _ = std::fs::remove_file(&open.request_path);
            return Err(std::io::Error::other(
                "serve is exiting: no recording begins now",
            ));
        }
        Ok(Recording {
            open,
            finishing: Arc::clone(&self.open.finishing),
        })
    }
}

impl OpenRecordings {
    /// Lists `open`, unless the list takes no more (false).
    fn add(&self, open: &Arc<Mutex<Open>>) -> bool {
        let mut list = lock(&self.list);
        if list.closed {
            return false;
        }
        // The ended recordings' entries go once the list would grow: it
        // holds at most twice the recordings open.
        if list.open.len() == list.open.capacity() {
            list.open.retain(|entry| entry.strong_count() > 0);
        }
        list.open.push(Arc::downgrade(open));
        true
    }

    /// Waits, up to `limit`, until every recording handed to the blocking
    /// threads to be finished is (their runtime drops what is still
    /// queued when it ends); how many were not by then.
    pub async fn finished(&self, limit: Duration) -> usize {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let left = self.finishing.load(Ordering::Acquire);
            if left == 0 || tokio::time::Instant::now() >= deadline {
                return left;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Finishes every recording still open, here and now: each body is
    /// flushed as it stands and its sidecars are written, as when its
    /// stream is cut. For an exit that will not wait for the streams; a
    /// stream that goes on writes nothing more to its recording, and none
    /// begins after. Returns how many were finished.
    pub fn finish_all(&self) -> usize {
        let open: Vec<Arc<Mutex<Open>>> = {
            let mut list = lock(&self.list);
            list.closed = true;
            list.open.iter().filter_map(Weak::upgrade).collect()
        };
        let mut finished = 0;
        for recording in open {
            // The file work without the recording's lock.
            let rest = lock(&recording).finish();
            if let Some(rest) = rest {
                rest();
                finished += 1;
            }
        }
        finished
    }
}

/// Whether files can be made in `dir`: a probe file is made and removed,
/// so that a directory that takes none (read-only, another user's) fails
/// `serve`'s start, not every stream with a warning.
pub fn check_writable(dir: &Path) -> std::io::Result<()> {
    let mut tries = 0;
    loop {
        let probe = dir.join(format!(
            ".aalis-proxy-write-check-{}-{}",
            std::process::id(),
            unix_ms().wrapping_add(tries)
        ));
        match create_new(&probe) {
            Ok(_) => return std::fs::remove_file(&probe),
            Err(err) if err.kind() == ErrorKind::AlreadyExists && tries < 10 => tries += 1,
            Err(err) => return Err(err),
        }
    }
}

/// Writes `bytes` to a new file at `path` (see [`create_new`]); a file
/// made but not written whole (a full disk) is removed: an empty `.timing`
/// would replay the capture in one piece, where none paces it.
fn write_new(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut file = create_new(path)?;
    file.write_all(bytes).inspect_err(|_| {
        let _ = std::fs::remove_file(path);
    })
}

/// `path` with `.partial` added: a recording's body until it is finished
/// whole.
fn partial(path: &Path) -> PathBuf {
    let mut partial = path.to_owned().into_os_string();
    partial.push(".partial");
    PathBuf::from(partial)
}

/// Creates `path`, which must not exist yet (not even as a link).
fn create_new(path: &Path) -> std::io::Result<File> {
    File::options().write(true).create_new(true).open(path)
}

impl Recording {
    /// A piece of the upstream body, as it arrived. False once the
    /// recording was finished while its stream goes on
    /// ([`OpenRecordings::finish_all`]: an exit at once): the piece is not
    /// in it, and must not reach the client either.
    #[must_use]
    pub fn data(&mut self, bytes: &[u8]) -> bool {
        bytes.is_empty() || lock(&self.open).data(bytes)
    }

    /// The upstream body came to its end. A recording finished without
    /// this (the upstream failed, the client left, `serve` exited) is
    /// marked cut in its timing, and `mock` replays it cut.
    pub fn ended(&mut self) {
        lock(&self.open).ended = true;
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        // Counted until its file work has run: an exit waits for it, since
        // the blocking threads drop what is still queued when their
        // runtime ends (the body would stay `.partial`). Counted before the
        // recording is marked finished, so that no wait sees neither.
        let finishing = Finishing::new(&self.finishing);
        let finished = lock(&self.open).finish();
        if let Some(rest) = finished {
            off_the_workers(move || {
                rest();
                drop(finishing);
            });
        }
    }
}

/// The file work left when a recording is finished.
type Rest = Box<dyn FnOnce() + Send>;

impl Open {
    /// Returns false once the recording is finished (it takes nothing
    /// more); a write that failed still counts as taken.
    fn data(&mut self, bytes: &[u8]) -> bool {
        if self.finished {
            return false;
        }
        if self.failed {
            return true;
        }
        if let Err(err) = self.body.write_all(bytes) {
            // A later write that succeeds (space came back) would splice
            // the capture: nothing more is written.
            self.failed = true;
            tracing::warn!(
                "recording {} stopped writing, kept as .partial: {err}",
                self.body_path.display()
            );
            return true;
        }
        self.bytes += bytes.len() as u64;
        let ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.timing.marks.push((self.bytes, ms));
        true
    }

    /// Flushes the body and returns the rest of the file work (writing the
    /// sidecars, then naming the body), the first time only; none for a
    /// body a write failed for, which stays `….partial`.
    fn finish(&mut self) -> Option<Rest> {
        if std::mem::replace(&mut self.finished, true) {
            return None;
        }
        let flushed = match self.failed {
            true => Err(std::io::Error::other("an earlier write failed")),
            false => self.body.flush(),
        };
        let request_path = std::mem::take(&mut self.request_path);
        let request_file = self.request_file.take();
        let timing_path = std::mem::take(&mut self.timing_path);
        let timing_file = self.timing_file.take();
        if let Err(err) = flushed {
            // Left as `.partial`: visibly incomplete, never replayed as a
            // whole capture (`mock` reads `.sse` and `.ndjson`); no
            // sidecars, so the name's other files go. The write that
            // failed first said so.
            if !self.failed {
                tracing::warn!(
                    "recording {} kept as .partial: {err}",
                    self.done_path.display()
                );
            }
            drop((request_file, timing_file));
            return Some(Box::new(move || {
                let _ = std::fs::remove_file(&request_path);
                let _ = std::fs::remove_file(&timing_path);
            }));
        }
        self.timing.cut = !self.ended;
        if self.timing.cut {
            let ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
            self.timing.cut_ms = Some(ms);
        }
        let cut = self.timing.cut;
        let timing = self.timing.render();
        let request = std::mem::take(&mut *lock(&self.request.0));
        let body_path = std::mem::take(&mut self.body_path);
        let done_path = std::mem::take(&mut self.done_path);
        let write = move || {
            // Each into its own file, made when the recording started,
            // whatever became of the other; one not written whole (a full
            // disk) is removed.
            let timing_written = write_whole(timing_file, &timing_path, timing.as_bytes());
            let request_written = write_whole(request_file, &request_path, &request);
            if let Err(err) = request_written {
                tracing::warn!("cannot write {}: {err}", request_path.display());
            }
            // Without its timing a capture replays paced; a cut one would
            // replay whole: it stays `.partial`, its request file gone.
            let renamed = match (&timing_written, cut) {
                (Err(err), true) => Err(std::io::Error::other(format!(
                    "cannot write {}, which says it was cut: {err}",
                    timing_path.display()
                ))),
                (Err(err), false) => {
                    tracing::warn!(
                        "cannot write {} (the capture replays paced): {err}",
                        timing_path.display()
                    );
                    std::fs::rename(&body_path, &done_path)
                }
                (Ok(()), _) => std::fs::rename(&body_path, &done_path),
            };
            // The body takes its name last, once its sidecars are
            // written (or failed, and were said): whoever sees the capture
            // sees its timing with it.
            if let Err(err) = renamed {
                tracing::warn!(
                    "cannot name the recording {}, kept as .partial: {err}",
                    done_path.display()
                );
                let _ = std::fs::remove_file(&timing_path);
                let _ = std::fs::remove_file(&request_path);
            }
        };
        Some(Box::new(write))
    }
}

/// Writes `bytes` into `file`, made at `path` when the recording started
/// (made now, as [`write_new`] does, if it was not); removes it if they
/// are not written whole.
fn write_whole(file: Option<File>, path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    match file {
        Some(mut file) => file.write_all(bytes).inspect_err(|_| {
            let _ = std::fs::remove_file(path);
        }),
        None => write_new(path, bytes),
    }
}

/// Runs file work `f` off the async workers when there are some (on the
/// runtime's blocking threads), here and now otherwise.
fn off_the_workers(f: impl FnOnce() + Send + 'static) {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => drop(runtime.spawn_blocking(f)),
        Err(_) => f(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A write that fails stops the recording: nothing more is written
    /// (one that succeeds later, space come back, would splice the
    /// capture), and the body is kept as `….partial`, without sidecars, so
    /// that nothing replays it as a whole capture.
    /// A fresh directory named by `tag`, its recorder, and one recording
    /// started in it.
    fn recording_in(tag: &str) -> (std::path::PathBuf, Recorder, Recording) {
        let dir = std::env::temp_dir().join(format!("aalis-record-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a directory");
        let recorder = Recorder::new(&dir);
        let recording = recorder
            .start(
                "s",
                Framing::Sse,
                http::StatusCode::OK,
                RequestCopy::default(),
            )
            .expect("started");
        (dir, recorder, recording)
    }

    /// What follows the stem in the names of the files in `dir`, sorted
    /// (`sse`, `sse.timing`, `request.json`, …).
    fn name_ends(dir: &Path) -> Vec<String> {
        let mut ends: Vec<String> = std::fs::read_dir(dir)
            .expect("listed")
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter_map(|n| n.split_once('.').map(|(_, end)| end.to_owned()))
            .collect();
        ends.sort();
        ends
    }

    #[test]
    fn a_failed_write_leaves_a_partial_body_and_no_sidecars() {
        let (dir, _recorder, mut recording) = recording_in("failed");
        let name = {
            let mut open = lock(&recording.open);
            // Its file, read-only from now on: every write to it fails.
            open.body = BufWriter::new(File::open(&open.body_path).expect("opened"));
            open.done_path
                .file_name()
                .and_then(|n| n.to_str())
                .map(str::to_owned)
                .expect("a name")
        };
        // Taken, though not written: the stream goes on.
        assert!(recording.data(&[b'x'; 16 * 1024]));
        assert!(recording.data(b"data: more\n\n"));
        {
            let open = lock(&recording.open);
            assert!(open.failed);
            assert!(open.timing.marks.is_empty());
        }
        drop(recording);
        let mut left: Vec<String> = std::fs::read_dir(&dir)
            .expect("listed")
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .collect();
        left.sort();
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(left, [format!("{name}.partial")]);
    }

    /// A recording dropped on a runtime is finished on its blocking
    /// threads; [`OpenRecordings::finished`] returns once it is: its
    /// sidecars written and its body named. (An exit waits so, before the
    /// runtime ends and drops what its blocking threads have queued.)
    #[tokio::test]
    async fn an_exit_can_wait_for_the_recordings_being_finished() {
        let (dir, recorder, mut recording) = recording_in("finished");
        assert!(recording.data(b"data: one\n\n"));
        recording.ended();
        drop(recording);
        let open = recorder.open_recordings();
        assert_eq!(open.finished(Duration::from_secs(10)).await, 0);
        let ends = name_ends(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(ends, ["request.json", "sse", "sse.timing"]);
    }

    /// The stem is held by its `.request.json`: a recording does not take
    /// a stem whose request file another recorder made (the same session,
    /// millisecond and count, in another process; its other framing's body
    /// name is free), which paired a capture with the other's request.
    #[test]
    fn a_stem_whose_request_file_exists_is_not_taken() {
        let dir = std::env::temp_dir().join(format!("aalis-record-stem-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a directory");
        // Another recorder's request files, at count 0, for the next 2 s.
        let now = unix_ms();
        for ms in now..now + 2000 {
            std::fs::write(dir.join(format!("{ms}-s-0.request.json")), "theirs").expect("planted");
        }
        let recorder = Recorder::new(&dir);
        let request = RequestCopy::default();
        lock(&request.0).extend_from_slice(b"mine");
        let recording = recorder
            .start("s", Framing::Sse, http::StatusCode::OK, request)
            .expect("started");
        let stem = lock(&recording.open)
            .done_path
            .file_stem()
            .and_then(|s| s.to_str())
            .map(str::to_owned)
            .expect("a stem");
        drop(recording);
        let request = std::fs::read_to_string(dir.join(format!("{stem}.request.json")));
        let _ = std::fs::remove_dir_all(&dir);
        assert!(stem.ends_with("-s-1"), "{stem}");
        assert_eq!(request.expect("its request"), "mine");
    }

    /// A cut recording whose timing cannot be written stays `.partial`:
    /// without the timing's cut line it would replay as a whole capture.
    /// Its other files go.
    #[test]
    fn a_cut_recording_without_its_timing_stays_partial() {
        let (dir, _recorder, mut recording) = recording_in("cut-no-timing");
        {
            let mut open = lock(&recording.open);
            // Its timing file, read-only from now on: its write fails.
            open.timing_file = Some(File::open(&open.timing_path).expect("opened"));
        }
        assert!(recording.data(b"data: one\n\n"));
        drop(recording);
        let ends = name_ends(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(ends, ["sse.partial"]);
    }

    /// Once the exit has finished every recording (`finish_all`), none
    /// begins: a stream still waiting for its upstream's head would start
    /// one that nothing finishes, left `.partial` with the workers.
    #[test]
    fn no_recording_begins_after_the_exit_finished_them() {
        let (dir, recorder, recording) = recording_in("closed");
        drop(recording);
        assert_eq!(recorder.open_recordings().finish_all(), 0);
        let before = std::fs::read_dir(&dir).map_or(0, Iterator::count);
        let refused = recorder.start(
            "s",
            Framing::Sse,
            http::StatusCode::OK,
            RequestCopy::default(),
        );
        let after = std::fs::read_dir(&dir).map_or(0, Iterator::count);
        let _ = std::fs::remove_dir_all(&dir);
        assert!(refused.is_err());
        assert_eq!(
            before, after,
            "files made for a recording that did not begin"
        );
    }

    /// A recording finished for an exit at once (a second signal) takes no
    /// more pieces, and says so: its stream must not send them to the
    /// client either, or the client would hold bytes the recording lacks
    /// (a review saw up to 28 of 100 recordings one event short).
    #[test]
    fn a_recording_finished_for_the_exit_refuses_what_comes_after() {
        let (dir, recorder, mut recording) = recording_in("exit");
        assert!(recording.data(b"data: one\n\n"));
        assert_eq!(recorder.open_recordings().finish_all(), 1);
        assert!(!recording.data(b"data: two\n\n"), "taken after the finish");
        assert!(recording.data(b""), "nothing is always taken");
        drop(recording);
        let body = std::fs::read_dir(&dir)
            .expect("listed")
            .filter_map(|e| e.ok())
            .find(|e| e.file_name().to_string_lossy().ends_with(".sse"))
            .and_then(|e| std::fs::read(e.path()).ok());
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(body.as_deref(), Some(&b"data: one\n\n"[..]));
    }
}
