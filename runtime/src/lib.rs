//! Async plumbing shared by the policy server, the KV-event subscriber, the
//! demo and the `inference-cache` binary:
//!
//! - [`termination_signal`]: SIGTERM or SIGINT, the start of every graceful
//!   shutdown (`serve`, `subscribe`, the demo's results page);
//! - [`Backoff`]: the capped, jittered exponential backoff of every reconnect
//!   and retry loop (the subscriber's engine sockets and server stream, the
//!   server's shared-log publisher and consumer).

mod backoff;
mod signal;

pub use backoff::Backoff;
pub use signal::termination_signal;
