//! Lookups beside a stream of replica stats reports. Every replica of a
//! fleet reports its load (queue depths, memory pressure) every second or
//! so: a fleet of 5,000 replicas sends 5,000 reports a second, whatever the
//! lookup rate. One thread feeds `STATS_PER_SEC` stats-only updates a second
//! (5,000 by default), round the workload's 8 replicas, while `THREADS`
//! lookup threads (`1,4` by default: four is more than this machine's
//! cores, as a busy server's workers are) each run 200,000 lookups of the
//! table bench's workload (100,000 entries, two holders per chain).
//!
//! The feeder keeps to the rate by the clock, catching up without sleeping
//! when it falls behind; with `FEED_WAIT=sleep` it sleeps one interval
//! after every update instead, as a handler that waits for its stream's
//! next message does (its rate is then the most it can take in that way).
//!
//! Printed for each thread count: the same lookups beside nothing (the
//! baseline, same run), beside the stats reports, and beside as many bare
//! heartbeats (updates with neither blocks nor stats): the updates a second
//! the index took in, each update's ingest time, and the lookups' p50 / p99
//! / p99.9. A stats report from a known member takes the fleet's lock
//! shared, as a heartbeat does, so neither it nor a lookup waits for the
//! other.
//!
//! Run: `cargo bench -p inference-cache-index --bench stats_stream`. Under
//! `cargo test` a small run is a smoke check.

use std::hint::black_box;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use inference_cache_index::{CacheIndex, CacheUpdate, Reason, ReplicaStatsReport, SystemClock};

mod support;
use support::{REPLICAS, Workload, percentile};

/// The lookups' latencies (ns, sorted), and the stats reports a second the
/// feeder got in meanwhile with each one's ingest time (ns, sorted; none
/// without a feeder).
struct Run {
    samples: Vec<u64>,
    reports_per_sec: f64,
    ingests: Vec<u64>,
}

/// What the feeder sends: stats reports, or heartbeats (updates with no
/// blocks and no stats), which have always taken the shared lock.
#[derive(Clone, Copy)]
enum Feed {
    Stats,
    Heartbeats,
}

/// Replica `r`'s `n`th update of the feed: a stats-only update reporting
/// its queue, or a bare heartbeat.
fn report(feed: Feed, r: usize, n: u32) -> CacheUpdate {
    CacheUpdate {
        replica_id: format!("replica-{r}"),
        tenant_id: "tenant".into(),
        model_id: "model".into(),
        hash_scheme: "vllm".into(),
        stats: matches!(feed, Feed::Stats).then_some(ReplicaStatsReport {
            requests_waiting: n % 4,
            requests_running: 1 + n % 3,
            pressure: 0.25,
            hit_rate: 0.5,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// `threads` threads of `lookups` lookups each, beside a feeder of
/// `per_sec` updates a second when there is a feed.
fn run(
    index: &CacheIndex,
    work: &Workload,
    threads: usize,
    lookups: usize,
    feed: Option<(Feed, f64)>,
    sleep_each: bool,
) -> Run {
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        let stop = &stop;
        let feeder = feed.map(|(feed, per_sec)| {
            s.spawn(move || {
                let start = Instant::now();
                let every = Duration::from_secs_f64(1.0 / per_sec);
                let mut sent = 0u32;
                let mut ingests = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let update = report(feed, sent as usize % REPLICAS, sent);
                    let t = Instant::now();
                    index.ingest(&update);
                    ingests.push(t.elapsed().as_nanos() as u64);
                    sent += 1;
                    if sleep_each {
                        std::thread::sleep(every);
                    } else if let Some(wait) = (every * sent).checked_sub(start.elapsed()) {
                        // Paced by the clock, not by sleeps added up.
                        std::thread::sleep(wait);
                    }
                }
                ingests.sort_unstable();
                (f64::from(sent) / start.elapsed().as_secs_f64(), ingests)
            })
        });
        let lookers: Vec<_> = (0..threads)
            .map(|t| {
                s.spawn(move || {
                    let mut c = t * 131;
                    let mut samples = Vec::with_capacity(lookups);
                    for _ in 0..lookups {
                        c = (c + 7919) % work.chains.len();
                        let r = work.request(c);
                        let t = Instant::now();
                        let outcome = black_box(index.lookup(&r));
                        samples.push(t.elapsed().as_nanos() as u64);
                        assert_eq!(outcome.reason, Reason::PrefixMatch);
                    }
                    samples
                })
            })
            .collect();
        let mut samples: Vec<u64> = lookers
            .into_iter()
            .flat_map(|l| l.join().expect("lookup thread"))
            .collect();
        stop.store(true, Ordering::Relaxed);
        let (reports_per_sec, ingests) =
            feeder.map_or((0.0, Vec::new()), |f| f.join().expect("feeder"));
        samples.sort_unstable();
        Run {
            samples,
            reports_per_sec,
            ingests,
        }
    })
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let bench = std::env::args().any(|a| a == "--bench");
    let per_sec = support::env_number("STATS_PER_SEC", 5_000.0f64);
    let sleep_each = std::env::var("FEED_WAIT").is_ok_and(|w| w == "sleep");
    let threads: Vec<usize> = support::env_numbers("THREADS", "1,4");
    let (entries, lookups) = if bench {
        (100_000, 200_000)
    } else {
        (5_000, 2_000)
    };
    let work = Workload::new(entries, 2);
    let index = CacheIndex::new(std::sync::Arc::new(SystemClock), u64::MAX);
    for u in work.updates() {
        index.ingest(&u);
    }
    println!(
        "| lookup threads | beside | asked/s | taken in/s | update ingest p50 | p99 | lookup p50 | p99 | p99.9 |"
    );
    println!("|---:|---|---:|---:|---:|---:|---:|---:|---:|");
    let us = |sorted: &[u64], q: f64| {
        if sorted.is_empty() {
            "–".to_string()
        } else {
            format!("{:.2} µs", percentile(sorted, q) as f64 / 1e3)
        }
    };
    for &n in &threads {
        let feeds = [
            ("nothing", None),
            ("stats reports", Some((Feed::Stats, per_sec))),
            ("heartbeats", Some((Feed::Heartbeats, per_sec))),
        ];
        for (name, feed) in feeds {
            let r = run(&index, &work, n, lookups, feed, sleep_each);
            assert!(
                feed.is_none() || !r.ingests.is_empty(),
                "the feeder sent nothing"
            );
            let asked = feed.map_or("–".into(), |(_, per_sec)| format!("{per_sec:.0}"));
            println!(
                "| {n} | {name} | {asked} | {:.0} | {} | {} | {} | {} | {} |",
                r.reports_per_sec,
                us(&r.ingests, 0.5),
                us(&r.ingests, 0.99),
                us(&r.samples, 0.5),
                us(&r.samples, 0.99),
                us(&r.samples, 0.999),
            );
        }
    }
}
