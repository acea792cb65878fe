//! `inference-cache replay`: evaluate routing policies on your own traffic
//! before deploying them.
//!
//! A trace (Mooncake JSONL, or the built-in [`synthetic`](generate) generator)
//! is replayed through each [`Policy`] over N simulated replicas, each with an
//! LRU prefix-block cache and a FIFO prefill model; the result is one
//! [`PolicyResult`] row per policy — block and token hit rate, ratio to a
//! pooled-cache oracle, modelled TTFT mean / p50 / p99, and requests and
//! prefill tokens per replica. The `inference-cache` rows route through the
//! real index and ranker (in-process, or a running server over gRPC), fed with
//! admissions, evictions and load exactly as the engine subscriber would.
//!
//! Main types:
//! - [`ReplayArgs`] → [`ReplaySettings`]: the CLI flags, validated once;
//!   [`run`] is the subcommand.
//! - [`Trace`] / [`Request`]: requests with per-block prefix hashes.
//! - [`SimConfig`], [`simulate`], [`replay_trace`], [`replay_trace_remote`]: the simulation.
//! - [`render_table`], [`render_json`], [`render_svg`]: output.
//!
//! ```
//! use inference_cache_replay::*;
//!
//! let trace = generate(&SyntheticConfig { requests: 200, sessions: 20, ..Default::default() });
//! let config = SimConfig::new(4, 500);
//! let policies = [Policy::InferenceCache, Policy::RoundRobin, Policy::PooledOracle];
//! let results = replay_trace(&trace, &policies, &config, &Default::default()).unwrap();
//! assert_eq!(results.len(), 3);
//! assert!(results.iter().all(|r| r.requests == 200));
//! assert_eq!(results[2].oracle_ratio, Some(1.0));
//! ```
//!
//! See `docs/replay.md` for the simulation model and every flag.

mod args;
mod chat;
mod error;
mod inprocess;
mod lru;
mod policy;
mod progress;
mod remote;
mod replica;
mod report;
mod rng;
mod routed;
mod sim;
mod svg;
mod synthetic;
mod trace;

use std::io::BufReader;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

pub use args::{ReplayArgs, ReplaySettings, Source};
pub use chat::{ChatConfig, DEFAULT_CHAT_REQUESTS, MAX_CONTEXT_TOKENS, generate_chat};
pub use error::{ReplayError, TraceError};
pub use inprocess::InProcess;
pub use lru::BlockLru;
pub use policy::{Policy, RouteContext, Router};
pub use replica::{Load, Replica, Served, ServingModel};
pub use report::{RunInfo, format_ms, render_json, render_table};
pub use routed::{Answer, Backend, HASH_SCHEME, IndexRouter, MODEL, ReportAt, TENANT, replica_id};
pub use sim::{
    DEFAULT_PREFILL_TPS, DEFAULT_REFRESH_INTERVAL_MS, DEFAULT_STATS_INTERVAL_MS, DEFAULT_TPOT_MS,
    PolicyResult, ReasonShare, SimConfig, Spread, TtftSummary, fill_oracle_ratios, policies_for,
    simulate, simulate_with,
};
pub use svg::render_svg;
pub use synthetic::{SyntheticConfig, generate};
pub use trace::{DEFAULT_TRACE_BLOCK_SIZE, Request, Trace};

use inference_cache_index::PolicySet;
use progress::Progress;
use remote::Remote;

/// Replays `trace` through every policy in `policies` with the in-process
/// index, in parallel, and fills the oracle ratios.
pub fn replay_trace(
    trace: &Trace,
    policies: &[Policy],
    config: &SimConfig,
    policy_set: &PolicySet,
) -> Result<Vec<PolicyResult>, ReplayError> {
    run_rows(trace, policies, config, policy_set, None, None)
}

/// Runs the rows on up to `available_parallelism` threads; results in `policies` order.
fn run_rows(
    trace: &Trace,
    policies: &[Policy],
    config: &SimConfig,
    policy_set: &PolicySet,
    remote: Option<Remote>,
    progress: Option<&AtomicU64>,
) -> Result<Vec<PolicyResult>, ReplayError> {
    let remote = Mutex::new(remote);
    let next = AtomicUsize::new(0);
    let slots: Vec<Mutex<Option<Result<PolicyResult, ReplayError>>>> =
        policies.iter().map(|_| Mutex::new(None)).collect();
    let workers = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(policies.len());
    std::thread::scope(|scope| {
        for _ in 0..workers {
            scope.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&policy) = policies.get(i) else {
                        break;
                    };
                    let taken = if policy == Policy::InferenceCache {
                        remote.lock().ok().and_then(|mut r| r.take())
                    } else {
                        None
                    };
                    let result = match taken {
                        Some(backend) => {
                            let mut router = IndexRouter::new(backend, config);
                            simulate_with(trace, policy, config, &mut router, progress)
                        }
                        None => simulate(trace, policy, config, policy_set, progress),
                    };
                    if let Ok(mut slot) = slots[i].lock() {
                        *slot = Some(result);
                    }
                }
            });
        }
    });
    let mut results = Vec::with_capacity(policies.len());
    for (slot, policy) in slots.into_iter().zip(policies) {
        let result = slot
            .into_inner()
            .ok()
            .flatten()
            .ok_or_else(|| ReplayError::Setting {
                flag: "policies",
                reason: format!("the {policy} row did not finish"),
            })?;
        results.push(result?);
    }
    fill_oracle_ratios(&mut results);
    Ok(results)
}

