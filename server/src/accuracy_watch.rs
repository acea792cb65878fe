//! Watching hint accuracy: flags replicas whose hints are systematically wrong.
//!
//! The [`crate::outcomes::OutcomeBook`] hands every *routed* outcome with a
//! prediction (the gateway sent the request to the hinted replica, which was
//! promised `predicted > 0` tokens) to the [`AccuracyWatch`], keyed by
//! `(tenant, model, replica)`. The watch keeps, per key, a sliding window of
//! `--accuracy-window` made of one bucket per `--accuracy-check-interval`,
//! and every check interval it judges each window:
//!
//! - fewer than `--accuracy-min-samples` routed hints: no verdict, the state
//!   stays as it was (a cold start or a quiet replica never alarms);
//! - at least `--accuracy-miss-percent` of them found nothing cached
//!   (`hinted_miss`): alert [`AlertKind::HintedMiss`] — the index is stale
//!   (the engine evicted or never held the blocks) or the configuration
//!   differs (block size, chat template, cache salt, hash seed, LoRA identity);
//! - otherwise, when more than half of them reused less than
//!   `--accuracy-partial-percent` of the predicted tokens (the window's
//!   median `actual / predicted` is below that fraction): alert
//!   [`AlertKind::PartialReuse`] — a partial mismatch;
//! - otherwise the key is healthy and an alert it had clears.
//!
//! A key whose window holds no routed hint at all is forgotten (and its
//! alert cleared). Independently, a failing canary ([`crate::canary`]) is
//! the server-wide alert [`AlertKind::Canary`]: the server's own tokenizer,
//! template or fingerprint disagrees with itself.
//!
//! Shadow outcomes are not watched: their `actual` comes from the replica
//! Envoy picked, not from the hinted one, so misses there are expected.
//! Outcomes folded into the `_other` series (past `--outcome-max-series`)
//! are not watched either, so the watch holds at most that many keys.
//!
//! An alert is a WARN log line when it is raised or changes kind and an INFO
//! line when it clears (never one per request or per check), the gauges
//! `inferencecache_accuracy_alert{tenant,model,replica,kind}` (1 while
//! raised; bounded by the watched keys) and
//! `inferencecache_accuracy_alerts{kind}` (how many are raised), the counter
//! `inferencecache_accuracy_alerts_raised_total{kind}`, an `alerts` entry in
//! `/snapshot/accuracy` and an `accuracy:` line on `/readyz`, which stays
//! 200: a misconfiguration must not take routing down, hints fail open.
//!
//! Cost: one mutex, taken once per `ReportOutcomes` call and once per check;
//! 48 bytes per bucket, at most [`MAX_WINDOW_BUCKETS`] buckets per key.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::builder::TypedValueParser as _;
use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;
use crate::outcomes::{
    DEFAULT_MAX_BATCH, DEFAULT_MAX_ID_BYTES, DEFAULT_MAX_SERIES, OutcomeSettings,
};

/// Default `--accuracy-check-interval`.
pub const DEFAULT_CHECK_INTERVAL: &str = "10s";
/// Default `--accuracy-window`.
pub const DEFAULT_WINDOW: &str = "1m";
/// Default `--accuracy-min-samples`.
pub const DEFAULT_MIN_SAMPLES: u64 = 20;
/// Default `--accuracy-miss-percent`.
pub const DEFAULT_MISS_PERCENT: u32 = 50;
/// Default `--accuracy-partial-percent`.
pub const DEFAULT_PARTIAL_PERCENT: u32 = 50;
/// Default `--canary-interval`.
pub const DEFAULT_CANARY_INTERVAL: &str = "1m";
/// Most check intervals one window may span (`--accuracy-window` /
/// `--accuracy-check-interval`, rounded up): bounds the memory of a key.
pub const MAX_WINDOW_BUCKETS: usize = 60;
/// Most alerts `/readyz` lists one by one; the rest are counted.
const READYZ_ALERTS: usize = 16;

/// How the watch judges outcome windows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchSettings {
    /// Time between two checks; also the width of one window bucket.
    pub check_interval: Duration,
    /// Span of the sliding window a check judges.
    pub window: Duration,
    /// Routed hints a window needs before it is judged at all.
    pub min_samples: u64,
    /// Percentage of `hinted_miss` in a window that raises [`AlertKind::HintedMiss`].
    pub miss_percent: u32,
    /// Reuse below this percentage of the prediction counts as partial; a
    /// window where most outcomes are partial raises [`AlertKind::PartialReuse`].
    pub partial_percent: u32,
    /// Time between two canary runs ([`crate::canary`]); the first runs at start.
    pub canary_interval: Duration,
}

fn duration(text: &str) -> Duration {
    crate::limits::parse_duration(text).unwrap_or_default()
}

