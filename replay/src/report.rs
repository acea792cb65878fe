//! Rendering a replay's results: the text table (with reason-code shares
//! and hint accuracy under it) and the JSON document behind `--json`. Pure
//! functions of the results, so tests compare strings.
//!
//! [`HintAccuracy`] holds the same predicted-vs-actual figures the server
//! shows for live traffic (`GetCacheState.accuracy`, `/snapshot/accuracy`):
//! per request, the hint's `matched_tokens` when the row routed on it (0
//! otherwise) against the prompt tokens the serving replica's cache held.

use std::fmt::Write as _;

use serde::Serialize;

use crate::sim::PolicyResult;

/// Predicted vs actual prefix reuse of one row's requests.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct HintAccuracy {
    /// Requests counted.
    pub outcomes: u64,
    /// Predicted reuse (> 0) and the cache held something.
    pub hinted_hit: u64,
    /// Predicted reuse, and the cache held nothing.
    pub hinted_miss: u64,
    /// No reuse predicted, and the cache held something.
    pub not_hinted_hit: u64,
    /// No reuse predicted, and none happened.
    pub not_hinted_miss: u64,
    /// Sum of predicted tokens.
    pub predicted_tokens: u64,
    /// Sum of cached (reused) tokens.
    pub cached_tokens: u64,
    /// Median of `cached / predicted` over requests with a prediction.
    pub median_ratio: Option<f64>,
    /// Median of `|cached − predicted| / predicted` over the same requests.
    pub median_abs_error: Option<f64>,
    #[serde(skip)]
    ratios: Vec<f64>,
    #[serde(skip)]
    errors: Vec<f64>,
}

/// The lower median (the `⌈n/2⌉`-th smallest), `None` when empty.
fn lower_median(values: &mut [f64]) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    Some(values[values.len().div_ceil(2) - 1])
}

impl HintAccuracy {
    /// Counts one request.
    pub fn add(&mut self, predicted: u64, cached: u64) {
        self.outcomes += 1;
        match (predicted > 0, cached > 0) {
            (true, true) => self.hinted_hit += 1,
            (true, false) => self.hinted_miss += 1,
            (false, true) => self.not_hinted_hit += 1,
            (false, false) => self.not_hinted_miss += 1,
        }
        self.predicted_tokens += predicted;
        self.cached_tokens += cached;
        if predicted > 0 {
            let predicted = predicted as f64;
            self.ratios.push(cached as f64 / predicted);
            self.errors
                .push((cached as f64 - predicted).abs() / predicted);
        }
    }

    /// The counts with the medians filled in.
    pub fn finished(mut self) -> Self {
        self.median_ratio = lower_median(&mut self.ratios);
        self.median_abs_error = lower_median(&mut self.errors);
        self
    }
}

/// What was replayed and how, printed above the table and in the JSON.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunInfo {
    /// Trace file, or `synthetic (seed N)`.
    pub source: String,
    /// Requests replayed.
    pub requests: u64,
    /// Prompt blocks in the trace.
    pub blocks: u64,
    /// Tokens per block.
    pub block_size: u32,
    /// Replicas simulated.
    pub replicas: usize,
    /// LRU capacity per replica, blocks.
    pub capacity_blocks: usize,
    /// Prefill throughput per replica, tokens per second.
    pub prefill_tps: f64,
    /// Decode time per output token, milliseconds.
    pub tpot_ms: f64,
    /// Arrival compression.
    pub speedup: f64,
    /// Load report interval, simulated milliseconds.
    pub stats_interval_ms: f64,
    /// When the index learns of admissions: `routing` or `prefill-end`.
    pub report_at: &'static str,
    /// Interval of the re-reports of every held block, simulated
    /// milliseconds (absent: never).
    pub refresh_interval_ms: Option<f64>,
    /// `in-process` or the server URL.
    pub index: String,
}

/// The whole `--json` document.
#[derive(Debug, Clone, Serialize)]
pub struct Report<'a> {
    /// Run parameters.
    pub run: &'a RunInfo,
    /// One entry per policy, in table order.
    pub results: &'a [PolicyResult],
}

/// Milliseconds as `850 ms`, `2.31 s` or `2974 s`.
pub fn format_ms(ms: f64) -> String {
    if ms < 1000.0 {
        format!("{ms:.0} ms")
    } else if ms < 100_000.0 {
        format!("{:.2} s", ms / 1000.0)
    } else {
        format!("{:.0} s", ms / 1000.0)
    }
}

