//! Hint accuracy: what gateways were promised against what the engines reused.
//!
//! Gateways report one [`Outcome`] per looked-up request (`ReportOutcomes`):
//! the replica the hint named, the `matched_tokens` it predicted and the
//! engine's `usage.prompt_tokens_details.cached_tokens`. The [`OutcomeBook`]
//! folds them into one [`Tally`] per series — `(tenant, model, replica,
//! mode)` — and exports them three ways: Prometheus families on `/metrics`
//! (labels `tenant`, `replica`, `mode`), rows for `GetCacheState` and the
//! `/snapshot/accuracy` JSON.
//!
//! Routed outcomes with a prediction also feed the [`AccuracyWatch`], which
//! flags replicas whose hints are systematically wrong.
//!
//! Invariants:
//! - The number of series is bounded by [`OutcomeSettings::max_series`];
//!   outcomes of further series are folded into one `_other` series (the
//!   caller counts each fold), so neither memory nor label cardinality
//!   grows with what reporters send. Identifiers longer than
//!   [`OutcomeSettings::max_id_bytes`] are refused; outcomes of one report
//!   past [`OutcomeSettings::max_batch`] are dropped (the caller counts them).
//! - Only outcomes counted in their own series reach the watch, so it holds
//!   at most `max_series` keys.
//! - A ratio (`cached / predicted`) exists only for outcomes with a
//!   prediction; medians come from fixed 1 % bins, so they are exact to 1 %.
//!
//! Concurrency and cost: one mutex around the series map, taken once per
//! report (not per outcome); a series costs about 3.3 KiB (two bin arrays)
//! plus its Prometheus children.

use std::collections::HashMap;

use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use serde::Serialize;

use crate::accuracy_watch::{AccuracyWatch, WatchKey, WatchSettings};

/// Default [`OutcomeSettings::max_series`].
pub const DEFAULT_MAX_SERIES: usize = 1024;
/// Default [`OutcomeSettings::max_id_bytes`].
pub const DEFAULT_MAX_ID_BYTES: usize = 256;
/// Default [`OutcomeSettings::max_batch`]: well above a gateway's
/// `outcome_batch_max` (256).
pub const DEFAULT_MAX_BATCH: usize = 4096;
/// Label value of the series that collects outcomes past the series limit.
pub const OTHER: &str = "_other";

/// Largest ratio (in percent) with its own bin; larger ratios share the last bin.
const MAX_RATIO_PERCENT: usize = 400;
/// Upper bounds of the `hint_cached_ratio` histogram buckets.
const RATIO_BUCKETS: [f64; 11] = [0.0, 0.5, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25, 1.5, 2.0];

/// Bounds of the outcome aggregation (`--outcome-max-*`) and the accuracy
/// watch (`--accuracy-*`, `--canary-interval`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutcomeSettings {
    /// Most `(tenant, model, replica, mode)` series kept; outcomes of further
    /// series are folded into the `_other` series (counted as the
    /// `outcome_series` limit). Bounds memory and `/metrics` label cardinality.
    pub max_series: usize,
    /// Longest tenant, model or replica id accepted in an outcome; longer
    /// ones are refused (counted as the `outcome_id_bytes` limit).
    pub max_id_bytes: usize,
    /// Most outcomes counted from one report; the rest are dropped (counted
    /// as the `outcome_batch` limit).
    pub max_batch: usize,
    /// How the accuracy watch judges the outcomes.
    pub watch: WatchSettings,
}

impl Default for OutcomeSettings {
    fn default() -> Self {
        Self {
            max_series: DEFAULT_MAX_SERIES,
            max_id_bytes: DEFAULT_MAX_ID_BYTES,
            max_batch: DEFAULT_MAX_BATCH,
            watch: WatchSettings::default(),
        }
    }
}

/// How the gateway used the hint of an outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Mode {
    /// Routed to the hinted replica.
    Routed,
    /// Hinted, not routed: the tenant's policy is in shadow mode.
    Shadow,
    /// No routable hint.
    Unhinted,
}

impl Mode {
    /// Label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Routed => "routed",
            Mode::Shadow => "shadow",
            Mode::Unhinted => "unhinted",
        }
    }
}

