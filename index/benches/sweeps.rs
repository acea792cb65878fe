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
//! into one run), then beside a flood of `PARTITIONS` adapters of a third
//! tenant reported, cleared and swept every `SWEEP_MS` (every sweep frees
//! them all). Printed: the lookups' p50 / p99 / p99.9 / p99.99 and
//! longest, how many took over 50 µs, the sweeps' median and longest, and
//! the p99.9 and longest of the lookups that overlapped a sweep.
//!
//! Run: `cargo bench -p inference-cache-index --bench sweeps`. Under
//! `cargo test` a small run is a smoke check.

use std::hint::black_box;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use inference_cache_index::{
    CacheEvent, CacheIndex, CacheUpdate, EventKind, PrefixReport, Reason, SystemClock,
};

mod support;
use support::{Workload, block_chain, percentile};

/// A lookup counted as held up.
const SLOW_NS: u64 = 50_000;

/// The lookups' latencies (ns, sorted), the sweeps' durations (µs,
/// sorted; none beside nothing), and the lookups that ran while a sweep
/// did (ns, sorted).
struct Run {
    samples: Vec<u64>,
    sweeps: Vec<u64>,
    during: Vec<u64>,
}

/// What runs beside the lookups.
#[derive(Clone, Copy)]
enum Beside {
    Nothing,
    /// A sweep every so often, with nothing new to free.
    Sweeps(Duration),
    /// Every so often a flood of `usize` adapters (partitions, names and
    /// replicas) is reported and cleared, and then a sweep frees it.
    Floods(Duration, usize),
}

/// Lookups on one thread for `time`, beside `beside`.
fn run(index: &CacheIndex, work: &Workload, time: Duration, beside: Beside) -> Run {
    let stop = AtomicBool::new(false);
    let origin = Instant::now();
    let since = |t: Instant| t.duration_since(origin).as_nanos() as u64;
    std::thread::scope(|s| {
        let stop = &stop;
        let sweeper = match beside {
            Beside::Nothing => None,
            Beside::Sweeps(every) | Beside::Floods(every, _) => Some(s.spawn(move || {
                // (start, end) of each sweep, ns since `origin`.
                let mut sweeps = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    if let Beside::Floods(_, n) = beside {
                        flood(index, work, "flood", n);
                        clear(index, "flood", n);
                    }
                    std::thread::sleep(every);
                    let t = Instant::now();
                    black_box(index.sweep());
                    sweeps.push((since(t), since(Instant::now())));
                }
                sweeps
            })),
        };
        let start = Instant::now();
        let mut timed = Vec::new();
        let mut c = 0;
        while start.elapsed() < time {
            c = (c + 7919) % work.chains.len();
            let r = work.request(c);
            let t = Instant::now();
            let outcome = black_box(index.lookup(&r));
            let end = Instant::now();
            timed.push((since(t), (end - t).as_nanos() as u64));
            assert_eq!(outcome.reason, Reason::PrefixMatch);
        }
        stop.store(true, Ordering::Relaxed);
        let windows = sweeper.map_or(Vec::new(), |s| s.join().expect("sweeper"));
        // A lookup ran during a sweep when their spans overlap (both lists
        // are in time order).
        let mut during = Vec::new();
        let mut w = 0;
        for &(at, ns) in &timed {
            while w < windows.len() && windows[w].1 < at {
                w += 1;
            }
            if w < windows.len() && windows[w].0 <= at + ns {
                during.push(ns);
            }
        }
        let mut samples: Vec<u64> = timed.iter().map(|&(_, ns)| ns).collect();
        let mut sweeps: Vec<u64> = windows.iter().map(|&(a, b)| (b - a) / 1_000).collect();
        samples.sort_unstable();
        sweeps.sort_unstable();
        during.sort_unstable();
        Run {
            samples,
            sweeps,
            during,
        }
    })
}

/// `n` partitions of `tenant` (an adapter each, a few blocks) held by
/// `n / 10` replicas of their own.
fn flood(index: &CacheIndex, work: &Workload, tenant: &str, n: usize) {
    let replicas = (n / 10).max(1);
    for p in 0..n {
        let chain = &work.chains[p % work.chains.len()];
        index.ingest(&CacheUpdate {
            replica_id: format!("{tenant}-{}", p % replicas),
            tenant_id: tenant.into(),
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
}

/// Every replica of a [`flood`] flushes its cache: the next sweep frees
/// what the flood added.
fn clear(index: &CacheIndex, tenant: &str, n: usize) {
    for r in 0..(n / 10).max(1) {
        index.publish(&CacheEvent {
            kind: EventKind::AllCleared,
            replica_id: format!("{tenant}-{r}"),
            model_id: String::new(),
            tenant_id: String::new(),
            prefix_hash: Vec::new(),
            adapter_id: String::new(),
        });
    }
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let bench = std::env::args().any(|a| a == "--bench");
    let partitions = support::env_number("PARTITIONS", if bench { 20_000 } else { 200 });
    let time = Duration::from_secs(support::env_number("SECONDS", if bench { 3 } else { 1 }));
    let every = Duration::from_millis(support::env_number("SWEEP_MS", 20));
    let work = Workload::new(20_000, 2);
    let index = CacheIndex::new(std::sync::Arc::new(SystemClock), u64::MAX);
    for u in work.updates() {
        index.ingest(&u);
    }
    flood(&index, &work, "other", partitions);
    println!(
        "{partitions} more partitions held by {} more replicas; one lookup thread for {time:?}",
        (partitions / 10).max(1)
    );
    println!(
        "| beside | lookups | p50 | p99 | p99.9 | p99.99 | longest | over 50 µs | sweeps | sweep p50 | longest sweep | lookups during a sweep | their p99.9 | their longest |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let us = |ns: u64| format!("{:.2} µs", ns as f64 / 1e3);
    for (name, beside) in [
        ("nothing".to_string(), Beside::Nothing),
        (
            format!("a sweep every {} ms", every.as_millis()),
            Beside::Sweeps(every),
        ),
        (
            format!(
                "a flood of {partitions} adapters reported, cleared and swept, every {} ms",
                every.as_millis()
            ),
            Beside::Floods(every, partitions),
        ),
    ] {
        let r = run(&index, &work, time, beside);
        assert!(!r.samples.is_empty(), "no lookup ran");
        assert!(
            matches!(beside, Beside::Nothing) || !r.sweeps.is_empty(),
            "no sweep ran"
        );
        let s = &r.samples;
        let or_dash = |all: &[u64], f: &dyn Fn(&[u64]) -> String| {
            if all.is_empty() {
                "–".to_string()
            } else {
                f(all)
            }
        };
        let d = &r.during;
        println!(
            "| {name} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            s.len(),
            us(percentile(s, 0.5)),
            us(percentile(s, 0.99)),
            us(percentile(s, 0.999)),
            us(percentile(s, 0.9999)),
            us(s[s.len() - 1]),
            s.iter().filter(|&&ns| ns > SLOW_NS).count(),
            r.sweeps.len(),
            or_dash(&r.sweeps, &|a| format!("{} µs", percentile(a, 0.5))),
            or_dash(&r.sweeps, &|a| format!("{} µs", a[a.len() - 1])),
            d.len(),
            or_dash(d, &|a| us(percentile(a, 0.999))),
            or_dash(d, &|a| us(a[a.len() - 1])),
        );
    }
}