impl Default for WatchSettings {
    fn default() -> Self {
        Self {
            check_interval: duration(DEFAULT_CHECK_INTERVAL),
            window: duration(DEFAULT_WINDOW),
            min_samples: DEFAULT_MIN_SAMPLES,
            miss_percent: DEFAULT_MISS_PERCENT,
            partial_percent: DEFAULT_PARTIAL_PERCENT,
            canary_interval: duration(DEFAULT_CANARY_INTERVAL),
        }
    }
}

impl WatchSettings {
    /// Buckets of one window: the window over the check interval, rounded up.
    pub fn buckets(&self) -> usize {
        let interval = self.check_interval.as_nanos().max(1);
        let buckets = self.window.as_nanos().div_ceil(interval);
        usize::try_from(buckets)
            .unwrap_or(MAX_WINDOW_BUCKETS)
            .clamp(1, MAX_WINDOW_BUCKETS)
    }

    /// Refuses settings the watch cannot work with, naming the flag.
    pub fn validate(&self) -> Result<(), String> {
        if self.check_interval.is_zero() {
            return Err("--accuracy-check-interval must be above 0".into());
        }
        if self.canary_interval.is_zero() {
            return Err("--canary-interval must be above 0".into());
        }
        if self.window < self.check_interval {
            return Err(format!(
                "--accuracy-window ({:?}) must be at least --accuracy-check-interval ({:?})",
                self.window, self.check_interval
            ));
        }
        let buckets = self
            .window
            .as_nanos()
            .div_ceil(self.check_interval.as_nanos());
        if buckets > MAX_WINDOW_BUCKETS as u128 {
            return Err(format!(
                "--accuracy-window ({:?}) spans {buckets} check intervals of {:?}; at most {MAX_WINDOW_BUCKETS} are kept (widen the interval or narrow the window)",
                self.window, self.check_interval
            ));
        }
        if self.min_samples == 0 {
            return Err("--accuracy-min-samples must be at least 1".into());
        }
        if !(1..=100).contains(&self.miss_percent) || !(1..=100).contains(&self.partial_percent) {
            return Err(
                "--accuracy-miss-percent and --accuracy-partial-percent must be in 1..=100".into(),
            );
        }
        Ok(())
    }
}

/// Flags of the outcome aggregation and the accuracy watch, flattened into `inference-cache serve`.
#[derive(Debug, Clone, clap::Args)]
pub struct AccuracyArgs {
    /// Most (tenant, model, replica, mode) outcome series kept; outcomes of further series fold into one `_other` series (limit_hits{limit="outcome_series"}) and are not watched.
    #[arg(long, default_value_t = DEFAULT_MAX_SERIES, value_parser = clap::value_parser!(u32).range(1..).map(|v| v as usize), env = "INFERENCE_CACHE_OUTCOME_MAX_SERIES")]
    pub outcome_max_series: usize,

    /// Longest tenant, model or replica id in an outcome (bytes); longer ones are refused (limit_hits{limit="outcome_id_bytes"}).
    #[arg(long, default_value_t = DEFAULT_MAX_ID_BYTES, value_parser = clap::value_parser!(u32).range(1..).map(|v| v as usize), env = "INFERENCE_CACHE_OUTCOME_MAX_ID_BYTES")]
    pub outcome_max_id_bytes: usize,

    /// Most outcomes counted from one ReportOutcomes call; the rest are dropped (limit_hits{limit="outcome_batch"}).
    #[arg(long, default_value_t = DEFAULT_MAX_BATCH, value_parser = clap::value_parser!(u32).range(1..).map(|v| v as usize), env = "INFERENCE_CACHE_OUTCOME_MAX_BATCH")]
    pub outcome_max_batch: usize,

    /// How often the accuracy watch judges each replica's outcome window (also one window bucket).
    #[arg(long, default_value = DEFAULT_CHECK_INTERVAL, value_parser = crate::limits::parse_duration, env = "INFERENCE_CACHE_ACCURACY_CHECK_INTERVAL")]
    pub accuracy_check_interval: Duration,

    /// Sliding window of routed outcomes the watch judges (at most 60 check intervals).
    #[arg(long, default_value = DEFAULT_WINDOW, value_parser = crate::limits::parse_duration, env = "INFERENCE_CACHE_ACCURACY_WINDOW")]
    pub accuracy_window: Duration,

    /// Routed hints a replica's window needs before it is judged (a cold start never alarms).
    #[arg(long, default_value_t = DEFAULT_MIN_SAMPLES, value_parser = clap::value_parser!(u64).range(1..), env = "INFERENCE_CACHE_ACCURACY_MIN_SAMPLES")]
    pub accuracy_min_samples: u64,

    /// Percentage of routed hints that found nothing cached (hinted_miss) that flags a replica: index stale or configuration mismatch.
    #[arg(long, default_value_t = DEFAULT_MISS_PERCENT, value_parser = clap::value_parser!(u32).range(1..=100), env = "INFERENCE_CACHE_ACCURACY_MISS_PERCENT")]
    pub accuracy_miss_percent: u32,