/// How an outcome compares with its prediction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Predicted reuse, and the engine reused something.
    HintedHit,
    /// Predicted reuse, and the engine reused nothing.
    HintedMiss,
    /// No reuse predicted, and the engine reused something.
    NotHintedHit,
    /// No reuse predicted, and none happened.
    NotHintedMiss,
}

impl Verdict {
    /// The verdict of `predicted` against `cached` tokens.
    pub fn of(predicted: u64, cached: u64) -> Self {
        match (predicted > 0, cached > 0) {
            (true, true) => Verdict::HintedHit,
            (true, false) => Verdict::HintedMiss,
            (false, true) => Verdict::NotHintedHit,
            (false, false) => Verdict::NotHintedMiss,
        }
    }

    /// Label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::HintedHit => "hinted_hit",
            Verdict::HintedMiss => "hinted_miss",
            Verdict::NotHintedHit => "not_hinted_hit",
            Verdict::NotHintedMiss => "not_hinted_miss",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// One request's outcome, as a gateway reported it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Outcome {
    /// Tenant of the lookup.
    pub tenant_id: String,
    /// Model of the lookup.
    pub model_id: String,
    /// The hinted replica, or the replica that served an unhinted request.
    pub replica_id: String,
    /// The top replica's `matched_tokens`.
    pub predicted_tokens: u64,
    /// The engine's `cached_tokens`.
    pub cached_tokens: u64,
    /// The gateway routed on the hint.
    pub routed: bool,
    /// The answer was a shadow-mode answer.
    pub shadow: bool,
}

impl Outcome {
    /// The mode the outcome is counted under.
    pub fn mode(&self) -> Mode {
        if self.shadow {
            Mode::Shadow
        } else if self.routed {
            Mode::Routed
        } else {
            Mode::Unhinted
        }
    }
}

/// Counts and ratio distributions of one series.
#[derive(Debug, Clone)]
pub struct Tally {
    verdicts: [u64; 4],
    predicted_tokens: u64,
    cached_tokens: u64,
    /// Bin `i`: outcomes whose `100 × cached / predicted` is `i` (last bin: ≥ it).
    ratio_bins: Box<[u32; MAX_RATIO_PERCENT + 1]>,
    /// Bin `i`: outcomes whose `100 × |cached − predicted| / predicted` is `i`.
    error_bins: Box<[u32; MAX_RATIO_PERCENT + 1]>,
    ratios: u64,
}

impl Default for Tally {
    fn default() -> Self {
        Self {
            verdicts: [0; 4],
            predicted_tokens: 0,
            cached_tokens: 0,
            ratio_bins: Box::new([0; MAX_RATIO_PERCENT + 1]),
            error_bins: Box::new([0; MAX_RATIO_PERCENT + 1]),
            ratios: 0,
        }
    }
}

/// `100 × numerator / denominator`, capped at the last bin.
fn percent_bin(numerator: u64, denominator: u64) -> usize {
    let percent = u128::from(numerator) * 100 / u128::from(denominator.max(1));
    usize::try_from(percent)
        .unwrap_or(MAX_RATIO_PERCENT)
        .min(MAX_RATIO_PERCENT)
}

/// The lower median of binned values, as a fraction (bin / 100).
fn median(bins: &[u32], count: u64) -> f32 {
    if count == 0 {
        return 0.0;
    }
    let rank = count.div_ceil(2);
    let mut seen = 0u64;
    for (bin, n) in bins.iter().enumerate() {
        seen += u64::from(*n);
        if seen >= rank {
            return bin as f32 / 100.0;
        }
    }
    (bins.len() - 1) as f32 / 100.0
}

impl Tally {
    /// Adds one outcome.
    pub fn add(&mut self, predicted: u64, cached: u64) -> Verdict {
        let verdict = Verdict::of(predicted, cached);
        self.verdicts[verdict.index()] += 1;
        self.predicted_tokens = self.predicted_tokens.saturating_add(predicted);
        self.cached_tokens = self.cached_tokens.saturating_add(cached);
        if predicted > 0 {
            let ratio = percent_bin(cached, predicted);
            let error = percent_bin(cached.abs_diff(predicted), predicted);
            self.ratio_bins[ratio] = self.ratio_bins[ratio].saturating_add(1);
            self.error_bins[error] = self.error_bins[error].saturating_add(1);
            self.ratios += 1;
        }
        verdict
    }

