//! Configuration self-check: does the engine cache the way the subscriber assumes?
//!
//! A wrong block size or prefix caching turned off does not fail anything:
//! routing keeps working and the hit rate is silently zero. Two sources are
//! compared with the subscriber's `--block-size`:
//!
//! - the labels of vLLM's `vllm:cache_config_info` gauge on the engine's
//!   metrics page (every `--engine-metrics-url` scrape): `block_size` and
//!   `enable_prefix_caching`; the other labels (`prefix_caching_hash_algo`,
//!   `cache_dtype`, ...) are logged once at debug level. The subscriber
//!   fingerprints blocks from their token ids itself, so the engine's hash
//!   algorithm does not have to match anything;
//! - the `block_size` of every `BlockStored` event (such blocks are dropped
//!   and counted in `blocks_dropped_total{reason="block_size_mismatch"}`).
//!
//! A mismatch sets `inferencecache_subscriber_config_mismatch{field}` to 1
//! (`field` is `block_size`, `enable_prefix_caching` or `event_block_size`),
//! is logged at WARN when it first appears or its text changes, then at most
//! once every ten minutes per field, and makes `/readyz` answer 503 with the
//! mismatch text. A later scrape that agrees clears a page mismatch; an
//! agreeing event clears the event mismatch once no mismatched event has come
//! for a minute. Pages
//! without `vllm:cache_config_info` (SGLang) are not checked.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;

use crate::exposition::Sample;

/// Name of vLLM's cache configuration gauge.
pub const CACHE_CONFIG_INFO: &str = "vllm:cache_config_info";
/// Minimum time between two warnings with the same text for one field.
const WARN_EVERY: Duration = Duration::from_secs(600);
/// How long an `event_block_size` mismatch lasts after its last mismatched event.
const EVENT_HOLD: Duration = Duration::from_secs(60);

/// Every field the check reports on, each a `field` label value.
pub const FIELDS: [&str; 3] = ["block_size", "enable_prefix_caching", "event_block_size"];

/// The cache configuration an engine reports, from `vllm:cache_config_info`'s labels.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct EngineCacheConfig {
    /// Every label, as the engine wrote it.
    pub labels: BTreeMap<String, String>,
}

impl EngineCacheConfig {
    /// The configuration on a parsed page, when the page has one (the first
    /// sample; data-parallel engines repeat the same labels per engine).
    pub fn from_samples(samples: &[Sample]) -> Option<Self> {
        let sample = samples
            .iter()
            .find(|sample| sample.name == CACHE_CONFIG_INFO)?;
        Some(Self {
            labels: sample.labels.iter().cloned().collect(),
        })
    }

    /// `block_size`, when present and numeric.
    pub fn block_size(&self) -> Option<u32> {
        self.labels.get("block_size")?.trim().parse().ok()
    }

    /// `enable_prefix_caching` (`True` / `False`), when present.
    pub fn prefix_caching(&self) -> Option<bool> {
        let value = self.labels.get("enable_prefix_caching")?.trim();
        if value.eq_ignore_ascii_case("true") || value == "1" {
            Some(true)
        } else if value.eq_ignore_ascii_case("false") || value == "0" {
            Some(false)
        } else {
            None
        }
    }

    /// Mismatches against the subscriber's block size, field → text.
    pub fn mismatches(&self, block_size: u32) -> Vec<(&'static str, String)> {
        let mut out = Vec::new();
        if let Some(engine) = self.block_size()
            && engine != block_size
        {
            out.push((
                "block_size",
                format!(
                    "the engine's block_size is {engine} (vllm:cache_config_info) but the subscriber's --block-size is {block_size}; set both (and the server's --engine-block-size) to {engine}"
                ),
            ));
        }
        if self.prefix_caching() == Some(false) {
            out.push((
                "enable_prefix_caching",
                "the engine runs with prefix caching disabled (vllm:cache_config_info enable_prefix_caching=\"False\"): nothing it caches is reused".to_owned(),
            ));
        }
        out
    }
}

#[derive(Debug)]
struct Entry {
    text: String,
    /// When the mismatch was last observed.
    seen_at: Instant,
}

