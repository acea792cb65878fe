//! What the demo shows: a live progress line, the final side-by-side table,
//! and a small web page with the same numbers as inline-SVG bar charts
//! (refreshing itself while the runs are going), plus `/results.json`.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::response::{Html, IntoResponse};
use axum::routing::get;
use parking_lot::Mutex;
use serde::Serialize;

use crate::driver::{RunStats, RunSummary};

/// Everything the page and the final table show.
#[derive(Debug, Default)]
pub struct Board {
    /// How requests reach the engines (Envoy or in-process filter logic).
    pub gateway: String,
    /// The runs, in the order they are made.
    pub runs: Vec<Arc<Mutex<RunStats>>>,
    /// True once every run has finished.
    pub finished: bool,
}

/// The page's JSON.
#[derive(Debug, Serialize)]
struct BoardJson {
    gateway: String,
    finished: bool,
    runs: Vec<RunSummary>,
}

impl Board {
    /// Summaries of every run so far.
    pub fn summaries(&self) -> Vec<RunSummary> {
        self.runs.iter().map(|run| run.lock().summary()).collect()
    }
}

/// One progress line: a bar, answered / total, hit rate, TTFT p50 / p99.
pub fn progress_line(summary: &RunSummary) -> String {
    const WIDTH: usize = 30;
    let answered = summary.done + summary.failed;
    let filled = (answered * WIDTH)
        .checked_div(summary.total)
        .unwrap_or(WIDTH)
        .min(WIDTH);
    format!(
        "{:<16} [{}{}] {:>4}/{:<4} hit {:>5.1}%  TTFT p50 {:>7.1} ms  p99 {:>7.1} ms",
        summary.name,
        "#".repeat(filled),
        "-".repeat(WIDTH - filled),
        answered,
        summary.total,
        summary.hit_rate * 100.0,
        summary.ttft_p50_ms,
        summary.ttft_p99_ms,
    )
}

/// The final side-by-side table.
pub fn render_table(runs: &[RunSummary]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<16} {:>9} {:>7} {:>9} {:>13} {:>13} {:>13}",
        "routing", "requests", "failed", "hit rate", "TTFT p50 ms", "TTFT p99 ms", "TTFT mean ms"
    );
    for r in runs {
        let _ = writeln!(
            s,
            "{:<16} {:>9} {:>7} {:>8.1}% {:>13.1} {:>13.1} {:>13.1}",
            r.name,
            r.done,
            r.failed,
            r.hit_rate * 100.0,
            r.ttft_p50_ms,
            r.ttft_p99_ms,
            r.ttft_mean_ms
        );
    }
    for r in runs {
        let outcomes: Vec<String> = r.outcomes.iter().map(|(k, v)| format!("{k} {v}")).collect();
        let engines: Vec<String> = r.per_engine.values().map(u64::to_string).collect();
        let _ = writeln!(
            s,
            "{}: outcomes {}; requests per engine {}",
            r.name,
            outcomes.join(", "),
            engines.join(" / ")
        );
    }
    s
}

const COLOURS: [&str; 2] = ["#1f77b4", "#aaaaaa"];

