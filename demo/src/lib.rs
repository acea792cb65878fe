//! `inference-cache demo`: see KV-cache-aware routing win, on one machine,
//! without a GPU.
//!
//! The demo starts a small fleet of simulated vLLM engines ([`Engine`]: the
//! OpenAI completions and chat APIs, a real LRU prefix cache of 16-token
//! blocks, a time to first token that grows with the uncached tokens, vLLM's
//! load gauges, and vLLM KV events over ZMQ), one real KV-event subscriber
//! per engine feeding the real policy server, and a gateway: Envoy with the
//! compiled filter when an Envoy binary and the filter's `.wasm` are found,
//! otherwise the filter's own routing logic in-process ([`gateway`]). It then
//! sends the same realistic workload ([`workload`]: replay's synthetic
//! generator — shared system prompts, multi-turn chats, agent loops) twice,
//! each time to a fresh fleet: routed by inference-cache, and by plain
//! round-robin. A progress bar shows both runs live; at the end a table
//! shows hit rate and TTFT p50 / p99 side by side, and a web page serves the
//! same numbers as charts.
//!
//! Main items: [`DemoArgs`] (the flags), [`PolicyServer`] (the running
//! server the binary passes in), [`run`] (the subcommand's body) and
//! [`RunSummary`] (what it measured). See `docs/demo.md`.

mod driver;
mod engine;
mod envoy;
mod gateway;
mod kv_events;
mod report;
mod workload;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use inference_cache_replay::ServingModel;
use inference_cache_subscriber::{SubscribeArgs, Subscriber};
use parking_lot::Mutex;

pub use driver::{RunStats, RunSummary, Target, percentile};
pub use engine::{Engine, EngineConfig, block_hashes, stand_in_tokens};
pub use envoy::{EnvoyGateway, find_envoy, find_filter_wasm};
pub use gateway::{InProcessGateway, Route, filter_settings, post_json};
pub use kv_events::{CacheChange, Publisher, encode_batch};
pub use report::{Board, progress_line, render_page, render_table};
pub use workload::{DemoRequest, WorkloadConfig, build as build_workload};

/// Model id the engines serve and the subscribers report.
pub const MODEL: &str = "demo-model";
/// Tenant of the demo's cache entries and lookups.
pub const TENANT: &str = "demo";
/// Name of the inference-cache run.
pub const INFERENCE_CACHE_RUN: &str = "inference-cache";
/// Name of the round-robin run.
pub const ROUND_ROBIN_RUN: &str = "round-robin";

/// Flags of `inference-cache demo`; every one has a default.
#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// Simulated engines in the fleet.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(2..=64))]
    pub engines: u16,

    /// Requests in the workload (sent once per run).
    #[arg(long, default_value_t = 400)]
    pub requests: usize,

    /// Sessions (chats and agent loops) the requests belong to.
    #[arg(long, default_value_t = 40)]
    pub sessions: usize,

    /// Shared system prompts.
    #[arg(long, default_value_t = 4)]
    pub system_prompts: usize,

    /// Share of sessions that are agent loops.
    #[arg(long, default_value_t = 0.3)]
    pub agent_share: f64,

    /// How long each run's arrivals are spread over.
    #[arg(long, default_value = "25s", value_parser = inference_cache_index::parse_duration)]
    pub duration: Duration,

    /// Seed of the workload.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,

    /// Simulated prefill throughput of each engine, tokens per second.
    #[arg(long, default_value_t = 40_000.0)]
    pub prefill_tps: f64,

    /// Prefix-cache capacity of each engine, in 16-token blocks.
    #[arg(long, default_value_t = 4096)]
    pub cache_blocks: usize,

    /// LookupRoute budget of the gateway (the filter's `timeout_ms`); past it the request is routed round-robin.
    #[arg(long, default_value = "20ms", value_parser = inference_cache_index::parse_duration)]
    pub lookup_timeout: Duration,

    /// Envoy binary (default: `envoy` on PATH, then the one scripts/setup-envoy.sh installs).
    #[arg(long, env = "INFERENCE_CACHE_ENVOY")]
    pub envoy: Option<std::path::PathBuf>,

    /// The filter's `.wasm` (default: the workspace's wasm32-wasip1 build output).
    #[arg(long, env = "INFERENCE_CACHE_FILTER_WASM")]
    pub filter_wasm: Option<std::path::PathBuf>,

    /// Route in-process even when Envoy is available.
    #[arg(long)]
    pub no_envoy: bool,

    /// Address of the results page.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub page_addr: SocketAddr,

    /// Open the results page in a browser, and keep serving it after the runs until Ctrl-C.
    #[arg(long)]
    pub open: bool,

    /// No progress bar (one line per finished run instead).
    #[arg(long)]
    pub quiet: bool,
}

