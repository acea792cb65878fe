//! Rendering a replay's results: the text table (with reason-code shares
//! under it) and the JSON document behind `--json`. Pure functions of the
//! results, so tests compare strings.

use std::fmt::Write as _;

use serde::Serialize;

use crate::sim::PolicyResult;

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
         tpot {} ms, speedup {}; index {}, fed at {}",
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
    out
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
    fn milliseconds_read_naturally() {
        assert_eq!(format_ms(12.4), "12 ms");
        assert_eq!(format_ms(2310.0), "2.31 s");
        assert_eq!(format_ms(2_974_000.0), "2974 s");
    }
}