/// One horizontal bar chart: a bar per run, labelled with its value.
fn bar_chart(
    title: &str,
    runs: &[RunSummary],
    value: impl Fn(&RunSummary) -> f64,
    unit: &str,
) -> String {
    const LABEL: f64 = 130.0;
    const WIDTH: f64 = 300.0;
    const ROW: f64 = 28.0;
    let height = 30.0 + ROW * runs.len() as f64;
    let max = runs.iter().map(&value).fold(0.0f64, f64::max).max(1e-9);
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{height}" font-family="sans-serif" font-size="12"><text x="0" y="16" font-weight="bold">{title}</text>"#,
        w = LABEL + WIDTH + 90.0,
    );
    for (i, run) in runs.iter().enumerate() {
        let y = 26.0 + ROW * i as f64;
        let v = value(run);
        let width = (v / max * WIDTH).max(1.0);
        let colour = COLOURS[i % COLOURS.len()];
        let _ = write!(
            s,
            r#"<text x="0" y="{ty}">{name}</text><rect x="{LABEL}" y="{y}" width="{width:.1}" height="18" fill="{colour}"/><text x="{tx:.1}" y="{ty}">{v:.1}{unit}</text>"#,
            ty = y + 13.0,
            name = escape(&run.name),
            tx = LABEL + width + 6.0,
        );
    }
    s.push_str("</svg>");
    s
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The page: hit rate, TTFT p50 and p99 as bar charts, refreshing while running.
pub fn render_page(gateway: &str, finished: bool, runs: &[RunSummary]) -> String {
    let refresh = if finished {
        ""
    } else {
        r#"<meta http-equiv="refresh" content="1">"#
    };
    let status = if finished { "finished" } else { "running…" };
    let mut page = format!(
        "<!doctype html><html><head><meta charset=\"utf-8\">{refresh}<title>inference-cache demo</title></head>\
         <body style=\"font-family:sans-serif;max-width:640px;margin:2em auto\">\
         <h1>inference-cache demo</h1><p>Gateway: {}. Status: {status}.</p>",
        escape(gateway)
    );
    page.push_str(&bar_chart(
        "Prefix-cache hit rate (higher is better)",
        runs,
        |r| r.hit_rate * 100.0,
        "%",
    ));
    page.push_str(&bar_chart(
        "TTFT p50 (lower is better)",
        runs,
        |r| r.ttft_p50_ms,
        " ms",
    ));
    page.push_str(&bar_chart(
        "TTFT p99 (lower is better)",
        runs,
        |r| r.ttft_p99_ms,
        " ms",
    ));
    page.push_str("<pre>");
    page.push_str(&escape(&render_table(runs)));
    page.push_str("</pre><p><a href=\"/results.json\">results.json</a></p></body></html>");
    page
}

/// Serves the page on `addr`; returns the bound address.
pub async fn serve_page(
    addr: SocketAddr,
    board: Arc<Mutex<Board>>,
) -> anyhow::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let app = Router::new()
        .route("/", get(page))
        .route("/results.json", get(results))
        .with_state(board);
    let task = tokio::spawn(async move {
        if let Err(error) = axum::serve(listener, app).await {
            tracing::warn!(%error, "demo page stopped");
        }
    });
    Ok((bound, task))
}

fn snapshot(board: &Mutex<Board>) -> BoardJson {
    let board = board.lock();
    BoardJson {
        gateway: board.gateway.clone(),
        finished: board.finished,
        runs: board.summaries(),
    }
}

async fn page(State(board): State<Arc<Mutex<Board>>>) -> impl IntoResponse {
    let json = snapshot(&board);
    Html(render_page(&json.gateway, json.finished, &json.runs))
}

async fn results(State(board): State<Arc<Mutex<Board>>>) -> impl IntoResponse {
    axum::Json(snapshot(&board))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(name: &str, hit: f64, p50: f64) -> RunSummary {
        RunSummary {
            name: name.to_owned(),
            total: 10,
            done: 5,
            failed: 0,
            hit_rate: hit,
            ttft_p50_ms: p50,
            ttft_p99_ms: p50 * 3.0,
            ttft_mean_ms: p50,
            outcomes: Default::default(),
            per_engine: Default::default(),
        }
    }

    #[test]
    fn page_has_a_chart_per_number_and_both_runs() {
        let runs = [
            run("inference-cache", 0.8, 100.0),
            run("round-robin", 0.3, 400.0),
        ];
        let page = render_page("in-process", false, &runs);
        assert_eq!(page.matches("<svg").count(), 3);
        assert!(page.contains("80.0%") && page.contains("30.0%"));
        assert!(page.contains("400.0 ms") && page.contains("1200.0 ms"));
        assert!(page.contains("http-equiv=\"refresh\""));
        assert!(!render_page("x", true, &runs).contains("refresh"));
    }

    #[test]
    fn progress_bar_fills_with_answers() {
        let line = progress_line(&run("rr", 0.5, 10.0));
        assert!(
            line.contains(&format!("[{}{}]", "#".repeat(15), "-".repeat(15))),
            "{line}"
        );
        assert!(line.contains("5/10") && line.contains("50.0%"));
    }
}