#[derive(Debug, Default)]
struct State {
    current: BTreeMap<&'static str, Entry>,
    /// Per field, the last warning's text and time; kept across resolutions
    /// so a mismatch that comes and goes does not flood the log.
    warned: BTreeMap<&'static str, (String, Instant)>,
}

/// The current mismatches, shared by the scraper, the trackers and `/readyz`.
#[derive(Debug)]
pub struct ConfigCheck {
    gauge: Family<[(&'static str, &'static str); 1], Gauge>,
    state: Mutex<State>,
    /// Cheap hot-path flag: an `event_block_size` mismatch is set.
    event_mismatch: AtomicBool,
    /// How long an `event_block_size` mismatch outlives its last mismatched
    /// event (engines behind one subscriber that disagree must not flap).
    event_hold: Duration,
    /// The engine configuration last seen, logged when it changes.
    last_config: Mutex<Option<EngineCacheConfig>>,
}

impl ConfigCheck {
    /// A check reporting through `gauge` (every field starts at 0).
    pub fn new(gauge: Family<[(&'static str, &'static str); 1], Gauge>) -> Self {
        Self::with_event_hold(gauge, EVENT_HOLD)
    }

    fn with_event_hold(
        gauge: Family<[(&'static str, &'static str); 1], Gauge>,
        event_hold: Duration,
    ) -> Self {
        for field in FIELDS {
            gauge.get_or_create(&[("field", field)]).set(0);
        }
        Self {
            gauge,
            state: Mutex::new(State::default()),
            event_mismatch: AtomicBool::new(false),
            event_hold,
            last_config: Mutex::new(None),
        }
    }

    /// Compares a scraped page's cache configuration with `block_size`.
    /// Returns the configuration found, if any.
    pub fn check_page(&self, samples: &[Sample], block_size: u32) -> Option<EngineCacheConfig> {
        let config = EngineCacheConfig::from_samples(samples)?;
        {
            let mut last = self
                .last_config
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if last.as_ref() != Some(&config) {
                tracing::info!(labels = ?config.labels, "engine cache configuration");
                *last = Some(config.clone());
            }
        }
        let found = config.mismatches(block_size);
        for field in ["block_size", "enable_prefix_caching"] {
            match found.iter().find(|(name, _)| *name == field) {
                Some((_, text)) => self.set(field, text),
                None => self.clear(field),
            }
        }
        Some(config)
    }

    /// A `BlockStored` event reported `seen` tokens per block; the
    /// subscriber expects `expected`. One atomic load when they agree and
    /// no mismatch is set; an agreeing event clears the mismatch once no
    /// mismatched event has come for a minute.
    pub fn event_block_size(&self, seen: u32, expected: u32) {
        const FIELD: &str = "event_block_size";
        if seen == expected {
            if self.event_mismatch.load(Ordering::Relaxed) {
                let quiet = self
                    .lock()
                    .current
                    .get(FIELD)
                    .is_none_or(|entry| entry.seen_at.elapsed() >= self.event_hold);
                if quiet {
                    self.event_mismatch.store(false, Ordering::Relaxed);
                    self.clear(FIELD);
                }
            }
            return;
        }
        self.event_mismatch.store(true, Ordering::Relaxed);
        self.set(
            FIELD,
            &format!(
                "BlockStored events carry block_size {seen} but the subscriber's --block-size is {expected}; their blocks are dropped"
            ),
        );
    }

    /// The current mismatch texts, one per field; empty when all agree.
    pub fn mismatches(&self) -> Vec<(&'static str, String)> {
        self.lock()
            .current
            .iter()
            .map(|(field, entry)| (*field, entry.text.clone()))
            .collect()
    }

    fn set(&self, field: &'static str, text: &str) {
        let mut state = self.lock();
        let now = Instant::now();
        let warn = state
            .warned
            .get(field)
            .is_none_or(|(last, at)| last != text || at.elapsed() >= WARN_EVERY);
        if warn {
            tracing::warn!(field, "configuration mismatch: {text}");
            state.warned.insert(field, (text.to_owned(), now));
        }
        match state.current.get_mut(field) {
            Some(entry) => {
                entry.seen_at = now;
                if entry.text != text {
                    entry.text = text.to_owned();
                }
            }
            None => {
                state.current.insert(
                    field,
                    Entry {
                        text: text.to_owned(),
                        seen_at: now,
                    },
                );
            }
        }
        self.gauge.get_or_create(&[("field", field)]).set(1);
    }

