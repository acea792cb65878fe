//! `--plot`: a self-contained SVG with two horizontal bar charts side by
//! side, one row per policy — block hit rate (0 to 1, with the token hit rate
//! as a thin bar beneath) and modelled TTFT mean (with a tick at p99), on a
//! shared scale per chart. Plain text output, no dependencies.

use std::fmt::Write as _;

use crate::report::format_ms;
use crate::sim::PolicyResult;

const ROW: f64 = 30.0;
const TOP: f64 = 56.0;
const LABEL: f64 = 210.0;
const CHART: f64 = 300.0;
const GAP: f64 = 90.0;

/// The chart for `results`, titled `title`.
pub fn render_svg(title: &str, results: &[PolicyResult]) -> String {
    let width = LABEL + CHART + GAP + CHART + 70.0;
    let height = TOP + ROW * results.len() as f64 + 30.0;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="10" y="20" font-size="14" font-weight="bold">{}</text>"#,
        escape(title)
    );
    let hit_x = LABEL;
    let ttft_x = LABEL + CHART + GAP;
    let _ = writeln!(
        s,
        r#"<text x="{hit_x}" y="44">block hit rate (thin: token hit rate)</text>"#
    );
    let _ = writeln!(
        s,
        r#"<text x="{ttft_x}" y="44">TTFT mean (tick: p99)</text>"#
    );
    let ttft_scale = results
        .iter()
        .map(|r| r.ttft_ms.p99.max(r.ttft_ms.mean))
        .fold(0.0f64, f64::max)
        .max(1.0);
    for (i, r) in results.iter().enumerate() {
        let y = TOP + ROW * i as f64;
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="end">{}</text>"#,
            LABEL - 8.0,
            y + 15.0,
            escape(r.label)
        );
        let hit_w = CHART * r.block_hit_rate.clamp(0.0, 1.0);
        let token_w = CHART * r.token_hit_rate.clamp(0.0, 1.0);
        let _ = writeln!(
            s,
            r##"<rect class="bar hit" x="{hit_x}" y="{y}" width="{hit_w:.1}" height="16" fill="#3b7dd8"><title>{}: block hit rate {:.3}</title></rect>"##,
            escape(r.label),
            r.block_hit_rate
        );
        let _ = writeln!(
            s,
            r##"<rect x="{hit_x}" y="{}" width="{token_w:.1}" height="4" fill="#8fb4ea"/>"##,
            y + 18.0
        );
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{}">{:.3}</text>"#,
            hit_x + hit_w + 4.0,
            y + 13.0,
            r.block_hit_rate
        );
        let mean_w = CHART * r.ttft_ms.mean / ttft_scale;
        let p99_x = ttft_x + CHART * r.ttft_ms.p99 / ttft_scale;
        let _ = writeln!(
            s,
            r##"<rect class="bar ttft" x="{ttft_x}" y="{y}" width="{mean_w:.1}" height="16" fill="#e07b39"><title>{}: TTFT mean {}, p99 {}</title></rect>"##,
            escape(r.label),
            format_ms(r.ttft_ms.mean),
            format_ms(r.ttft_ms.p99)
        );
        let _ = writeln!(
            s,
            r##"<line x1="{p99_x:.1}" x2="{p99_x:.1}" y1="{}" y2="{}" stroke="#7a3a12" stroke-width="2"/>"##,
            y - 2.0,
            y + 18.0
        );
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{}">{}</text>"#,
            ttft_x + mean_w.max(CHART * r.ttft_ms.p99 / ttft_scale) + 5.0,
            y + 13.0,
            escape(&format_ms(r.ttft_ms.mean))
        );
    }
    let axis_y = TOP + ROW * results.len() as f64;
    for x in [hit_x, ttft_x] {
        let _ = writeln!(
            s,
            r##"<line x1="{x}" x2="{x}" y1="{}" y2="{axis_y}" stroke="#444"/>"##,
            TOP - 4.0
        );
    }
    let _ = writeln!(
        s,
        r#"<text x="{hit_x}" y="{}">0</text><text x="{}" y="{}" text-anchor="end">1</text>"#,
        axis_y + 14.0,
        hit_x + CHART,
        axis_y + 14.0
    );
    let _ = writeln!(
        s,
        r#"<text x="{ttft_x}" y="{}">0</text><text x="{}" y="{}" text-anchor="end">{}</text>"#,
        axis_y + 14.0,
        ttft_x + CHART,
        axis_y + 14.0,
        escape(&format_ms(ttft_scale))
    );
    s.push_str("</svg>\n");
    s
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}
