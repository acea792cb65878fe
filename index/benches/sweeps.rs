//! Lookups beside sweeps. A sweep visits everything the index holds: the
//! store's runs (under the store's writer, which lookups never wait for)
//! and the catalog's partitions, scopes, names and replicas, to free what
//! nothing refers to any more. The catalog and the fleet are what lookups
//! read under shared locks; a sweep takes them exclusively only when a
//! read-only pass found something due, so with nothing to free a lookup
//! never waits for one.
//!
//! The index holds the table bench's workload (20,000 entries, two holders
//! per chain) for the lookups, and `PARTITIONS` more partitions (20,000 by
//! default: adapters of another tenant, a few blocks each) held by
//! `PARTITIONS / 10` more replicas, so that the catalog is the size of a
//! large fleet's. One thread looks up for `SECONDS` (3) beside nothing (the
//! baseline, same run), then beside a sweep every `SWEEP_MS` (20; a
//! server sweeps every 10 s, so this packs many sweeps' worth of stalls
//! into one run). Printed: the lookups' p50 / p99 / p99.9 / p99.99 and
//! longest, how many took over 50 µs, and the sweeps' median and longest.
//!
//! Run: `cargo bench -p inference-cache-index --bench sweeps`. Under
//! `cargo test` a small run is a smoke check.

use std::hint::black_box;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use inference_cache_index::{CacheIndex, CacheUpdate, PrefixReport, Reason, SystemClock};

mod support;
use support::{Workload, block_chain, percentile};

/// A lookup counted as held up.
const SLOW_NS: u64 = 50_000;

/// The lookups' latencies (ns, sorted) and the sweeps' durations (µs,
/// sorted; none beside nothing).
struct Run {
    samples: Vec<u64>,
    sweeps: Vec<u64>,
}

/// Lookups on one thread for `time`, beside a sweep every `every` when
/// given.
fn run(index: &CacheIndex, work: &Workload, time: Duration, every: Option<Duration>) -> Run {
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        let stop = &stop;
        let sweeper = every.map(|every| {
            s.spawn(move || {
                let mut sweeps = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(every);
                    let t = Instant::now();
                    black_box(index.sweep());
                    sweeps.push(t.elapsed().as_micros() as u64);
                }
                sweeps.sort_unstable();
                sweeps
            })
        });
        let start = Instant::now();
        let mut samples = Vec::new();
        let mut c = 0;
        while start.elapsed() < time {
            c = (c + 7919) % work.chains.len();
            let r = work.request(c);
            let t = Instant::now();
            let outcome = black_box(index.lookup(&r));
            samples.push(t.elapsed().as_nanos() as u64);
            assert_eq!(outcome.reason, Reason::PrefixMatch);
        }
        stop.store(true, Ordering::Relaxed);
        let sweeps = sweeper.map_or(Vec::new(), |s| s.join().expect("sweeper"));
        samples.sort_unstable();
        Run { samples, sweeps }
    })
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let bench = std::env::args().any(|a| a == "--bench");
    let env = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok());
    let partitions = env("PARTITIONS").unwrap_or(if bench { 20_000 } else { 200 }) as usize;
    let time = Duration::from_secs(env("SECONDS").unwrap_or(if bench { 3 } else { 1 }));
    let every = Duration::from_millis(env("SWEEP_MS").unwrap_or(20));
    let work = Workload::new(20_000, 2);
    let index = CacheIndex::new(std::sync::Arc::new(SystemClock), u64::MAX);
    for u in work.updates() {
        index.ingest(&u);
    }
    let replicas = (partitions / 10).max(1);
    for p in 0..partitions {
        let chain = &work.chains[p % work.chains.len()];
        index.ingest(&CacheUpdate {
            replica_id: format!("other-{}", p % replicas),
            tenant_id: "other".into(),
            model_id: "model".into(),
            hash_scheme: "vllm".into(),
            adapter_id: format!("adapter-{p}"),
            prefixes: vec![PrefixReport {
                chain: block_chain(&chain[..4]),
                ..Default::default()
            }],
            ..Default::default()
        });
    }
    println!(
        "{partitions} more partitions held by {replicas} more replicas; one lookup thread for {time:?}"
    );
    println!(
        "| beside | lookups | p50 | p99 | p99.9 | p99.99 | longest | over 50 µs | sweeps | sweep p50 | longest sweep |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let us = |ns: u64| format!("{:.2} µs", ns as f64 / 1e3);
    for (name, every) in [
        ("nothing".to_string(), None),
        (
            format!("a sweep every {} ms", every.as_millis()),
            Some(every),
        ),
    ] {
        let r = run(&index, &work, time, every);
        assert!(!r.samples.is_empty(), "no lookup ran");
        assert!(every.is_none() || !r.sweeps.is_empty(), "no sweep ran");
        let s = &r.samples;
        let (sweep_p50, sweep_max) = match r.sweeps.as_slice() {
            [] => ("–".to_string(), "–".to_string()),
            all => (
                format!("{} µs", percentile(all, 0.5)),
                format!("{} µs", all[all.len() - 1]),
            ),
        };
        println!(
            "| {name} | {} | {} | {} | {} | {} | {} | {} | {} | {sweep_p50} | {sweep_max} |",
            s.len(),
            us(percentile(s, 0.5)),
            us(percentile(s, 0.99)),
            us(percentile(s, 0.999)),
            us(percentile(s, 0.9999)),
            us(s[s.len() - 1]),
            s.iter().filter(|&&ns| ns > SLOW_NS).count(),
            r.sweeps.len(),
        );
    }
}
