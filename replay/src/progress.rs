//! A self-drawn progress bar on stderr for long replays: one line redrawn
//! five times a second, from the first second on, from a shared counter of
//! requests replayed (summed over the policies running in parallel). Drawn
//! only when stderr is a terminal; otherwise nothing is printed and no thread
//! is started.

use std::io::{IsTerminal, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A running progress bar; dropping it (or [`Progress::finish`]) erases it.
#[derive(Debug)]
pub struct Progress {
    done: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    drawer: Option<JoinHandle<()>>,
}

impl Progress {
    /// A bar counting to `total`, drawn only if stderr is a terminal.
    pub fn start(total: u64) -> Self {
        let done = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let drawer = std::io::stderr().is_terminal().then(|| {
            let (done, stop) = (done.clone(), stop.clone());
            std::thread::spawn(move || draw_until(&done, &stop, total))
        });
        Self { done, stop, drawer }
    }

    /// The counter the replay advances.
    pub fn counter(&self) -> &AtomicU64 {
        &self.done
    }

    /// Stops drawing and erases the line.
    pub fn finish(mut self) {
        self.stop_drawing();
    }

    fn stop_drawing(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(drawer) = self.drawer.take() {
            let _ = drawer.join();
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.stop_drawing();
    }
}

fn draw_until(done: &AtomicU64, stop: &AtomicBool, total: u64) {
    const WIDTH: usize = 30;
    let started = Instant::now();
    let mut stderr = std::io::stderr();
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(200));
        if started.elapsed() < Duration::from_secs(1) {
            continue;
        }
        let n = done.load(Ordering::Relaxed).min(total);
        let fraction = if total == 0 {
            1.0
        } else {
            n as f64 / total as f64
        };
        let filled = (fraction * WIDTH as f64) as usize;
        let _ = write!(
            stderr,
            "\rreplaying [{}{}] {:>3.0} %  {n}/{total} request-policies  {:.0} s ",
            "#".repeat(filled),
            ".".repeat(WIDTH - filled),
            fraction * 100.0,
            started.elapsed().as_secs_f64()
        );
        let _ = stderr.flush();
    }
    if started.elapsed() >= Duration::from_secs(1) {
        let _ = write!(stderr, "\r{}\r", " ".repeat(WIDTH + 60));
    }
    let _ = stderr.flush();
}
