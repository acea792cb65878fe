//! Wall-clock source for the `strftime_now` template global.
//!
//! Chat templates such as Llama 3.1's print today's date into the system
//! prompt, so the date is part of the tokens. The registry reads time through
//! [`Clock`] so tests (and parity fixtures) pin it with [`FixedClock`]; the
//! server uses [`SystemClock`]. Implementations must be cheap and thread-safe:
//! the clock is read during rendering, on whatever thread tokenizes.

use chrono::{NaiveDate, NaiveDateTime};

/// Source of the local wall-clock time templates see.
pub trait Clock: Send + Sync {
    /// Current local date and time (Python's `datetime.now()`).
    fn now(&self) -> NaiveDateTime;
}

/// The machine's local clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> NaiveDateTime {
        chrono::Local::now().naive_local()
    }
}

/// A clock that always reads the same instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FixedClock(pub NaiveDateTime);

impl FixedClock {
    /// A fixed clock at the given local date and time; out-of-range parts
    /// fall back to 1970-01-01 00:00:00.
    pub fn from_ymd_hms(
        year: i32,
        month: u32,
        day: u32,
        hour: u32,
        minute: u32,
        second: u32,
    ) -> Self {
        let instant = NaiveDate::from_ymd_opt(year, month, day)
            .and_then(|date| date.and_hms_opt(hour, minute, second))
            .unwrap_or_default();
        Self(instant)
    }
}

impl Clock for FixedClock {
    fn now(&self) -> NaiveDateTime {
        self.0
    }
}
