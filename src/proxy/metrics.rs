//! `GET /_aalis/metrics`: counters and histograms in the Prometheus text
//! format (version 0.0.4), updated with atomics on the request path and
//! rendered on demand. No dependency: the format is a few lines of text.
//!
//! Read [`Metrics::render`] for the list.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

/// Upper bounds of the histogram buckets, in seconds.
const BUCKETS_SECONDS: [f64; 14] = [
    0.000_01, 0.000_05, 0.000_1, 0.000_5, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 120.0,
];

/// Why an upstream request or stream failed, as the metric's `kind` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpstreamErrorKind {
    Unreachable,
    Timeout,
    Error,
    IdleTimeout,
    Reset,
    /// The upstream reported an error inside its stream (a `{"error":…}`
    /// chunk, an `event: error`), after a `200`.
    InStream,
}

impl UpstreamErrorKind {
    const ALL: [UpstreamErrorKind; 6] = [
        UpstreamErrorKind::Unreachable,
        UpstreamErrorKind::Timeout,
        UpstreamErrorKind::Error,
        UpstreamErrorKind::IdleTimeout,
        UpstreamErrorKind::Reset,
        UpstreamErrorKind::InStream,
    ];

    fn label(self) -> &'static str {
        match self {
            UpstreamErrorKind::Unreachable => "unreachable",
            UpstreamErrorKind::Timeout => "timeout",
            UpstreamErrorKind::Error => "error",
            UpstreamErrorKind::IdleTimeout => "idle_timeout",
            UpstreamErrorKind::Reset => "reset",
            UpstreamErrorKind::InStream => "in_stream",
        }
    }

    fn slot(self) -> usize {
        match self {
            UpstreamErrorKind::Unreachable => 0,
            UpstreamErrorKind::Timeout => 1,
            UpstreamErrorKind::Error => 2,
            UpstreamErrorKind::IdleTimeout => 3,
            UpstreamErrorKind::Reset => 4,
            UpstreamErrorKind::InStream => 5,
        }
    }
}

/// A histogram of durations, rendered cumulative.
#[derive(Debug, Default)]
pub struct Histogram {
    /// Observations per bucket alone: `buckets[i]` counts those above
    /// bound `i - 1` and at most bound `i` (those above the last bound are
    /// only in `count`). One atomic add per observation instead of one per
    /// bucket it falls in (up to 14, on counters every worker writes);
    /// [`render`](Self::render) sums them into Prometheus' cumulative
    /// buckets.
    buckets: [AtomicU64; BUCKETS_SECONDS.len()],
    count: AtomicU64,
    sum_nanos: AtomicU64,
}

impl Histogram {
    pub fn observe(&self, duration: Duration) {
        let seconds = duration.as_secs_f64();
        // The bounds ascend: the first one it is within is its bucket.
        if let Some(bucket) = BUCKETS_SECONDS.iter().position(|&bound| seconds <= bound) {
            self.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        let nanos = u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX);
        self.sum_nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    fn render(&self, name: &str, help: &str, out: &mut String) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0u64;
        for (bucket, bound) in self.buckets.iter().zip(BUCKETS_SECONDS) {
            cumulative += bucket.load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {cumulative}");
        }
        // Read after the buckets, but an observation between the two
        // reads may be in a bucket and not yet counted: the total is
        // never shown below a bucket (Prometheus would take the
        // histogram for broken).
        let count = self.count.load(Ordering::Relaxed).max(cumulative);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let sum = self.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
        let _ = writeln!(out, "{name}_sum {sum}\n{name}_count {count}");
    }
}

/// The `code` label of `aalis_requests_total`: a status's class, so that
/// the labels are few whatever an upstream answers.
const STATUS_CLASSES: [&str; 6] = ["1xx", "2xx", "3xx", "4xx", "5xx", "other"];

/// Every metric of one proxy.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Requests for the upstream that got their log line, by the class of
    /// their status ([`STATUS_CLASSES`]).
    requests: [AtomicU64; STATUS_CLASSES.len()],
    pub streams_open: AtomicI64,
    pub streams_total: AtomicU64,
    pub frames_total: AtomicU64,
    pub tool_calls_total: AtomicU64,
    pub bytes_in_total: AtomicU64,
    pub bytes_out_total: AtomicU64,
    /// The bytes of events frames that subscribers' connections have not
    /// taken yet, over every subscriber (bounded by
    /// `admin::ALL_SUBSCRIBERS_BACKLOG_BYTES`).
    pub subscriber_backlog_bytes: AtomicUsize,
    upstream_errors: [AtomicU64; 6],
    /// From the request to the first byte of the upstream's body.
    pub time_to_first_byte: Histogram,
    /// From taking the first upstream frame of a write to passing the write
    /// on: annotating, gathering and publishing it (one per write).
    pub added_latency: Histogram,
}

impl Metrics {
    pub fn upstream_error(&self, kind: UpstreamErrorKind) {
        self.upstream_errors[kind.slot()].fetch_add(1, Ordering::Relaxed);
    }