    /// A replica whose median reuse is below this percentage of the prediction is flagged: partial mismatch.
    #[arg(long, default_value_t = DEFAULT_PARTIAL_PERCENT, value_parser = clap::value_parser!(u32).range(1..=100), env = "INFERENCE_CACHE_ACCURACY_PARTIAL_PERCENT")]
    pub accuracy_partial_percent: u32,

    /// How often the canary checks the server's tokenizer, fingerprint and index (first run at start).
    #[arg(long, default_value = DEFAULT_CANARY_INTERVAL, value_parser = crate::limits::parse_duration, env = "INFERENCE_CACHE_CANARY_INTERVAL")]
    pub canary_interval: Duration,
}

impl AccuracyArgs {
    /// Resolves the flags (checked by [`WatchSettings::validate`] at start).
    pub fn into_settings(self) -> OutcomeSettings {
        OutcomeSettings {
            max_series: self.outcome_max_series,
            max_id_bytes: self.outcome_max_id_bytes,
            max_batch: self.outcome_max_batch,
            watch: WatchSettings {
                check_interval: self.accuracy_check_interval,
                window: self.accuracy_window,
                min_samples: self.accuracy_min_samples,
                miss_percent: self.accuracy_miss_percent,
                partial_percent: self.accuracy_partial_percent,
                canary_interval: self.canary_interval,
            },
        }
    }
}

/// What an alert says is wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum AlertKind {
    /// Most routed hints to the replica found nothing cached.
    HintedMiss,
    /// The replica reuses far less than predicted.
    PartialReuse,
    /// The server's own canary disagrees.
    Canary,
}

/// Every kind, for metric pre-registration.
pub const ALERT_KINDS: [AlertKind; 3] = [
    AlertKind::HintedMiss,
    AlertKind::PartialReuse,
    AlertKind::Canary,
];

impl AlertKind {
    /// Label value.
    pub fn as_str(self) -> &'static str {
        match self {
            AlertKind::HintedMiss => "hinted_miss",
            AlertKind::PartialReuse => "partial_reuse",
            AlertKind::Canary => "canary",
        }
    }
}

/// Sums over the routed hints of a bucket or a window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct WindowFigures {
    /// Routed outcomes with a prediction.
    pub hinted: u64,
    /// Those whose engine reported nothing cached.
    pub hinted_miss: u64,
    /// Those that reused less than `partial_percent` of the prediction (misses included).
    pub below_partial: u64,
    /// Sum of the predictions.
    pub predicted_tokens: u64,
    /// Sum of the engines' cached tokens.
    pub cached_tokens: u64,
}

impl WindowFigures {
    fn add(&mut self, predicted: u64, cached: u64, partial_percent: u32) {
        self.hinted += 1;
        if cached == 0 {
            self.hinted_miss += 1;
        }
        if u128::from(cached) * 100 < u128::from(predicted) * u128::from(partial_percent) {
            self.below_partial += 1;
        }
        self.predicted_tokens = self.predicted_tokens.saturating_add(predicted);
        self.cached_tokens = self.cached_tokens.saturating_add(cached);
    }

    fn merge(&mut self, other: &WindowFigures) {
        self.hinted += other.hinted;
        self.hinted_miss += other.hinted_miss;
        self.below_partial += other.below_partial;
        self.predicted_tokens = self.predicted_tokens.saturating_add(other.predicted_tokens);
        self.cached_tokens = self.cached_tokens.saturating_add(other.cached_tokens);
    }
}

/// What a check concluded about one window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Fewer routed hints than `min_samples`: no conclusion.
    TooFewSamples,
    /// Hints and reuse agree well enough.
    Healthy,
    /// Systematically wrong hints.
    Alert(AlertKind),
}

impl Verdict {
    /// What `/snapshot/accuracy` shows as a watched key's status.
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::TooFewSamples => "too_few_samples",
            Verdict::Healthy => "ok",
            Verdict::Alert(kind) => kind.as_str(),
        }
    }

    /// Judges `figures` under `settings`.
    pub fn of(figures: &WindowFigures, settings: &WatchSettings) -> Self {
        if figures.hinted < settings.min_samples.max(1) {
            return Verdict::TooFewSamples;
        }
        let hinted = u128::from(figures.hinted);
        if u128::from(figures.hinted_miss) * 100 >= hinted * u128::from(settings.miss_percent) {
            return Verdict::Alert(AlertKind::HintedMiss);
        }
        if u128::from(figures.below_partial) * 2 > hinted {
            return Verdict::Alert(AlertKind::PartialReuse);
        }
        Verdict::Healthy
    }
}

/// The replica an alert is about.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WatchKey {
    /// Tenant id.
    pub tenant: String,
    /// Model id.
    pub model: String,
    /// Replica id.
    pub replica: String,
}