    /// Outcomes counted.
    pub fn outcomes(&self) -> u64 {
        self.verdicts.iter().sum()
    }

    /// Outcomes with `verdict`.
    pub fn count(&self, verdict: Verdict) -> u64 {
        self.verdicts[verdict.index()]
    }

    /// Median of `cached / predicted` over outcomes with a prediction (0 without any).
    pub fn median_ratio(&self) -> f32 {
        median(self.ratio_bins.as_slice(), self.ratios)
    }

    /// Median of `|cached − predicted| / predicted` over the same outcomes.
    pub fn median_abs_error(&self) -> f32 {
        median(self.error_bins.as_slice(), self.ratios)
    }
}

/// One series as `GetCacheState` and `/snapshot/accuracy` show it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct AccuracyRow {
    /// Tenant id (`_other` for the folded series).
    pub tenant_id: String,
    /// Model id.
    pub model_id: String,
    /// Replica id.
    pub replica_id: String,
    /// `routed`, `shadow` or `unhinted`.
    pub mode: &'static str,
    /// Outcomes counted.
    pub outcomes: u64,
    /// [`Verdict::HintedHit`] count.
    pub hinted_hit: u64,
    /// [`Verdict::HintedMiss`] count.
    pub hinted_miss: u64,
    /// [`Verdict::NotHintedHit`] count.
    pub not_hinted_hit: u64,
    /// [`Verdict::NotHintedMiss`] count.
    pub not_hinted_miss: u64,
    /// Sum of predicted tokens.
    pub predicted_tokens: u64,
    /// Sum of the engines' cached tokens.
    pub cached_tokens: u64,
    /// See [`Tally::median_ratio`].
    pub median_ratio: f32,
    /// See [`Tally::median_abs_error`].
    pub median_abs_error: f32,
}

/// What [`OutcomeBook::record`] did with a report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RecordReport {
    /// Outcomes counted in their own series.
    pub counted: u64,
    /// Outcomes counted in the `_other` series: their series was past `max_series`.
    pub folded: u64,
    /// Outcomes refused: an identifier longer than `max_id_bytes`.
    pub refused: u64,
    /// Outcomes dropped: past the report's first `max_batch`.
    pub cut: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct SeriesKey {
    tenant: String,
    model: String,
    replica: String,
    mode: Mode,
}

/// Labels of the per-series families.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SeriesLabel {
    /// Tenant id.
    pub tenant: String,
    /// Replica id.
    pub replica: String,
    /// `routed`, `shadow` or `unhinted`.
    pub mode: String,
}

/// Labels of the verdict counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VerdictLabel {
    /// Tenant id.
    pub tenant: String,
    /// Replica id.
    pub replica: String,
    /// `routed`, `shadow` or `unhinted`.
    pub mode: String,
    /// `hinted_hit`, `hinted_miss`, `not_hinted_hit` or `not_hinted_miss`.
    pub verdict: String,
}

fn ratio_histogram() -> Histogram {
    Histogram::new(RATIO_BUCKETS)
}

/// Every series' tally and its Prometheus families.
pub struct OutcomeBook {
    settings: OutcomeSettings,
    series: Mutex<HashMap<SeriesKey, Tally>>,
    verdicts: Family<VerdictLabel, Counter>,
    predicted: Family<SeriesLabel, Counter>,
    cached: Family<SeriesLabel, Counter>,
    ratio: Family<SeriesLabel, Histogram, fn() -> Histogram>,
    /// `inferencecache_hint_outcomes_dropped_by_gateways_total`: outcomes
    /// reporters dropped (their buffers were full), as they said.
    pub dropped_by_gateways: Counter,
    watch: AccuracyWatch,
}