/// The header line, the table and the reason-code shares.
pub fn render_table(run: &RunInfo, results: &[PolicyResult]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{}: {} requests, {} blocks of {} tokens; {} replicas × {} blocks; prefill {} tok/s, \
         tpot {} ms, speedup {}; index {}, fed at {}, refreshed {}",
        run.source,
        run.requests,
        run.blocks,
        run.block_size,
        run.replicas,
        run.capacity_blocks,
        run.prefill_tps,
        run.tpot_ms,
        run.speedup,
        run.index,
        run.report_at,
        run.refresh_interval_ms.map_or_else(
            || "never".to_string(),
            |ms| format!("every {}", format_ms(ms))
        ),
    );
    let header = [
        "policy",
        "block hit",
        "token hit",
        "× oracle",
        "TTFT mean",
        "TTFT p50",
        "TTFT p99",
        "req max/mean",
        "prefill max/mean",
    ];
    let rows: Vec<[String; 9]> = results
        .iter()
        .map(|r| {
            [
                r.label.to_owned(),
                format!("{:.3}", r.block_hit_rate),
                format!("{:.3}", r.token_hit_rate),
                r.oracle_ratio.map_or("–".into(), |x| format!("{x:.2}")),
                format_ms(r.ttft_ms.mean),
                format_ms(r.ttft_ms.p50),
                format_ms(r.ttft_ms.p99),
                format!("{:.2}", r.requests_per_replica.max_over_mean),
                format!("{:.2}", r.prefill_tokens_per_replica.max_over_mean),
            ]
        })
        .collect();
    let mut widths = header.map(|h| h.chars().count());
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: &[&str]| {
        let mut s = String::new();
        for (i, (cell, w)) in cells.iter().zip(widths).enumerate() {
            let pad = w - cell.chars().count();
            if i == 0 {
                s.push_str(cell);
                s.push_str(&" ".repeat(pad));
            } else {
                s.push_str("  ");
                s.push_str(&" ".repeat(pad));
                s.push_str(cell);
            }
        }
        s.trim_end().to_owned()
    };
    out.push('\n');
    let _ = writeln!(out, "{}", line(&header));
    for row in &rows {
        let cells: Vec<&str> = row.iter().map(String::as_str).collect();
        let _ = writeln!(out, "{}", line(&cells));
    }
    let with_reasons: Vec<&PolicyResult> = results.iter().filter(|r| r.reasons.is_some()).collect();
    if !with_reasons.is_empty() {
        let _ = writeln!(out, "\nreason codes (share of lookups):");
        for r in with_reasons {
            let mut shares = r.reasons.clone().unwrap_or_default();
            shares.sort_by(|a, b| b.count.cmp(&a.count).then_with(|| a.code.cmp(&b.code)));
            let parts: Vec<String> = shares
                .iter()
                .map(|s| format!("{} {:.1} %", s.code, s.share * 100.0))
                .collect();
            let _ = writeln!(out, "  {}: {}", r.label, parts.join(", "));
        }
    }
    let with_accuracy: Vec<(&PolicyResult, &HintAccuracy)> = results
        .iter()
        .filter_map(|r| r.hint_accuracy.as_ref().map(|a| (r, a)))
        .collect();
    if !with_accuracy.is_empty() {
        let _ = writeln!(
            out,
            "\nhint accuracy (predicted matched_tokens vs tokens the serving cache held):"
        );
        for (r, a) in with_accuracy {
            let _ = writeln!(out, "  {}: {}", r.label, accuracy_line(a));
        }
    }
    out
}

/// One row's hint accuracy in a line.
pub fn accuracy_line(a: &HintAccuracy) -> String {
    let percent = |x: Option<f64>| x.map_or("–".to_owned(), |x| format!("{:.1} %", x * 100.0));
    format!(
        "hinted {} (hit {}, miss {}), not hinted {} (hit {}); predicted {} tokens, reused {}; \
         median |actual − predicted| / predicted {}, median actual / predicted {}",
        a.hinted_hit + a.hinted_miss,
        a.hinted_hit,
        a.hinted_miss,
        a.not_hinted_hit + a.not_hinted_miss,
        a.not_hinted_hit,
        a.predicted_tokens,
        a.cached_tokens,
        percent(a.median_abs_error),
        percent(a.median_ratio),
    )
}

/// The `--json` document.
pub fn render_json(run: &RunInfo, results: &[PolicyResult]) -> String {
    serde_json::to_string_pretty(&Report { run, results }).unwrap_or_else(|e| {
        // Serializing plain numbers and strings cannot fail; keep the output valid JSON anyway.
        format!("{{\"error\": {:?}}}", e.to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hint_accuracy_counts_and_medians() {
        let mut a = HintAccuracy::default();
        for (predicted, cached) in [(100, 100), (100, 90), (100, 0), (0, 32), (0, 0), (64, 80)] {
            a.add(predicted, cached);
        }
        let a = a.finished();
        assert_eq!(a.outcomes, 6);
        assert_eq!((a.hinted_hit, a.hinted_miss), (3, 1));
        assert_eq!((a.not_hinted_hit, a.not_hinted_miss), (1, 1));
        assert_eq!((a.predicted_tokens, a.cached_tokens), (364, 302));
        // Ratios 1.0, 0.9, 0.0, 1.25 → lower median 0.9; errors 0, 0.1, 1, 0.25 → 0.1.
        assert_eq!(a.median_ratio, Some(0.9));
        assert_eq!(a.median_abs_error, Some(0.1));
        assert_eq!(
            accuracy_line(&a),
            "hinted 4 (hit 3, miss 1), not hinted 2 (hit 1); predicted 364 tokens, reused 302; \
             median |actual − predicted| / predicted 10.0 %, median actual / predicted 90.0 %"
        );
        let empty = HintAccuracy::default().finished();
        assert_eq!((empty.median_ratio, empty.median_abs_error), (None, None));
        let json = serde_json::to_value(&a).expect("serializes");
        assert_eq!(json["medianAbsError"], 0.1);
        assert!(json.get("ratios").is_none());
    }

    #[test]
    fn milliseconds_read_naturally() {
        assert_eq!(format_ms(12.4), "12 ms");
        assert_eq!(format_ms(2310.0), "2.31 s");
        assert_eq!(format_ms(2_974_000.0), "2974 s");
    }
}
