//! Capped exponential backoff with jitter.

use std::future::IntoFuture;
use std::hash::{BuildHasher as _, Hasher as _};
use std::time::Duration;

/// Capped exponential backoff with "equal jitter": each delay is drawn
/// uniformly from the upper half of the current step, `[step / 2, step]`,
/// and the step doubles after every delay, from `initial` up to `max`.
///
/// The jitter spreads the retries of many clients that lost the same peer at
/// the same moment (a server restart, a NATS outage), so they do not all come
/// back in the same instant; the lower half is never drawn, so a retry loop
/// never spins faster than half its step.
#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    step: Duration,
}

impl Backoff {
    /// A backoff whose first delay is at most `initial` and no delay more than `max`.
    pub fn new(initial: Duration, max: Duration) -> Self {
        Self {
            initial,
            max: max.max(initial),
            step: initial,
        }
    }

    /// Back to the first step, after a success.
    pub fn reset(&mut self) {
        self.step = self.initial;
    }

    /// The step the next delay is drawn from (its upper bound).
    pub fn step(&self) -> Duration {
        self.step
    }

    /// The delay to wait now, drawn from the current step, which then doubles
    /// (up to the cap).
    pub fn next_delay(&mut self) -> Duration {
        let delay = jittered(self.step, random_fraction());
        self.step = self.step.saturating_mul(2).min(self.max);
        delay
    }

    /// Sleeps [`Self::next_delay`], or until `stop` completes, whichever is first.
    pub async fn wait<F: IntoFuture>(&mut self, stop: F) {
        let delay = self.next_delay();
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            _ = stop => {}
        }
    }
}

/// `step / 2 + fraction * step / 2`, `fraction` in `[0, 1)`.
fn jittered(step: Duration, fraction: f64) -> Duration {
    let half = step / 2;
    half + half.mul_f64(fraction.clamp(0.0, 1.0))
}

/// A uniform draw from `[0, 1)`. Not for cryptography: the keys std draws for
/// each `RandomState` (random per thread, then incremented) through SipHash.
fn random_fraction() -> f64 {
    let bits = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    // The top 53 bits, as many as an f64 holds exactly.
    (bits >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_stay_in_the_upper_half_of_a_step_that_doubles_up_to_the_cap() {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_millis(700));
        let steps = [100, 200, 400, 700, 700];
        for step in steps {
            let step = Duration::from_millis(step);
            assert_eq!(backoff.step(), step);
            let delay = backoff.next_delay();
            assert!(delay >= step / 2 && delay <= step, "{delay:?} for {step:?}");
        }
        backoff.reset();
        assert_eq!(backoff.step(), Duration::from_millis(100));
    }

    #[test]
    fn jitter_spans_the_upper_half() {
        let step = Duration::from_millis(100);
        assert_eq!(jittered(step, 0.0), Duration::from_millis(50));
        assert_eq!(jittered(step, 0.5), Duration::from_millis(75));
        assert!(jittered(step, 0.999_999) <= step);
        let draws: Vec<f64> = (0..64).map(|_| random_fraction()).collect();
        assert!(draws.iter().all(|f| (0.0..1.0).contains(f)));
        // Not one value over and over: the retries of many clients spread.
        assert!(draws.iter().any(|f| (f - draws[0]).abs() > 1e-9));
    }

    #[tokio::test]
    async fn wait_sleeps_unless_stopped_first() {
        let mut backoff = Backoff::new(Duration::from_secs(60), Duration::from_secs(60));
        let started = std::time::Instant::now();
        backoff.wait(std::future::ready(())).await;
        assert!(started.elapsed() < Duration::from_secs(10));

        let mut backoff = Backoff::new(Duration::from_millis(40), Duration::from_millis(40));
        let started = std::time::Instant::now();
        backoff.wait(std::future::pending::<()>()).await;
        assert!(started.elapsed() >= Duration::from_millis(20));
    }
}
