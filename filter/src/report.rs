//! Sending per-request outcomes to the server, off the request path.
//!
//! Each measured response (see [`crate::accuracy`]) becomes one
//! [`RouteOutcome`]: the tenant and model of the lookup, the hinted replica
//! (or the replica that served an unhinted request), the reason code, the
//! predicted `matched_tokens` and the engine's `cached_tokens`. Request
//! contexts push it into the worker's [`OutcomeBuffer`] and move on; the
//! root context's timer tick ([`OutcomeReporter::on_tick`], every
//! `outcome_flush_ms`) sends up to `outcome_batch_max` of them in one
//! `ReportOutcomes` call.
//!
//! Fail-silent and bounded:
//! - the buffer holds at most `outcome_buffer_max` outcomes; past it new
//!   outcomes are dropped (counter `inferencecache_filter.outcomes.dropped`)
//!   and the count rides in the next report's `dropped` field;
//! - one report in flight per worker; its timeout is the flush interval;
//! - a refused or failed call loses its batch (counters
//!   `outcomes.report_failed` and `outcomes.lost`), nothing is retried and
//!   no request ever waits for it.
//!
//! Single-threaded like every proxy-wasm VM: the buffer is shared between
//! the root and request contexts of one worker through an `Rc<RefCell<_>>`.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;
use std::time::Duration;

use inference_cache_proto::v1alpha1::{OutcomeReport, RouteOutcome};
use prost::Message as _;

use crate::config::Settings;
use crate::flow::{DispatchError, LogLevel};

/// gRPC method of the outcome report.
pub const REPORT_METHOD: &str = "ReportOutcomes";
/// Counter: outcomes put into the buffer.
pub const OUTCOMES_BUFFERED_METRIC: &str = "inferencecache_filter.outcomes.buffered";
/// Counter: outcomes dropped because the buffer held `outcome_buffer_max`.
pub const OUTCOMES_DROPPED_METRIC: &str = "inferencecache_filter.outcomes.dropped";
/// Counter: outcomes in reports the server accepted.
pub const OUTCOMES_REPORTED_METRIC: &str = "inferencecache_filter.outcomes.reported";
/// Counter: outcomes in reports that failed (refused dispatch, non-zero gRPC status).
pub const OUTCOMES_LOST_METRIC: &str = "inferencecache_filter.outcomes.lost";
/// Counter: routed requests the pool served on another replica than the
/// hinted one (counted as unhinted, at the replica that served them).
pub const OUTCOMES_REROUTED_METRIC: &str = "inferencecache_filter.outcomes.rerouted";
/// Counter: `ReportOutcomes` calls that failed.
pub const REPORT_FAILED_METRIC: &str = "inferencecache_filter.outcomes.report_failed";

/// Every counter of this module.
pub fn report_counters() -> [&'static str; 6] {
    [
        OUTCOMES_BUFFERED_METRIC,
        OUTCOMES_REROUTED_METRIC,
        OUTCOMES_DROPPED_METRIC,
        OUTCOMES_REPORTED_METRIC,
        OUTCOMES_LOST_METRIC,
        REPORT_FAILED_METRIC,
    ]
}

/// The host operations the reporter needs (proxy-wasm in Envoy, a fake in tests).
pub trait ReportHost {
    /// Starts a unary gRPC call; returns its token.
    fn dispatch_grpc(
        &mut self,
        upstream: &str,
        service: &str,
        method: &str,
        message: &[u8],
        timeout: Duration,
    ) -> Result<u32, DispatchError>;
    /// Adds `amount` to a counter from [`crate::all_metrics`].
    fn add_counter(&mut self, name: &'static str, amount: u64);
    /// Writes a log line.
    fn log(&self, level: LogLevel, message: &str);
}

/// Outcomes waiting for the next report, bounded.
#[derive(Debug, Default)]
pub struct OutcomeBuffer {
    outcomes: VecDeque<RouteOutcome>,
    capacity: usize,
    /// Dropped since the last report that reached the server.
    dropped: u64,
}

/// A shared handle on a worker's buffer.
pub type SharedBuffer = Rc<RefCell<OutcomeBuffer>>;

impl OutcomeBuffer {
    /// An empty buffer holding at most `capacity` outcomes.
    pub fn new(capacity: usize) -> Self {
        Self {
            outcomes: VecDeque::new(),
            capacity,
            dropped: 0,
        }
    }