#[derive(Debug, Clone, Copy, Default)]
struct Bucket {
    epoch: u64,
    figures: WindowFigures,
}

#[derive(Debug, Clone)]
struct Raised {
    kind: AlertKind,
    since_unix_ms: u64,
    message: String,
}

struct Watched {
    buckets: Box<[Bucket]>,
    /// What the last check saw and concluded (`None` before the first check).
    last: Option<(Verdict, WindowFigures)>,
    alert: Option<Raised>,
}

impl Watched {
    fn new(buckets: usize) -> Self {
        Self {
            buckets: vec![Bucket::default(); buckets].into_boxed_slice(),
            last: None,
            alert: None,
        }
    }

    /// The sum of the buckets of the window ending with bucket `epoch`.
    fn window(&self, epoch: u64) -> WindowFigures {
        let span = self.buckets.len() as u64;
        let mut sum = WindowFigures::default();
        for bucket in self.buckets.iter() {
            if bucket.epoch <= epoch && bucket.epoch + span > epoch {
                sum.merge(&bucket.figures);
            }
        }
        sum
    }
}

struct State {
    /// Number of the current bucket (checks so far).
    epoch: u64,
    series: HashMap<WatchKey, Watched>,
    canary: Option<Raised>,
}

/// An alert as `/snapshot/accuracy` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct AlertRow {
    /// `hinted_miss`, `partial_reuse` or `canary`.
    pub kind: &'static str,
    /// Tenant id (empty for the canary).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub tenant_id: String,
    /// Model id (empty for the canary).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub model_id: String,
    /// Replica id (empty for the canary).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub replica_id: String,
    /// When the alert was raised (or changed kind), Unix milliseconds.
    pub since_unix_ms: u64,
    /// What is wrong and what to check.
    pub message: String,
}

/// A watched key as `/snapshot/accuracy` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct WatchedRow {
    /// Tenant id.
    pub tenant_id: String,
    /// Model id.
    pub model_id: String,
    /// Replica id.
    pub replica_id: String,
    /// The last check's verdict: `pending` (not checked yet),
    /// `too_few_samples`, `ok`, `hinted_miss` or `partial_reuse`.
    pub status: &'static str,
    /// The window the last check judged.
    pub window: WindowFigures,
}

/// The watch's part of `/snapshot/accuracy`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct WatchReport {
    /// `--accuracy-check-interval` in milliseconds.
    pub check_interval_ms: u64,
    /// `--accuracy-window` in milliseconds.
    pub window_ms: u64,
    /// `--accuracy-min-samples`.
    pub min_samples: u64,
    /// `--accuracy-miss-percent`.
    pub miss_percent: u32,
    /// `--accuracy-partial-percent`.
    pub partial_percent: u32,
    /// Checks run so far.
    pub checks: u64,
    /// Raised alerts, the canary's first, then by tenant, model, replica.
    pub alerts: Vec<AlertRow>,
    /// Every watched key.
    pub watched: Vec<WatchedRow>,
}

/// Labels of one replica's alert gauge.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AlertLabel {
    /// Tenant id.
    pub tenant: String,
    /// Model id.
    pub model: String,
    /// Replica id.
    pub replica: String,
    /// [`AlertKind::as_str`].
    pub kind: &'static str,
}

/// Label of the per-kind families.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    /// [`AlertKind::as_str`].
    pub kind: &'static str,
}

/// A change of one key's (or the canary's) alert, found by a check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transition {
    /// The replica, or `None` for the canary.
    pub key: Option<WatchKey>,
    /// The alert before the check.
    pub from: Option<AlertKind>,
    /// The alert after it.
    pub to: Option<AlertKind>,
}

/// Sliding windows of routed outcomes per replica, judged every check interval.
pub struct AccuracyWatch {
    settings: WatchSettings,
    buckets: usize,
    state: Mutex<State>,
    alert: Family<AlertLabel, Gauge>,
    alerts: Family<KindLabel, Gauge>,
    raised: Family<KindLabel, Counter>,
    checks: Counter,
    watched: Gauge,
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| {
            u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX)
        })
}

fn describe(kind: AlertKind, figures: &WindowFigures, settings: &WatchSettings) -> String {
    match kind {
        AlertKind::HintedMiss => format!(
            "{} of {} routed hints in the last {:?} found nothing cached (predicted {} tokens, engine reused {}): the index is stale (the engine evicted or never held these blocks: events lost, subscriber down or lagging) or the configuration differs (--engine-block-size vs the engine's block size, chat template, cache salt, hash seed, LoRA identity)",
            figures.hinted_miss,
            figures.hinted,
            settings.window,
            figures.predicted_tokens,
            figures.cached_tokens,
        ),
        AlertKind::PartialReuse => format!(
            "{} of {} routed hints in the last {:?} reused less than {} % of the predicted tokens (predicted {} tokens, engine reused {}): partial mismatch (the prompts diverge from what the index fingerprinted after a shared head: template or tokenizer difference; or blocks are evicted before the index hears of it)",
            figures.below_partial,
            figures.hinted,
            settings.window,
            settings.partial_percent,
            figures.predicted_tokens,
            figures.cached_tokens,
        ),
        AlertKind::Canary => String::new(),
    }
}

