//! The signals that end a process gracefully.

use std::future::Future;

/// Installs the SIGTERM and SIGINT handlers now (Ctrl-C off Unix) and returns
/// a future that resolves when one of them arrives.
///
/// Install it before starting anything: a signal that arrives while the
/// process starts up is then not lost, nor does it kill the process without
/// its shutdown sequence (the server's not-ready delay and drain, the
/// subscriber's goodbye).
pub fn termination_signal() -> std::io::Result<impl Future<Output = ()> + Send + 'static> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut terminate = signal(SignalKind::terminate())?;
        let mut interrupt = signal(SignalKind::interrupt())?;
        Ok(async move {
            tokio::select! {
                _ = terminate.recv() => {}
                _ = interrupt.recv() => {}
            }
        })
    }
    #[cfg(not(unix))]
    {
        Ok(async {
            let _ = tokio::signal::ctrl_c().await;
        })
    }
}