    /// Adds an outcome; `false` (and counted for the next report) when full.
    pub fn push(&mut self, outcome: RouteOutcome) -> bool {
        if self.outcomes.len() >= self.capacity {
            self.dropped += 1;
            return false;
        }
        self.outcomes.push_back(outcome);
        true
    }

    /// Outcomes waiting.
    pub fn len(&self) -> usize {
        self.outcomes.len()
    }

    /// True when nothing waits.
    pub fn is_empty(&self) -> bool {
        self.outcomes.is_empty()
    }

    /// The next report: up to `max` outcomes (oldest first) and the dropped count.
    fn take(&mut self, max: usize) -> OutcomeReport {
        let count = self.outcomes.len().min(max);
        OutcomeReport {
            outcomes: self.outcomes.drain(..count).collect(),
            dropped: std::mem::take(&mut self.dropped),
        }
    }
}

/// Sends a worker's buffered outcomes from the root context.
#[derive(Debug)]
pub struct OutcomeReporter {
    settings: Rc<Settings>,
    buffer: SharedBuffer,
    /// The call in flight: its token and how many outcomes it carries.
    in_flight: Option<(u32, u64)>,
}

impl OutcomeReporter {
    /// A reporter over `buffer`.
    pub fn new(settings: Rc<Settings>, buffer: SharedBuffer) -> Self {
        Self {
            settings,
            buffer,
            in_flight: None,
        }
    }

    /// The timer fired: send the next batch unless one is in flight or nothing waits.
    pub fn on_tick(&mut self, host: &mut dyn ReportHost) {
        if self.in_flight.is_some() {
            return;
        }
        let report = {
            let mut buffer = self.buffer.borrow_mut();
            if buffer.is_empty() && buffer.dropped == 0 {
                return;
            }
            buffer.take(self.settings.outcome_batch_max)
        };
        let count = report.outcomes.len() as u64;
        let timeout = self.settings.outcome_flush.max(Duration::from_millis(1));
        match host.dispatch_grpc(
            &self.settings.grpc_upstream,
            crate::flow::LOOKUP_SERVICE,
            REPORT_METHOD,
            &report.encode_to_vec(),
            timeout,
        ) {
            Ok(token) => self.in_flight = Some((token, count)),
            Err(DispatchError) => {
                self.buffer.borrow_mut().dropped += report.dropped;
                self.failed(host, count);
            }
        }
    }

    /// The report with `token` finished with gRPC `status` (0 = OK).
    pub fn on_response(&mut self, host: &mut dyn ReportHost, token: u32, status: u32) {
        let Some((expected, count)) = self.in_flight else {
            return;
        };
        if expected != token {
            return;
        }
        self.in_flight = None;
        if status == 0 {
            host.add_counter(OUTCOMES_REPORTED_METRIC, count);
        } else {
            host.log(
                LogLevel::Debug,
                &format!("ReportOutcomes ended with gRPC status {status}; {count} outcomes lost"),
            );
            self.failed(host, count);
        }
    }

    /// True while a report is in flight.
    pub fn in_flight(&self) -> bool {
        self.in_flight.is_some()
    }

