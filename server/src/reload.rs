//! Reloading configuration files while serving: a file (or a directory of
//! files) is re-read when it changes on disk and on SIGHUP.
//!
//! Change notifications come from `notify`; bursts (editors write in several
//! steps) are collapsed into one reload. The reload callback decides what a
//! bad edit means — every caller keeps its last good value.

use std::path::{Path, PathBuf};
use std::time::Duration;

use notify::Watcher as _;
use tokio::sync::mpsc::{UnboundedSender, unbounded_channel};
use tokio_util::sync::CancellationToken;

/// How long a burst of change events may last before the reload runs.
const SETTLE: Duration = Duration::from_millis(100);

/// Calls `reload` whenever `path` changes and on SIGHUP, until `shutdown`.
/// `what` names the watched thing in logs ("policy file", "templates").
pub fn spawn_reloader(
    path: PathBuf,
    what: &'static str,
    shutdown: CancellationToken,
    reload: impl Fn() + Send + 'static,
) {
    let (tx, mut rx) = unbounded_channel::<()>();
    let watcher = watch(&path, what, tx);
    tokio::spawn(async move {
        let _watcher = watcher;
        let mut hangup =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
        loop {
            let hup = async {
                match hangup.as_mut() {
                    Some(signal) => signal.recv().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = shutdown.cancelled() => break,
                Some(()) = rx.recv() => {
                    tokio::time::sleep(SETTLE).await;
                    while rx.try_recv().is_ok() {}
                    reload();
                }
                _ = hup => {
                    tracing::info!("SIGHUP: reloading the {what}");
                    reload();
                }
            }
        }
    });
}

/// Watches a directory (any entry changing) or a file (through its parent
/// directory, so replace-by-rename edits are seen).
fn watch(
    path: &Path,
    what: &'static str,
    tx: UnboundedSender<()>,
) -> Option<notify::RecommendedWatcher> {
    let (dir, name) = if path.is_dir() {
        (path.to_path_buf(), None)
    } else {
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        (dir, path.file_name().map(|n| n.to_owned()))
    };
    let handler = move |event: notify::Result<notify::Event>| {
        if let Ok(event) = event
            && !event.kind.is_access()
            && name
                .as_ref()
                .is_none_or(|name| event.paths.iter().any(|p| p.file_name() == Some(name)))
        {
            let _ = tx.send(());
        }
    };
    let watched = notify::recommended_watcher(handler).and_then(|mut watcher| {
        watcher.watch(&dir, notify::RecursiveMode::NonRecursive)?;
        Ok(watcher)
    });
    match watched {
        Ok(watcher) => Some(watcher),
        Err(error) => {
            tracing::warn!(dir = %dir.display(), %error, "cannot watch the {what}; SIGHUP still reloads it");
            None
        }
    }
}
