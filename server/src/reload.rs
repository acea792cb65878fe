//! Reloading configuration files while serving: a file (or a directory of
//! files) is re-read when it changes on disk and on SIGHUP.
//!
//! Change notifications come from `notify`; bursts (editors write in several
//! steps) are collapsed into one reload. The reload callback decides what a
//! bad edit means — every caller keeps its last good value.
//!
//! A watched file is watched through its directory, and any change in that
//! directory re-reads the file's contents (following symlinks); the reload
//! runs only when those contents differ from the last ones seen. That covers
//! an edit in place, a replace-by-rename, and a Kubernetes ConfigMap volume,
//! where the kubelet never touches `policy.yaml` (a symlink to
//! `..data/policy.yaml`) but writes a new timestamped directory and renames a
//! `..data_tmp` symlink over `..data`. Reading the file costs one read per
//! burst of events in its directory and keeps one copy of it in memory; SIGHUP always reloads.

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
    // A directory reloads on any change; a file only when its contents moved.
    let watch_contents = !path.is_dir();
    let mut last_seen = watch_contents.then(|| contents(&path));
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
                    if let Some(last) = last_seen.as_mut() {
                        let now = contents(&path);
                        if now == *last {
                            continue;
                        }
                        *last = now;
                    }
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

/// A file's contents read through any symlinks (configuration files are
/// small, so the bytes themselves are kept for comparison); `None` when it
/// cannot be read (missing mid-swap, permissions), which counts as a change
/// once it becomes readable again.
fn contents(path: &Path) -> Option<Vec<u8>> {
    std::fs::read(path).ok()
}

/// Watches a directory, or a file through its parent directory: every entry
/// of that directory counts, because the file may be a symlink through
/// `..data` that changes without an event naming the file.
fn watch(
    path: &Path,
    what: &'static str,
    tx: UnboundedSender<()>,
) -> Option<notify::RecommendedWatcher> {
    let dir = if path.is_dir() {
        path.to_path_buf()
    } else {
        match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        }
    };
    let handler = move |event: notify::Result<notify::Event>| {
        if let Ok(event) = event
            && !event.kind.is_access()
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
