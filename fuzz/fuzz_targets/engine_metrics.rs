//! An engine's Prometheus metrics page as the subscriber scrapes it
//! (`--engine-metrics-url`): text exposition → load reading → `ReplicaStats`,
//! and the cache-configuration self-check over the same samples.
#![no_main]

use inference_cache_subscriber::selfcheck::EngineCacheConfig;
use inference_cache_subscriber::{EngineReading, LoadEstimator, parse_exposition};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let page = parse_exposition(text);
    let reading = EngineReading::from_samples(&page.samples);
    // Two scrapes of the same page: the second exercises the counter deltas.
    let mut estimator = LoadEstimator::new();
    for _ in 0..2 {
        if let Some(load) = estimator.next(&reading) {
            // Whatever the page says, what reaches the server is in range.
            for fraction in [load.kv_cache_usage, load.hit_rate, load.pressure] {
                assert!(
                    (0.0..=1.0).contains(&fraction),
                    "fraction out of range: {load:?}"
                );
            }
            let _ = load.to_stats("fuzz");
        }
    }
    if let Some(config) = EngineCacheConfig::from_samples(&page.samples) {
        let _ = config.block_size();
        let _ = config.prefix_caching();
        let _ = config.mismatches(16);
    }
});