impl DemoArgs {
    /// Parses `demo` flags (the first item is the program name).
    pub fn try_parse_from<I, T>(args: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        #[derive(clap::Parser)]
        struct Wrapper {
            #[command(flatten)]
            args: DemoArgs,
        }
        <Wrapper as clap::Parser>::try_parse_from(args).map(|w| w.args)
    }

    fn workload(&self) -> WorkloadConfig {
        WorkloadConfig {
            requests: self.requests.max(1),
            sessions: self.sessions.max(1),
            system_prompts: self.system_prompts.max(1),
            agent_share: self.agent_share.clamp(0.0, 1.0),
            duration: self.duration,
            seed: self.seed,
        }
    }

    fn engine(&self) -> EngineConfig {
        EngineConfig {
            block_size: BLOCK_SIZE,
            cache_blocks: self.cache_blocks,
            serving: ServingModel {
                prefill_tps: self.prefill_tps.max(1.0),
                tpot_ms: 20.0,
            },
        }
    }
}

/// Tokens per KV block of the engines, the subscribers and the server's default.
const BLOCK_SIZE: usize = 16;

/// The running policy server the demo routes with.
#[derive(Debug, Clone, Copy)]
pub struct PolicyServer {
    /// Its gRPC address.
    pub grpc_addr: SocketAddr,
}

/// What a demo run measured: one summary per run (inference-cache first) and
/// how requests were routed.
#[derive(Debug, Clone)]
pub struct DemoReport {
    /// How requests reached the engines.
    pub gateway: String,
    /// inference-cache, then round-robin.
    pub runs: Vec<RunSummary>,
}

/// A fleet of engines, each with a subscriber when it is fed to the server.
struct Fleet {
    engines: Vec<Engine>,
    subscribers: Vec<Subscriber>,
}

impl Fleet {
    async fn start(
        count: u16,
        config: EngineConfig,
        server: Option<PolicyServer>,
    ) -> anyhow::Result<Self> {
        let mut engines = Vec::new();
        for _ in 0..count {
            engines.push(
                Engine::start(config)
                    .await
                    .context("starting a simulated engine")?,
            );
        }
        let mut subscribers = Vec::new();
        if let Some(server) = server {
            for engine in &engines {
                subscribers.push(subscribe(engine, server).await?);
            }
            wait_until_connected(&subscribers).await?;
        }
        Ok(Self {
            engines,
            subscribers,
        })
    }

    fn addrs(&self) -> Vec<SocketAddr> {
        self.engines.iter().map(Engine::addr).collect()
    }

    async fn stop(self) {
        for subscriber in self.subscribers {
            subscriber.shutdown().await;
        }
        drop(self.engines);
    }
}

async fn subscribe(engine: &Engine, server: PolicyServer) -> anyhow::Result<Subscriber> {
    let addr = engine.addr().to_string();
    let metrics_url = format!("http://{addr}/metrics");
    let server_url = format!("http://{}", server.grpc_addr);
    let block_size = BLOCK_SIZE.to_string();
    let args = SubscribeArgs::try_parse_from([
        "subscribe",
        "--endpoint",
        engine.kv_events_endpoint(),
        "--server",
        &server_url,
        "--replica-id",
        &addr,
        "--tenant",
        TENANT,
        "--model",
        MODEL,
        "--block-size",
        &block_size,
        "--engine-metrics-url",
        &metrics_url,
        "--metrics-interval",
        "200ms",
        "--heartbeat-interval",
        "1s",
        "--metrics-listen",
        "127.0.0.1:0",
    ])?;
    Ok(Subscriber::start(args.resolve()?).await?)
}