    fn failed(&mut self, host: &mut dyn ReportHost, count: u64) {
        host.add_counter(REPORT_FAILED_METRIC, 1);
        host.add_counter(OUTCOMES_LOST_METRIC, count);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    #[derive(Default)]
    struct FakeReportHost {
        calls: Vec<(String, String, Vec<u8>, Duration)>,
        refuse: bool,
        counters: HashMap<&'static str, u64>,
    }

    impl ReportHost for FakeReportHost {
        fn dispatch_grpc(
            &mut self,
            upstream: &str,
            _service: &str,
            method: &str,
            message: &[u8],
            timeout: Duration,
        ) -> Result<u32, DispatchError> {
            if self.refuse {
                return Err(DispatchError);
            }
            self.calls
                .push((upstream.into(), method.into(), message.to_vec(), timeout));
            Ok(self.calls.len() as u32)
        }
        fn add_counter(&mut self, name: &'static str, amount: u64) {
            *self.counters.entry(name).or_default() += amount;
        }
        fn log(&self, _level: LogLevel, _message: &str) {}
    }

    fn outcome(replica: &str) -> RouteOutcome {
        RouteOutcome {
            tenant_id: "t".into(),
            replica_id: replica.into(),
            predicted_tokens: 64,
            cached_tokens: 64,
            routed: true,
            ..RouteOutcome::default()
        }
    }

    fn reporter(batch: usize, capacity: usize) -> (OutcomeReporter, SharedBuffer) {
        let mut settings = Settings::with_cluster("ic");
        settings.outcome_batch_max = batch;
        settings.outcome_flush = Duration::from_millis(500);
        let buffer = Rc::new(RefCell::new(OutcomeBuffer::new(capacity)));
        (
            OutcomeReporter::new(Rc::new(settings), Rc::clone(&buffer)),
            buffer,
        )
    }

    fn sent(host: &FakeReportHost, call: usize) -> OutcomeReport {
        OutcomeReport::decode(host.calls[call].2.as_slice()).expect("an OutcomeReport")
    }

    #[test]
    fn batches_are_bounded_and_one_is_in_flight_at_a_time() {
        let (mut reporter, buffer) = reporter(2, 10);
        let mut host = FakeReportHost::default();
        reporter.on_tick(&mut host);
        assert!(host.calls.is_empty(), "nothing to report");
        for replica in ["a", "b", "c"] {
            assert!(buffer.borrow_mut().push(outcome(replica)));
        }
        reporter.on_tick(&mut host);
        reporter.on_tick(&mut host);
        assert_eq!(host.calls.len(), 1, "one report in flight");
        let (upstream, method, _, timeout) = &host.calls[0];
        assert_eq!(
            (upstream.as_str(), method.as_str()),
            ("ic", "ReportOutcomes")
        );
        assert_eq!(*timeout, Duration::from_millis(500));
        let first = sent(&host, 0);
        let replicas: Vec<_> = first
            .outcomes
            .iter()
            .map(|o| o.replica_id.as_str())
            .collect();
        assert_eq!(replicas, ["a", "b"]);
        reporter.on_response(&mut host, 99, 0);
        assert!(reporter.in_flight(), "another token does not end the call");
        reporter.on_response(&mut host, 1, 0);
        assert_eq!(host.counters[OUTCOMES_REPORTED_METRIC], 2);
        reporter.on_tick(&mut host);
        assert_eq!(sent(&host, 1).outcomes.len(), 1);
        assert_eq!(buffer.borrow().len(), 0);
    }

    #[test]
    fn a_full_buffer_drops_and_reports_the_count() {
        let (mut reporter, buffer) = reporter(10, 2);
        let mut host = FakeReportHost::default();
        let pushed: Vec<bool> = ["a", "b", "c", "d"]
            .iter()
            .map(|replica| buffer.borrow_mut().push(outcome(replica)))
            .collect();
        assert_eq!(pushed, [true, true, false, false]);
        reporter.on_tick(&mut host);
        let report = sent(&host, 0);
        assert_eq!((report.outcomes.len(), report.dropped), (2, 2));
        // A failed call loses its batch; the next report starts from zero drops.
        reporter.on_response(&mut host, 1, 14);
        assert_eq!(host.counters[REPORT_FAILED_METRIC], 1);
        assert_eq!(host.counters[OUTCOMES_LOST_METRIC], 2);
        assert!(!reporter.in_flight());
        reporter.on_tick(&mut host);
        assert_eq!(host.calls.len(), 1, "nothing left to send");
    }

    #[test]
    fn a_refused_dispatch_keeps_the_drop_count_for_later() {
        let (mut reporter, buffer) = reporter(10, 1);
        let mut host = FakeReportHost {
            refuse: true,
            ..FakeReportHost::default()
        };
        buffer.borrow_mut().push(outcome("a"));
        buffer.borrow_mut().push(outcome("b"));
        reporter.on_tick(&mut host);
        assert_eq!(host.counters[OUTCOMES_LOST_METRIC], 1);
        assert!(!reporter.in_flight());
        host.refuse = false;
        reporter.on_tick(&mut host);
        let report = sent(&host, 0);
        assert_eq!((report.outcomes.len(), report.dropped), (0, 1));
    }
}