    /// A request for the upstream is over (its log line is written), with
    /// the status its line says (499 for a client gone before the answer).
    pub fn request_over(&self, status: http::StatusCode) {
        let class = match status.as_u16() / 100 {
            class @ 1..=5 => usize::from(class) - 1,
            _ => STATUS_CLASSES.len() - 1,
        };
        self.requests[class].fetch_add(1, Ordering::Relaxed);
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let gauge = |out: &mut String, name: &str, help: &str, value: i64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}"
            );
        };
        let counter = |out: &mut String, name: &str, help: &str, value: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {value}"
            );
        };
        let name = "aalis_requests_total";
        let _ = writeln!(
            out,
            "# HELP {name} Requests for the upstream, when over, by the class of their status \
             (499: the client left first; heads the HTTP/1.1 parser refused included; the \
             proxy's own routes are not counted).\n\
             # TYPE {name} counter"
        );
        for (class, count) in STATUS_CLASSES.iter().zip(&self.requests) {
            let _ = writeln!(
                out,
                "{name}{{code=\"{class}\"}} {}",
                count.load(Ordering::Relaxed)
            );
        }
        gauge(
            &mut out,
            "aalis_streams_open",
            "Streamed responses being passed on now.",
            self.streams_open.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "aalis_streams_total",
            "Streamed responses passed on.",
            self.streams_total.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "aalis_stream_frames_total",
            "SSE events and NDJSON lines passed on in streams.",
            self.frames_total.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "aalis_tool_calls_total",
            "Tool calls seen in streams, counted when their stream ends.",
            self.tool_calls_total.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "aalis_bytes_in_total",
            "Response body bytes received from the upstream.",
            self.bytes_in_total.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "aalis_bytes_out_total",
            "Response body bytes sent to clients.",
            self.bytes_out_total.load(Ordering::Relaxed),
        );
        gauge(
            &mut out,
            "aalis_subscriber_backlog_bytes",
            "Bytes of events frames queued for subscribers' connections (not the one each is writing).",
            i64::try_from(self.subscriber_backlog_bytes.load(Ordering::Relaxed))
                .unwrap_or(i64::MAX),
        );
        let name = "aalis_upstream_errors_total";
        let _ = writeln!(
            out,
            "# HELP {name} Upstream failures by kind.\n# TYPE {name} counter"
        );
        for kind in UpstreamErrorKind::ALL {
            let value = self.upstream_errors[kind.slot()].load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}{{kind=\"{}\"}} {value}", kind.label());
        }
        self.time_to_first_byte.render(
            "aalis_time_to_first_byte_seconds",
            "From the request to the first byte of the upstream's body.",
            &mut out,
        );
        self.added_latency.render(
            "aalis_added_latency_seconds",
            "From taking the first upstream frame of a write to passing the write on.",
            &mut out,
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative_and_counters_render() {
        let metrics = Metrics::default();
        metrics.added_latency.observe(Duration::from_micros(20));
        metrics.added_latency.observe(Duration::from_millis(2));
        metrics.upstream_error(UpstreamErrorKind::Timeout);
        metrics.streams_total.fetch_add(3, Ordering::Relaxed);
        for status in [200, 201, 499, 502, 999] {
            metrics.request_over(http::StatusCode::from_u16(status).expect("a status"));
        }
        let text = metrics.render();
        for line in [
            "aalis_requests_total{code=\"1xx\"} 0",
            "aalis_requests_total{code=\"2xx\"} 2",
            "aalis_requests_total{code=\"4xx\"} 1",
            "aalis_requests_total{code=\"5xx\"} 1",
            "aalis_requests_total{code=\"other\"} 1",
            "aalis_streams_total 3",
            "aalis_upstream_errors_total{kind=\"timeout\"} 1",
            "aalis_upstream_errors_total{kind=\"reset\"} 0",
            "aalis_added_latency_seconds_bucket{le=\"0.00001\"} 0",
            "aalis_added_latency_seconds_bucket{le=\"0.00005\"} 1",
            "aalis_added_latency_seconds_bucket{le=\"0.005\"} 2",
            "aalis_added_latency_seconds_bucket{le=\"+Inf\"} 2",
            "aalis_added_latency_seconds_count 2",
            "aalis_added_latency_seconds_sum 0.00202",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
        }
    }

    /// A scrape between an observation's bucket and its count (two
    /// atomics, written in that order) shows a total no lower than the
    /// buckets: the moment is made here by writing the bucket alone.
    #[test]
    fn a_histograms_total_is_never_below_its_buckets() {
        let metrics = Metrics::default();
        metrics.added_latency.observe(Duration::from_micros(20));
        metrics.added_latency.buckets[1].fetch_add(1, Ordering::Relaxed);
        let text = metrics.render();
        for line in [
            "aalis_added_latency_seconds_bucket{le=\"0.00005\"} 2",
            "aalis_added_latency_seconds_bucket{le=\"+Inf\"} 2",
            "aalis_added_latency_seconds_count 2",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
        }
    }
}