/// Waits until every subscriber holds its ZMQ subscription and has announced
/// its replica, so no KV event of the run is published before it listens.
async fn wait_until_connected(subscribers: &[Subscriber]) -> anyhow::Result<()> {
    let ready = |s: &Subscriber| {
        let metrics = s.metrics();
        metrics.sample("inferencecache_subscriber_zmq_connects_total") >= Some(1.0)
            && metrics.sample("inferencecache_subscriber_announcements_total") >= Some(1.0)
    };
    for _ in 0..200 {
        if subscribers.iter().all(ready) {
            // The PUB side registers the subscription asynchronously.
            tokio::time::sleep(Duration::from_millis(300)).await;
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    anyhow::bail!("the KV-event subscribers did not connect within 10 s")
}

/// Body of `inference-cache demo`: both runs, the live progress, the table and the page.
pub async fn run(args: DemoArgs, server: PolicyServer) -> anyhow::Result<DemoReport> {
    let requests = Arc::new(workload::build(&args.workload()));
    let envoy = if args.no_envoy {
        None
    } else {
        match (
            args.envoy.clone().or_else(find_envoy),
            args.filter_wasm.clone().or_else(find_filter_wasm),
        ) {
            (Some(binary), Some(wasm)) => Some((binary, wasm)),
            _ => None,
        }
    };
    let gateway = match &envoy {
        Some((binary, _)) => format!("Envoy ({}) with the inference-cache filter", binary.display()),
        None if args.no_envoy => "in-process: the filter's routing logic (--no-envoy)".to_owned(),
        None => "in-process: the filter's routing logic (no Envoy binary or filter .wasm found; see docs/demo.md)".to_owned(),
    };
    let board = Arc::new(Mutex::new(Board {
        gateway: gateway.clone(),
        ..Board::default()
    }));
    let (page_addr, page_task) = report::serve_page(args.page_addr, board.clone()).await?;
    let url = format!("http://{page_addr}/");
    println!(
        "inference-cache demo: {} engines, {} requests per run over {}",
        args.engines,
        requests.len(),
        inference_cache_index::format_duration(args.duration)
    );
    println!("gateway: {gateway}");
    println!("results page: {url}");
    if args.open {
        open_browser(&url);
    }

    let runs = [(INFERENCE_CACHE_RUN, true), (ROUND_ROBIN_RUN, false)];
    for (name, with_index) in runs {
        let stats = Arc::new(Mutex::new(RunStats::new(name, requests.len())));
        board.lock().runs.push(stats.clone());
        let fleet = Fleet::start(args.engines, args.engine(), with_index.then_some(server)).await?;
        let mut envoy_gateway = None;
        let target = match (&envoy, with_index) {
            (Some((binary, wasm)), _) => {
                let gateway = EnvoyGateway::start(
                    binary,
                    wasm,
                    &fleet.addrs(),
                    server.grpc_addr,
                    with_index,
                    args.lookup_timeout,
                )
                .await?;
                let unlabelled = if with_index {
                    "NO_REASON_HEADER"
                } else {
                    "ROUND_ROBIN"
                };
                let target = Target::Gateway(gateway.listener(), unlabelled);
                envoy_gateway = Some(gateway);
                target
            }
            (None, true) => Target::InProcess(Arc::new(
                InProcessGateway::inference_cache(
                    fleet.addrs(),
                    server.grpc_addr,
                    args.lookup_timeout,
                )
                .await?,
            )),
            (None, false) => {
                Target::InProcess(Arc::new(InProcessGateway::round_robin(fleet.addrs())))
            }
        };
        let progress = (!args.quiet).then(|| tokio::spawn(show_progress(stats.clone())));
        driver::drive(requests.clone(), target, stats.clone()).await;
        if let Some(progress) = progress {
            progress.abort();
        }
        eprintln!("\r{}", progress_line(&stats.lock().summary()));
        drop(envoy_gateway);
        fleet.stop().await;
    }
    let summaries = {
        let mut board = board.lock();
        board.finished = true;
        board.summaries()
    };
    println!();
    print!("{}", render_table(&summaries));
    if let [ic, rr] = summaries.as_slice() {
        println!(
            "\ninference-cache: hit rate {:.1}% vs {:.1}%, TTFT p50 {:.1}× and p99 {:.1}× lower than round-robin",
            ic.hit_rate * 100.0,
            rr.hit_rate * 100.0,
            rr.ttft_p50_ms / ic.ttft_p50_ms.max(1e-9),
            rr.ttft_p99_ms / ic.ttft_p99_ms.max(1e-9),
        );
    }
    if args.open {
        println!("results page: {url} (Ctrl-C to exit)");
        inference_cache_runtime::termination_signal()?.await;
    }
    page_task.abort();
    Ok(DemoReport {
        gateway,
        runs: summaries,
    })
}

async fn show_progress(stats: Arc<Mutex<RunStats>>) {
    use std::io::Write as _;
    loop {
        let line = progress_line(&stats.lock().summary());
        let mut err = std::io::stderr();
        let _ = write!(err, "\r{line}");
        let _ = err.flush();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn open_browser(url: &str) {
    let opener = if cfg!(target_os = "macos") {
        "open"
    } else {
        "xdg-open"
    };
    if let Err(error) = std::process::Command::new(opener)
        .arg(url)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
    {
        println!("could not run {opener} ({error}); open {url} yourself");
    }
}