/// Loads (or generates) the trace `settings` name.
pub fn load_trace(settings: &ReplaySettings) -> Result<Trace, ReplayError> {
    match &settings.source {
        Source::Synthetic(config) => Ok(generate(config)),
        Source::Chat(config) => generate_chat(config),
        Source::File {
            path,
            block_size,
            limit,
        } => {
            let file = std::fs::File::open(path).map_err(|error| ReplayError::Io {
                path: path.clone(),
                error,
            })?;
            let mut trace =
                Trace::from_jsonl(BufReader::new(file), *block_size).map_err(|error| {
                    ReplayError::Trace {
                        path: path.clone(),
                        error,
                    }
                })?;
            if let Some(limit) = limit {
                trace.requests.truncate(*limit);
            }
            Ok(trace)
        }
    }
}

fn run_info(settings: &ReplaySettings, trace: &Trace) -> RunInfo {
    let source = match &settings.source {
        Source::File { path, .. } => path.display().to_string(),
        Source::Synthetic(c) => format!("synthetic (seed {})", c.seed),
        Source::Chat(c) => format!(
            "chat workload (seed {}) rendered for {}, {}",
            c.seed,
            c.model,
            if c.tools {
                "with tools"
            } else {
                "tools as text"
            }
        ),
    };
    RunInfo {
        source,
        requests: trace.requests.len() as u64,
        blocks: trace.total_blocks(),
        block_size: trace.block_size,
        replicas: settings.sim.replicas,
        capacity_blocks: settings.sim.capacity_blocks,
        prefill_tps: settings.sim.model.prefill_tps,
        tpot_ms: settings.sim.model.tpot_ms,
        speedup: settings.sim.speedup,
        stats_interval_ms: settings.sim.stats_interval_ms,
        report_at: match settings.sim.report_at {
            ReportAt::Routing => "routing",
            ReportAt::PrefillEnd => "prefill-end",
        },
        refresh_interval_ms: settings.sim.refresh_interval_ms,
        index: settings
            .server
            .clone()
            .unwrap_or_else(|| "in-process".into()),
    }
}

fn write_file(path: &std::path::Path, contents: &[u8]) -> Result<(), ReplayError> {
    std::fs::write(path, contents).map_err(|error| ReplayError::Io {
        path: path.to_owned(),
        error,
    })
}

/// Replays `trace` with the `inference-cache` row routed through the server
/// at `endpoint` over gRPC (the other rows as [`replay_trace`]); the replay's
/// replicas are cleared on the server before and after. Must be called within
/// a Tokio runtime; the replay itself runs on a blocking thread.
pub async fn replay_trace_remote(
    trace: Trace,
    policies: Vec<Policy>,
    config: SimConfig,
    endpoint: &str,
) -> Result<Vec<PolicyResult>, ReplayError> {
    let remote = Remote::connect(endpoint).await?;
    let work = tokio::task::spawn_blocking(move || {
        replay_loaded(
            &trace,
            &policies,
            &config,
            &PolicySet::default(),
            Some(remote),
            None,
        )
    });
    join(work).await?
}

/// Clears the remote replicas, then runs the rows.
fn replay_loaded(
    trace: &Trace,
    policies: &[Policy],
    config: &SimConfig,
    policy_set: &PolicySet,
    mut remote: Option<Remote>,
    progress: Option<&AtomicU64>,
) -> Result<Vec<PolicyResult>, ReplayError> {
    if let Some(remote) = remote.as_mut() {
        let ids: Vec<String> = (0..config.replicas).map(replica_id).collect();
        remote.clear(&ids)?;
    }
    run_rows(trace, policies, config, policy_set, remote, progress)
}

/// Waits for a blocking task, re-raising its panic.
async fn join<T>(task: tokio::task::JoinHandle<T>) -> Result<T, ReplayError> {
    match task.await {
        Ok(value) => Ok(value),
        Err(error) => match error.try_into_panic() {
            Ok(panic) => std::panic::resume_unwind(panic),
            Err(error) => Err(ReplayError::Setting {
                flag: "trace",
                reason: format!("the replay was cancelled: {error}"),
            }),
        },
    }
}

/// `inference-cache replay`: validates the flags, replays, prints the table
/// (or JSON) on stdout and writes the optional SVG and trace dump.
pub async fn run(args: ReplayArgs) -> Result<(), ReplayError> {
    let settings = args.resolve()?;
    let remote = match &settings.server {
        Some(url) => Some(Remote::connect(url).await?),
        None => None,
    };
    let work = tokio::task::spawn_blocking(move || -> Result<_, ReplayError> {
        let trace = load_trace(&settings)?;
        if let Some(path) = &settings.dump_trace {
            let mut out = Vec::new();
            trace
                .write_jsonl(&mut out)
                .map_err(|error| ReplayError::Io {
                    path: path.clone(),
                    error,
                })?;
            write_file(path, &out)?;
        }
        let progress =
            Progress::start(trace.requests.len() as u64 * settings.policies.len() as u64);
        let results = replay_loaded(
            &trace,
            &settings.policies,
            &settings.sim,
            &settings.policy_set,
            remote,
            Some(progress.counter()),
        );
        progress.finish();
        Ok((run_info(&settings, &trace), results?, settings))
    });
    let (info, results, settings) = join(work).await??;
    if settings.json {
        println!("{}", render_json(&info, &results));
    } else {
        print!("{}", render_table(&info, &results));
    }
    if let Some(path) = &settings.plot {
        let title = format!(
            "{} — {} replicas × {} blocks, speedup {}",
            info.source, info.replicas, info.capacity_blocks, info.speedup
        );
        write_file(path, render_svg(&title, &results).as_bytes())?;
        eprintln!("plot written to {}", path.display());
    }
    Ok(())
}