impl AccuracyWatch {
    /// An empty watch whose families are registered in `registry`.
    pub fn new(settings: WatchSettings, registry: &mut Registry) -> Self {
        let alert = Family::<AlertLabel, Gauge>::default();
        registry.register(
            "accuracy_alert",
            "1 while the accuracy watch flags the replica's hints as systematically wrong, by tenant, model, replica and kind (hinted_miss: index stale or configuration mismatch; partial_reuse: partial mismatch)",
            alert.clone(),
        );
        let alerts = Family::<KindLabel, Gauge>::default();
        registry.register(
            "accuracy_alerts",
            "Accuracy alerts raised now, by kind (hinted_miss, partial_reuse: replicas flagged; canary: 1 while the server's canary disagrees)",
            alerts.clone(),
        );
        let raised = Family::<KindLabel, Counter>::default();
        registry.register(
            "accuracy_alerts_raised",
            "Accuracy alerts raised (or changed to this kind), by kind; one per transition, not per check",
            raised.clone(),
        );
        for kind in ALERT_KINDS {
            let label = KindLabel {
                kind: kind.as_str(),
            };
            let _ = alerts.get_or_create(&label);
            let _ = raised.get_or_create(&label);
        }
        let checks = Counter::default();
        registry.register(
            "accuracy_checks",
            "Checks of the accuracy watch (one per --accuracy-check-interval)",
            checks.clone(),
        );
        let watched = Gauge::default();
        registry.register(
            "accuracy_watched_series",
            "(tenant, model, replica) keys with routed outcomes in the accuracy watch's window",
            watched.clone(),
        );
        Self {
            buckets: settings.buckets(),
            settings,
            state: Mutex::new(State {
                epoch: 0,
                series: HashMap::new(),
                canary: None,
            }),
            alert,
            alerts,
            raised,
            checks,
            watched,
        }
    }

    /// The settings in force.
    pub fn settings(&self) -> &WatchSettings {
        &self.settings
    }

    /// Adds routed outcomes with a prediction: `(key, predicted, cached)`.
    pub fn observe(&self, outcomes: Vec<(WatchKey, u64, u64)>) {
        if outcomes.is_empty() {
            return;
        }
        let mut state = self.state.lock();
        let epoch = state.epoch;
        let slot = usize::try_from(epoch % self.buckets as u64).unwrap_or(0);
        for (key, predicted, cached) in outcomes {
            let buckets = self.buckets;
            let watched = state
                .series
                .entry(key)
                .or_insert_with(|| Watched::new(buckets));
            let bucket = &mut watched.buckets[slot];
            if bucket.epoch != epoch {
                *bucket = Bucket {
                    epoch,
                    figures: WindowFigures::default(),
                };
            }
            bucket
                .figures
                .add(predicted, cached, self.settings.partial_percent);
        }
        self.watched
            .set(i64::try_from(state.series.len()).unwrap_or(i64::MAX));
    }

    /// Judges every window (and the canary's last result, `canary_failure`),
    /// logs and exports what changed, and starts the next bucket.
    pub fn check(&self, canary_failure: Option<&str>) -> Vec<Transition> {
        let mut state = self.state.lock();
        self.checks.inc();
        let epoch = state.epoch;
        let mut transitions = Vec::new();
        let settings = &self.settings;
        state.series.retain(|key, watched| {
            let figures = watched.window(epoch);
            if figures.hinted == 0 {
                // Nothing routed to it for a whole window: forget it.
                if let Some(raised) = watched.alert.take() {
                    transitions.push(Transition {
                        key: Some(key.clone()),
                        from: Some(raised.kind),
                        to: None,
                    });
                }
                return false;
            }
            let verdict = Verdict::of(&figures, settings);
            watched.last = Some((verdict, figures));
            let from = watched.alert.as_ref().map(|raised| raised.kind);
            let to = match verdict {
                Verdict::TooFewSamples => from,
                Verdict::Healthy => None,
                Verdict::Alert(kind) => Some(kind),
            };
            match to {
                Some(kind) if from == Some(kind) => {
                    // Still raised: keep the text current.
                    if let Some(raised) = watched.alert.as_mut() {
                        raised.message = describe(kind, &figures, settings);
                    }
                }
                Some(kind) => {
                    watched.alert = Some(Raised {
                        kind,
                        since_unix_ms: unix_ms(),
                        message: describe(kind, &figures, settings),
                    });
                }
                None => watched.alert = None,
            }
            if from != to {
                transitions.push(Transition {
                    key: Some(key.clone()),
                    from,
                    to,
                });
            }
            true
        });
        let canary_was = state.canary.is_some();
        match canary_failure {
            Some(failure) => {
                let message = format!(
                    "the server's canary disagrees ({failure}): its tokenizer, chat template or fingerprint does not reproduce its own chains, so hints for server-tokenized prompts miss (template or tokenizer mismatch)"
                );
                match state.canary.as_mut() {
                    Some(raised) => raised.message = message,
                    None => {
                        state.canary = Some(Raised {
                            kind: AlertKind::Canary,
                            since_unix_ms: unix_ms(),
                            message,
                        });
                    }
                }
            }
            None => state.canary = None,
        }
        if canary_was != state.canary.is_some() {
            transitions.push(Transition {
                key: None,
                from: canary_was.then_some(AlertKind::Canary),
                to: state.canary.as_ref().map(|_| AlertKind::Canary),
            });
        }
        for transition in &transitions {
            self.export(&state, transition);
        }
        self.watched
            .set(i64::try_from(state.series.len()).unwrap_or(i64::MAX));
        state.epoch += 1;
        transitions
    }

