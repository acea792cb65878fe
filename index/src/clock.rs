//! Wall-clock source for every time rule of the index (freshness, TTL, stats age).
//!
//! The index never calls `SystemTime::now` itself: it asks a [`Clock`], so tests
//! drive time with a [`ManualClock`] instead of sleeping. Readings are
//! milliseconds since the Unix epoch; per-entry timestamps are stored as whole
//! seconds (`u32`, valid until 2106). Reading the clock is one atomic load
//! ([`ManualClock`]) or one `clock_gettime` ([`SystemClock`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A source of wall-clock time in milliseconds since the Unix epoch.
pub trait Clock: Send + Sync + 'static {
    /// Current time, milliseconds since the Unix epoch.
    fn now_ms(&self) -> u64;
}

/// The operating system's wall clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }
}

/// A clock that only moves when told to; clones share one reading.
#[derive(Debug, Clone)]
pub struct ManualClock {
    now_ms: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock reading `start_ms` milliseconds since the Unix epoch.
    pub fn new(start_ms: u64) -> Self {
        Self {
            now_ms: Arc::new(AtomicU64::new(start_ms)),
        }
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        let ms = u64::try_from(by.as_millis()).unwrap_or(u64::MAX);
        self.now_ms.fetch_add(ms, Ordering::SeqCst);
    }

    /// Sets the reading to `ms` milliseconds since the Unix epoch.
    pub fn set_ms(&self, ms: u64) {
        self.now_ms.store(ms, Ordering::SeqCst);
    }
}

impl Default for ManualClock {
    /// Starts at 2026-01-01T00:00:00Z.
    fn default() -> Self {
        Self::new(1_767_225_600_000)
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.now_ms.load(Ordering::SeqCst)
    }
}

/// Milliseconds to the whole seconds stored per entry.
pub(crate) fn ms_to_secs(ms: u64) -> u32 {
    u32::try_from(ms / 1000).unwrap_or(u32::MAX)
}