impl OutcomeBook {
    /// An empty book whose families are registered in `registry`.
    pub fn new(settings: OutcomeSettings, registry: &mut Registry) -> Self {
        let verdicts = Family::<VerdictLabel, Counter>::default();
        registry.register(
            "hint_outcomes",
            "Reported request outcomes by tenant, hinted replica, mode (routed, shadow, unhinted) and verdict (predicted reuse vs the engine's cached_tokens)",
            verdicts.clone(),
        );
        let predicted = Family::<SeriesLabel, Counter>::default();
        registry.register(
            "hint_predicted_tokens",
            "Sum of the matched_tokens hints predicted, by tenant, replica and mode",
            predicted.clone(),
        );
        let cached = Family::<SeriesLabel, Counter>::default();
        registry.register(
            "hint_cached_tokens",
            "Sum of the cached_tokens engines reported, by tenant, replica and mode",
            cached.clone(),
        );
        let ratio = Family::<SeriesLabel, Histogram, fn() -> Histogram>::new_with_constructor(
            ratio_histogram,
        );
        registry.register(
            "hint_cached_ratio",
            "cached_tokens / predicted matched_tokens of outcomes with a prediction (1 = exact)",
            ratio.clone(),
        );
        let dropped_by_gateways = Counter::default();
        registry.register(
            "hint_outcomes_dropped_by_gateways",
            "Outcomes gateways dropped before reporting them (their outcome buffer was full)",
            dropped_by_gateways.clone(),
        );
        let watch = AccuracyWatch::new(settings.watch.clone(), registry);
        Self {
            settings,
            watch,
            series: Mutex::new(HashMap::new()),
            verdicts,
            predicted,
            cached,
            ratio,
            dropped_by_gateways,
        }
    }

    /// The bounds in force.
    pub fn settings(&self) -> &OutcomeSettings {
        &self.settings
    }

    /// The accuracy watch fed by [`OutcomeBook::record`].
    pub fn watch(&self) -> &AccuracyWatch {
        &self.watch
    }

    /// Counts a batch of outcomes (its first `max_batch`).
    pub fn record(&self, outcomes: &[Outcome]) -> RecordReport {
        let mut report = RecordReport::default();
        let kept = outcomes.len().min(self.settings.max_batch);
        report.cut = (outcomes.len() - kept) as u64;
        let mut watched = Vec::new();
        let mut series = self.series.lock();
        for outcome in &outcomes[..kept] {
            let max = self.settings.max_id_bytes;
            if outcome.tenant_id.len() > max
                || outcome.model_id.len() > max
                || outcome.replica_id.len() > max
            {
                report.refused += 1;
                continue;
            }
            let mut key = SeriesKey {
                tenant: outcome.tenant_id.clone(),
                model: outcome.model_id.clone(),
                replica: outcome.replica_id.clone(),
                mode: outcome.mode(),
            };
            // The `_other` series may always be created: the bound is max_series + 1 per mode.
            if !series.contains_key(&key) && series.len() >= self.settings.max_series {
                key.tenant = OTHER.to_owned();
                key.model = OTHER.to_owned();
                key.replica = OTHER.to_owned();
                report.folded += 1;
            } else {
                report.counted += 1;
                if key.mode == Mode::Routed && outcome.predicted_tokens > 0 {
                    watched.push((
                        WatchKey {
                            tenant: key.tenant.clone(),
                            model: key.model.clone(),
                            replica: key.replica.clone(),
                        },
                        outcome.predicted_tokens,
                        outcome.cached_tokens,
                    ));
                }
            }
            let tally = series.entry(key.clone()).or_default();
            let verdict = tally.add(outcome.predicted_tokens, outcome.cached_tokens);
            self.export(&key, verdict, outcome);
        }
        drop(series);
        self.watch.observe(watched);
        report
    }

    fn export(&self, key: &SeriesKey, verdict: Verdict, outcome: &Outcome) {
        let mode = key.mode.as_str().to_owned();
        self.verdicts
            .get_or_create(&VerdictLabel {
                tenant: key.tenant.clone(),
                replica: key.replica.clone(),
                mode: mode.clone(),
                verdict: verdict.as_str().to_owned(),
            })
            .inc();
        let label = SeriesLabel {
            tenant: key.tenant.clone(),
            replica: key.replica.clone(),
            mode,
        };
        self.predicted
            .get_or_create(&label)
            .inc_by(outcome.predicted_tokens);
        self.cached
            .get_or_create(&label)
            .inc_by(outcome.cached_tokens);
        if outcome.predicted_tokens > 0 {
            let ratio = outcome.cached_tokens as f64 / outcome.predicted_tokens as f64;
            self.ratio.get_or_create(&label).observe(ratio);
        }
    }