    /// Logs one transition and updates the gauges.
    fn export(&self, state: &State, transition: &Transition) {
        if let Some(from) = transition.from {
            self.alerts
                .get_or_create(&KindLabel {
                    kind: from.as_str(),
                })
                .dec();
            if let Some(key) = &transition.key {
                self.alert.remove(&alert_label(key, from));
            }
        }
        let message = match &transition.key {
            Some(key) => state
                .series
                .get(key)
                .and_then(|watched| watched.alert.as_ref())
                .map(|raised| raised.message.clone()),
            None => state.canary.as_ref().map(|raised| raised.message.clone()),
        };
        let (tenant, model, replica) = transition.key.as_ref().map_or(("", "", ""), |key| {
            (
                key.tenant.as_str(),
                key.model.as_str(),
                key.replica.as_str(),
            )
        });
        match transition.to {
            Some(to) => {
                let label = KindLabel { kind: to.as_str() };
                self.alerts.get_or_create(&label).inc();
                self.raised.get_or_create(&label).inc();
                if let Some(key) = &transition.key {
                    self.alert.get_or_create(&alert_label(key, to)).set(1);
                }
                tracing::warn!(
                    kind = to.as_str(),
                    was = transition.from.map_or("none", AlertKind::as_str),
                    tenant,
                    model,
                    replica,
                    detail = message.as_deref().unwrap_or(""),
                    "ACCURACY ALERT: hints are systematically wrong; routing continues (hints fail open) but saves nothing until this is fixed"
                );
            }
            None => {
                let why = match &transition.key {
                    Some(key) if !state.series.contains_key(key) => {
                        "no routed outcomes for a whole window"
                    }
                    Some(_) => "hints and reuse agree again",
                    None => "the canary agrees again",
                };
                tracing::info!(
                    kind = transition.from.map_or("none", AlertKind::as_str),
                    tenant,
                    model,
                    replica,
                    why,
                    "accuracy alert cleared"
                );
            }
        }
    }

    /// The watch's part of `/snapshot/accuracy`.
    pub fn report(&self) -> WatchReport {
        let state = self.state.lock();
        let mut alerts: Vec<AlertRow> = state
            .canary
            .iter()
            .map(|raised| AlertRow {
                kind: raised.kind.as_str(),
                tenant_id: String::new(),
                model_id: String::new(),
                replica_id: String::new(),
                since_unix_ms: raised.since_unix_ms,
                message: raised.message.clone(),
            })
            .collect();
        let mut keys: Vec<&WatchKey> = state.series.keys().collect();
        keys.sort();
        let mut watched = Vec::with_capacity(keys.len());
        for key in keys {
            let Some(series) = state.series.get(key) else {
                continue;
            };
            if let Some(raised) = &series.alert {
                alerts.push(AlertRow {
                    kind: raised.kind.as_str(),
                    tenant_id: key.tenant.clone(),
                    model_id: key.model.clone(),
                    replica_id: key.replica.clone(),
                    since_unix_ms: raised.since_unix_ms,
                    message: raised.message.clone(),
                });
            }
            let (status, window) = series.last.map_or(
                ("pending", WindowFigures::default()),
                |(verdict, figures)| (verdict.as_str(), figures),
            );
            watched.push(WatchedRow {
                tenant_id: key.tenant.clone(),
                model_id: key.model.clone(),
                replica_id: key.replica.clone(),
                status,
                window,
            });
        }
        WatchReport {
            check_interval_ms: u64::try_from(self.settings.check_interval.as_millis())
                .unwrap_or(u64::MAX),
            window_ms: u64::try_from(self.settings.window.as_millis()).unwrap_or(u64::MAX),
            min_samples: self.settings.min_samples,
            miss_percent: self.settings.miss_percent,
            partial_percent: self.settings.partial_percent,
            checks: self.checks.get(),
            alerts,
            watched,
        }
    }