    fn clear(&self, field: &'static str) {
        if self.lock().current.remove(field).is_some() {
            tracing::info!(field, "configuration mismatch resolved");
        }
        self.gauge.get_or_create(&[("field", field)]).set(0);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exposition::parse_exposition;
    use crate::metrics::Metrics;

    const MATCHING: &str = r#"# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",gpu_memory_utilization="0.9",prefix_caching_hash_algo="sha256"} 1.0
vllm:num_requests_running{engine="0",model_name="m"} 0.0
"#;
    const MISMATCHING: &str = r#"vllm:cache_config_info{block_size="32",cache_dtype="auto",enable_prefix_caching="False",gpu_memory_utilization="0.9",prefix_caching_hash_algo="sha256"} 1.0
"#;

    fn samples(page: &str) -> Vec<Sample> {
        parse_exposition(page).samples
    }

    #[test]
    fn labels_are_read() {
        let config = EngineCacheConfig::from_samples(&samples(MATCHING)).expect("a config");
        assert_eq!(config.block_size(), Some(16));
        assert_eq!(config.prefix_caching(), Some(true));
        assert_eq!(
            config
                .labels
                .get("prefix_caching_hash_algo")
                .map(String::as_str),
            Some("sha256")
        );
        assert!(config.mismatches(16).is_empty());
        assert_eq!(
            EngineCacheConfig::from_samples(&samples("sglang:num_queue_reqs 0\n")),
            None
        );
    }

    #[test]
    fn matching_page_reports_nothing_and_mismatching_page_every_field() {
        let metrics = Metrics::new();
        let check = &metrics.config_check;
        assert!(check.check_page(&samples(MATCHING), 16).is_some());
        assert!(check.mismatches().is_empty());
        for field in FIELDS {
            assert_eq!(
                metrics.sample(&format!(
                    "inferencecache_subscriber_config_mismatch{{field=\"{field}\"}}"
                )),
                Some(0.0),
                "{field}"
            );
        }

        check.check_page(&samples(MISMATCHING), 16);
        let found = check.mismatches();
        let fields: Vec<_> = found.iter().map(|(field, _)| *field).collect();
        assert_eq!(fields, vec!["block_size", "enable_prefix_caching"]);
        assert!(found[0].1.contains("block_size is 32"), "{}", found[0].1);
        assert_eq!(
            metrics.sample("inferencecache_subscriber_config_mismatch{field=\"block_size\"}"),
            Some(1.0)
        );
        assert_eq!(
            metrics.sample(
                "inferencecache_subscriber_config_mismatch{field=\"enable_prefix_caching\"}"
            ),
            Some(1.0)
        );

        // The engine restarted with the right configuration.
        check.check_page(&samples(MATCHING), 16);
        assert!(check.mismatches().is_empty());
        assert_eq!(
            metrics.sample("inferencecache_subscriber_config_mismatch{field=\"block_size\"}"),
            Some(0.0)
        );
    }

    #[test]
    fn event_block_sizes_are_checked() {
        let metrics = Metrics::new();
        let check = &metrics.config_check;
        check.event_block_size(32, 16);
        check.event_block_size(16, 16);
        assert_eq!(check.mismatches().len(), 1, "held after an agreeing event");

        let gauge = Family::<[(&'static str, &'static str); 1], Gauge>::default();
        let check = ConfigCheck::with_event_hold(gauge.clone(), Duration::ZERO);
        let value = || gauge.get_or_create(&[("field", "event_block_size")]).get();
        check.event_block_size(16, 16);
        assert!(check.mismatches().is_empty());
        check.event_block_size(32, 16);
        check.event_block_size(32, 16);
        assert_eq!(check.mismatches().len(), 1);
        assert_eq!(value(), 1);
        check.event_block_size(16, 16);
        assert!(check.mismatches().is_empty());
        assert_eq!(value(), 0);
    }
}