    /// Rows of one `(tenant, model)` scope, by replica then mode.
    pub fn rows(&self, tenant_id: &str, model_id: &str) -> Vec<AccuracyRow> {
        self.collect(|key| key.tenant == tenant_id && key.model == model_id)
    }

    /// Every row, by tenant, model, replica, mode.
    pub fn all_rows(&self) -> Vec<AccuracyRow> {
        self.collect(|_| true)
    }

    /// The number of series held.
    pub fn series_count(&self) -> usize {
        self.series.lock().len()
    }

    fn collect(&self, keep: impl Fn(&SeriesKey) -> bool) -> Vec<AccuracyRow> {
        let series = self.series.lock();
        let mut keys: Vec<&SeriesKey> = series.keys().filter(|key| keep(key)).collect();
        keys.sort();
        keys.into_iter()
            .filter_map(|key| series.get(key).map(|tally| row(key, tally)))
            .collect()
    }
}

fn row(key: &SeriesKey, tally: &Tally) -> AccuracyRow {
    AccuracyRow {
        tenant_id: key.tenant.clone(),
        model_id: key.model.clone(),
        replica_id: key.replica.clone(),
        mode: key.mode.as_str(),
        outcomes: tally.outcomes(),
        hinted_hit: tally.count(Verdict::HintedHit),
        hinted_miss: tally.count(Verdict::HintedMiss),
        not_hinted_hit: tally.count(Verdict::NotHintedHit),
        not_hinted_miss: tally.count(Verdict::NotHintedMiss),
        predicted_tokens: tally.predicted_tokens,
        cached_tokens: tally.cached_tokens,
        median_ratio: tally.median_ratio(),
        median_abs_error: tally.median_abs_error(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(replica: &str, predicted: u64, cached: u64, routed: bool) -> Outcome {
        Outcome {
            tenant_id: "t".into(),
            model_id: "m".into(),
            replica_id: replica.into(),
            predicted_tokens: predicted,
            cached_tokens: cached,
            routed,
            shadow: false,
        }
    }

    fn book(max_series: usize) -> (OutcomeBook, Registry) {
        let mut registry = Registry::with_prefix("inferencecache");
        let settings = OutcomeSettings {
            max_series,
            ..OutcomeSettings::default()
        };
        (OutcomeBook::new(settings, &mut registry), registry)
    }

    #[test]
    fn verdicts_sums_and_medians_per_series() {
        let (book, _) = book(16);
        let report = book.record(&[
            outcome("a", 128, 128, true),
            outcome("a", 128, 112, true),
            outcome("a", 64, 0, true),
            outcome("a", 0, 0, false),
            outcome("b", 0, 32, false),
        ]);
        assert_eq!(
            report,
            RecordReport {
                counted: 5,
                folded: 0,
                refused: 0,
                cut: 0,
            }
        );
        let rows = book.rows("t", "m");
        assert_eq!(rows.len(), 3, "{rows:?}");
        let routed = &rows[0];
        assert_eq!((routed.replica_id.as_str(), routed.mode), ("a", "routed"));
        assert_eq!(routed.outcomes, 3);
        assert_eq!((routed.hinted_hit, routed.hinted_miss), (2, 1));
        assert_eq!(routed.predicted_tokens, 320);
        assert_eq!(routed.cached_tokens, 240);
        // Ratios 1.0, 0.875, 0.0: the median is 0.87 (1 % bins, rounded down).
        assert_eq!(routed.median_ratio, 0.87);
        // Errors 0, 0.125, 1.0.
        assert_eq!(routed.median_abs_error, 0.12);
        assert_eq!(
            (rows[1].replica_id.as_str(), rows[1].mode),
            ("a", "unhinted")
        );
        assert_eq!(rows[1].not_hinted_miss, 1);
        assert_eq!(rows[1].median_ratio, 0.0);
        assert_eq!(rows[2].not_hinted_hit, 1);
        assert!(book.rows("t", "other-model").is_empty());
    }

    #[test]
    fn series_past_the_limit_fold_into_other() {
        let (book, _) = book(2);
        let report = book.record(&[
            outcome("a", 16, 16, true),
            outcome("b", 16, 16, true),
            outcome("c", 16, 0, true),
            outcome("d", 16, 0, true),
            outcome("a", 16, 16, true),
        ]);
        assert_eq!((report.counted, report.folded), (3, 2));
        assert_eq!(book.series_count(), 3);
        let other: Vec<_> = book
            .all_rows()
            .into_iter()
            .filter(|row| row.replica_id == OTHER)
            .collect();
        assert_eq!(other.len(), 1);
        assert_eq!((other[0].outcomes, other[0].hinted_miss), (2, 2));
        let long = Outcome {
            replica_id: "r".repeat(DEFAULT_MAX_ID_BYTES + 1),
            ..outcome("", 1, 1, true)
        };
        assert_eq!(book.record(&[long]).refused, 1);
    }

    #[test]
    fn shadow_outcomes_are_their_own_mode_and_reach_the_metrics() {
        let (book, registry) = book(16);
        let mut shadow = outcome("a", 64, 0, false);
        shadow.shadow = true;
        book.record(&[shadow, outcome("a", 64, 64, true)]);
        let modes: Vec<_> = book.rows("t", "m").iter().map(|row| row.mode).collect();
        assert_eq!(modes, ["routed", "shadow"]);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).expect("encodes");
        assert!(
            text.contains(
                "inferencecache_hint_outcomes_total{tenant=\"t\",replica=\"a\",mode=\"shadow\",verdict=\"hinted_miss\"} 1"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "inferencecache_hint_cached_ratio_bucket{le=\"1.0\",tenant=\"t\",replica=\"a\",mode=\"routed\"} 1"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "inferencecache_hint_predicted_tokens_total{tenant=\"t\",replica=\"a\",mode=\"shadow\"} 64"
            ),
            "{text}"
        );
    }

    #[test]
    fn a_report_past_max_batch_is_cut_and_only_routed_predictions_are_watched() {
        let mut registry = Registry::with_prefix("inferencecache");
        let settings = OutcomeSettings {
            max_series: 3,
            max_batch: 6,
            watch: WatchSettings {
                min_samples: 1,
                ..WatchSettings::default()
            },
            ..OutcomeSettings::default()
        };
        let book = OutcomeBook::new(settings, &mut registry);
        let mut shadow = outcome("a", 64, 0, false);
        shadow.shadow = true;
        let report = book.record(&[
            outcome("a", 64, 0, true),
            outcome("a", 0, 0, false),
            shadow,
            // Past max_series: folded, not watched.
            outcome("b", 64, 0, true),
            outcome("a", 64, 0, true),
            outcome("a", 64, 64, true),
            // Past max_batch.
            outcome("a", 64, 0, true),
            outcome("a", 64, 0, true),
        ]);
        assert_eq!(
            report,
            RecordReport {
                counted: 5,
                folded: 1,
                refused: 0,
                cut: 2,
            }
        );
        book.watch().check(None);
        let watch = book.watch().report();
        assert_eq!(watch.watched.len(), 1, "{watch:?}");
        assert_eq!(watch.watched[0].replica_id, "a");
        assert_eq!(
            (
                watch.watched[0].window.hinted,
                watch.watched[0].window.hinted_miss
            ),
            (3, 2)
        );
        assert_eq!(watch.alerts.len(), 1, "{watch:?}");
    }

    #[test]
    fn ratio_bins_cap_and_medians_of_even_counts() {
        let mut tally = Tally::default();
        tally.add(1, u64::MAX);
        tally.add(100, 100);
        assert_eq!(tally.median_ratio(), 1.0);
        assert_eq!(tally.median_abs_error(), 0.0);
        tally.add(100, 100_000);
        assert_eq!(tally.median_ratio(), 4.0);
    }
}