    /// The `accuracy:` lines of `/readyz`, one per raised alert (at most
    /// [`READYZ_ALERTS`], then a count); empty when none is raised.
    pub fn readiness_detail(&self) -> String {
        let alerts = self.report().alerts;
        let mut text = String::new();
        for alert in alerts.iter().take(READYZ_ALERTS) {
            let scope = if alert.replica_id.is_empty() {
                String::new()
            } else {
                format!(
                    " tenant={} model={} replica={}",
                    alert.tenant_id, alert.model_id, alert.replica_id
                )
            };
            let _ = writeln!(text, "accuracy: {}{scope}: {}", alert.kind, alert.message);
        }
        if alerts.len() > READYZ_ALERTS {
            let _ = writeln!(
                text,
                "accuracy: {} more alerts in /snapshot/accuracy",
                alerts.len() - READYZ_ALERTS
            );
        }
        text
    }
}

fn alert_label(key: &WatchKey, kind: AlertKind) -> AlertLabel {
    AlertLabel {
        tenant: key.tenant.clone(),
        model: key.model.clone(),
        replica: key.replica.clone(),
        kind: kind.as_str(),
    }
}

/// Runs a check every `--accuracy-check-interval` until `shutdown`.
pub fn spawn(metrics: Arc<Metrics>, shutdown: CancellationToken) {
    let interval = metrics.outcomes.watch().settings().check_interval;
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The first tick is immediate: the first check comes one interval after start.
        ticks.tick().await;
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = ticks.tick() => {}
            }
            let canary = metrics.canary_failure();
            metrics.outcomes.watch().check(canary.as_deref());
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(replica: &str) -> WatchKey {
        WatchKey {
            tenant: "t".into(),
            model: "m".into(),
            replica: replica.into(),
        }
    }

    fn settings(buckets: u32) -> WatchSettings {
        WatchSettings {
            check_interval: Duration::from_secs(1),
            window: Duration::from_secs(u64::from(buckets)),
            min_samples: 10,
            ..WatchSettings::default()
        }
    }

    fn watch(buckets: u32) -> (AccuracyWatch, Registry) {
        let mut registry = Registry::with_prefix("inferencecache");
        (
            AccuracyWatch::new(settings(buckets), &mut registry),
            registry,
        )
    }

    fn outcomes(replica: &str, n: usize, predicted: u64, cached: u64) -> Vec<(WatchKey, u64, u64)> {
        vec![(key(replica), predicted, cached); n]
    }

    fn render(registry: &Registry) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, registry).expect("encodes");
        text
    }

    #[test]
    fn verdicts_follow_the_thresholds() {
        let settings = settings(6);
        let figures = |hinted, miss, below| WindowFigures {
            hinted,
            hinted_miss: miss,
            below_partial: below,
            ..WindowFigures::default()
        };
        assert_eq!(
            Verdict::of(&figures(9, 9, 9), &settings),
            Verdict::TooFewSamples
        );
        assert_eq!(
            Verdict::of(&figures(10, 5, 5), &settings),
            Verdict::Alert(AlertKind::HintedMiss)
        );
        assert_eq!(
            Verdict::of(&figures(10, 4, 6), &settings),
            Verdict::Alert(AlertKind::PartialReuse)
        );
        assert_eq!(Verdict::of(&figures(10, 4, 5), &settings), Verdict::Healthy);
        let mut added = WindowFigures::default();
        added.add(100, 0, 50);
        added.add(100, 49, 50);
        added.add(100, 50, 50);
        assert_eq!(
            (added.hinted, added.hinted_miss, added.below_partial),
            (3, 1, 2)
        );
    }

    #[test]
    fn a_raised_alert_is_one_transition_and_clears_when_reuse_recovers() {
        let (watch, registry) = watch(3);
        watch.observe(outcomes("bad", 12, 128, 0));
        watch.observe(outcomes("good", 12, 128, 120));
        let transitions = watch.check(None);
        assert_eq!(
            transitions,
            [Transition {
                key: Some(key("bad")),
                from: None,
                to: Some(AlertKind::HintedMiss)
            }]
        );
        let text = render(&registry);
        assert!(
            text.contains("inferencecache_accuracy_alert{tenant=\"t\",model=\"m\",replica=\"bad\",kind=\"hinted_miss\"} 1"),
            "{text}"
        );
        assert!(!text.contains("replica=\"good\""), "{text}");
        assert!(
            text.contains("inferencecache_accuracy_alerts{kind=\"hinted_miss\"} 1"),
            "{text}"
        );
        // Still wrong: no new transition, no second raise.
        watch.observe(outcomes("bad", 12, 128, 0));
        assert!(watch.check(None).is_empty());
        let text = render(&registry);
        assert!(
            text.contains("inferencecache_accuracy_alerts_raised_total{kind=\"hinted_miss\"} 1"),
            "{text}"
        );
        // Enough hits push the misses below half of the window: cleared.
        watch.observe(outcomes("bad", 30, 128, 128));
        let transitions = watch.check(None);
        assert_eq!(transitions.len(), 1);
        assert_eq!(transitions[0].to, None);
        let text = render(&registry);
        assert!(
            text.contains("inferencecache_accuracy_alerts{kind=\"hinted_miss\"} 0"),
            "{text}"
        );
        assert!(!text.contains("inferencecache_accuracy_alert{"), "{text}");
        let report = watch.report();
        assert!(report.alerts.is_empty(), "{report:?}");
        assert_eq!(report.checks, 3);
        assert!(
            report.watched.iter().all(|row| row.status == "ok"),
            "{report:?}"
        );
    }

    #[test]
    fn windows_slide_and_idle_keys_are_forgotten() {
        let (watch, _) = watch(2);
        watch.observe(outcomes("r", 10, 100, 0));
        assert_eq!(watch.check(None).len(), 1);
        // The misses are still in the two-bucket window: no change, even
        // with too few new samples to judge on their own.
        watch.observe(outcomes("r", 2, 100, 100));
        assert!(watch.check(None).is_empty());
        // Now the misses left the window; two hits are too few to judge, so
        // the alert stays (no evidence either way).
        watch.observe(outcomes("r", 2, 100, 100));
        assert!(watch.check(None).is_empty());
        assert_eq!(watch.report().watched[0].status, "too_few_samples");
        assert_eq!(watch.report().alerts.len(), 1);
        // A whole window without routed outcomes: forgotten, alert cleared.
        assert!(watch.check(None).is_empty());
        let transitions = watch.check(None);
        assert_eq!(transitions.len(), 1);
        assert_eq!(transitions[0].from, Some(AlertKind::HintedMiss));
        assert!(watch.report().watched.is_empty());
    }

    #[test]
    fn partial_reuse_and_kind_changes() {
        let (watch, registry) = watch(1);
        watch.observe(outcomes("r", 10, 100, 30));
        let transitions = watch.check(None);
        assert_eq!(transitions[0].to, Some(AlertKind::PartialReuse));
        let alert = &watch.report().alerts[0];
        assert!(alert.message.contains("10 of 10 routed hints"), "{alert:?}");
        watch.observe(outcomes("r", 10, 100, 0));
        let transitions = watch.check(None);
        assert_eq!(
            (transitions[0].from, transitions[0].to),
            (Some(AlertKind::PartialReuse), Some(AlertKind::HintedMiss))
        );
        let text = render(&registry);
        assert!(
            text.contains("inferencecache_accuracy_alerts{kind=\"partial_reuse\"} 0"),
            "{text}"
        );
        assert!(
            text.contains("inferencecache_accuracy_alerts{kind=\"hinted_miss\"} 1"),
            "{text}"
        );
        assert!(
            !text.contains("replica=\"r\",kind=\"partial_reuse\""),
            "{text}"
        );
    }

    #[test]
    fn a_failing_canary_is_a_server_wide_alert() {
        let (watch, registry) = watch(1);
        let transitions = watch.check(Some(
            "tokenizer m: the known prompt tokenized differently twice",
        ));
        assert_eq!(
            transitions,
            [Transition {
                key: None,
                from: None,
                to: Some(AlertKind::Canary)
            }]
        );
        assert!(watch.check(Some("again")).is_empty());
        let report = watch.report();
        assert_eq!(report.alerts.len(), 1);
        assert_eq!(report.alerts[0].kind, "canary");
        assert!(report.alerts[0].message.contains("again"), "{report:?}");
        assert!(watch.readiness_detail().starts_with("accuracy: canary: "));
        assert!(render(&registry).contains("inferencecache_accuracy_alerts{kind=\"canary\"} 1"));
        assert_eq!(watch.check(None).len(), 1);
        assert!(watch.readiness_detail().is_empty());
        assert!(render(&registry).contains("inferencecache_accuracy_alerts{kind=\"canary\"} 0"));
    }

    #[test]
    fn settings_are_validated_and_bound_the_window() {
        assert_eq!(WatchSettings::default().validate(), Ok(()));
        assert_eq!(WatchSettings::default().buckets(), 6);
        let narrow = WatchSettings {
            window: Duration::from_secs(1),
            ..WatchSettings::default()
        };
        assert!(
            narrow
                .validate()
                .expect_err("window below the interval")
                .contains("--accuracy-window")
        );
        let wide = WatchSettings {
            window: Duration::from_secs(3600),
            ..WatchSettings::default()
        };
        assert!(
            wide.validate()
                .expect_err("too many buckets")
                .contains("at most 60")
        );
        assert_eq!(wide.buckets(), MAX_WINDOW_BUCKETS);
        let zero = WatchSettings {
            check_interval: Duration::ZERO,
            ..WatchSettings::default()
        };
        assert!(zero.validate().is_err());
    }
}
