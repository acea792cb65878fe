//! The run directory: run id → [`RunSlot`], in chunks of [`RUN_CHUNK`]
//! slots created once and never moved, so a slot's address is stable for
//! the store's life.
//!
//! A slot publishes the run's body and, beside it, a [`Hint`] word (where
//! the body's data lies, where requests tend to leave the run, its length)
//! and the run's branch table: what a reader needs to start a run's misses
//! before it has the body.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use super::body::Body;
use super::data::HEAD;
use super::publish::Published;
use super::{RUN_CHUNK, RUN_DIR, prefetch_ptr};
use crate::branches::Branches;

/// One chunk of the run directory.
type RunChunk = Box<[RunSlot]>;

/// A run's directory slot: its published body and, beside it, a hint
/// word: where that body's data words start (the low 48 bits), the last
/// position where a report that held the positions before it went on
/// elsewhere (a *branch*: the end of a shared system prompt, say; bits 48
/// to 55, 0 for none) and how many positions the body had published when
/// the hint was last written (the top 8). The hint is for prefetching
/// only, never read through: a reader that has the slot starts the body's
/// miss and the miss on the data line it compares first together, instead
/// of the second only once the body has arrived, and knows where a request
/// is likely to leave the run (its branch or its end), so it starts the
/// key-table misses of those blocks before the body arrives (one dependent
/// miss less per run a lookup enters, and one more overlapped per run it
/// goes on to). An address past 48 bits (only where a program asks for
/// one under five-level paging) makes the data prefetch miss its line.
pub(super) struct RunSlot {
    pub(super) body: Published<Body>,
    hint: AtomicU64,
    /// The runs that start right after one of this run's positions (see
    /// the `branches` module); none for most runs.
    pub(super) branches: Published<Branches>,
}

/// A [`RunSlot`]'s hint word. Layout: bits 0–47 the data's address,
/// 48–55 the branch position (0: none), 56–63 the published length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Hint(u64);

impl Hint {
    pub(super) const ADDRESS: u64 = (1 << 48) - 1;
    const BRANCH: u64 = 0xFF << 48;
    const LEN: u64 = 0xFF << 56;

    pub(super) fn words(self) -> *const AtomicU64 {
        (self.0 & Self::ADDRESS) as usize as *const AtomicU64
    }

    pub(super) fn branch(self) -> usize {
        ((self.0 & Self::BRANCH) >> 48) as usize
    }

    pub(super) fn len(self) -> usize {
        (self.0 >> 56) as usize
    }

    fn with_words(self, words: *const AtomicU64) -> Self {
        Self((self.0 & !Self::ADDRESS) | (words as u64 & Self::ADDRESS))
    }

    fn with_branch(self, pos: usize) -> Self {
        Self((self.0 & !Self::BRANCH) | (pos as u64) << 48)
    }

    fn with_len(self, len: usize) -> Self {
        Self((self.0 & !Self::LEN) | (len as u64) << 56)
    }
}

/// Where a request that reaches a run at some position is likely to leave
/// it, in blocks from that position (0: no such place), and the run's
/// branch table, which names the runs it goes on in.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Ahead<'r> {
    /// To the run's last known branch past the position.
    pub branch: usize,
    /// To the run's end.
    pub end: usize,
    pub(super) next: Option<&'r Branches>,
}

impl RunSlot {
    fn empty() -> Self {
        Self {
            body: Published::empty(),
            hint: AtomicU64::new(0),
            branches: Published::empty(),
        }
    }

    pub(super) fn hint(&self) -> Hint {
        Hint(self.hint.load(Ordering::Relaxed))
    }

    fn set_hint(&self, hint: Hint) {
        self.hint.store(hint.0, Ordering::Relaxed);
    }

    /// Publishes `body` (see [`Published::swap`]) and its hint; a body
    /// that replaces another of the run keeps the run's branch.
    pub(super) fn swap(&self, body: Option<Arc<Body>>) -> Option<Arc<Body>> {
        let hint = body.as_ref().map_or(Hint(0), |b| {
            Hint(0)
                .with_words(b.data.words.as_ptr())
                .with_branch(self.hint().branch())
                .with_len(b.len())
        });
        self.set_hint(hint);
        self.body.swap(body)
    }

    /// Notes that the body now publishes `len` positions.
    pub(super) fn hint_len(&self, len: usize) {
        self.set_hint(self.hint().with_len(len));
    }

    /// Notes that a report went on elsewhere after position `pos - 1`;
    /// whether that moved the run's branch.
    pub(super) fn hint_branch(&self, pos: usize) -> bool {
        let hint = self.hint();
        let moved = hint.branch() != pos;
        if moved {
            self.set_hint(hint.with_branch(pos));
        }
        moved
    }

    /// Starts the misses on the body and on the data line of position
    /// `pos` (whatever body the slot holds by then: a hint), and says where
    /// a request that reached `pos` would leave the run.
    pub(super) fn touch(&self, pos: usize) -> Ahead<'static> {
        self.body.prefetch();
        let hint = self.hint();
        prefetch_ptr(hint.words().wrapping_add(HEAD + pos));
        Ahead {
            branch: hint.branch().saturating_sub(pos),
            end: hint.len().saturating_sub(pos),
            next: None,
        }
    }

    /// Starts the miss on the data line of position `pos`'s hash.
    pub(super) fn touch_words(&self, pos: usize) {
        prefetch_ptr(self.hint().words().wrapping_add(HEAD + pos));
    }
}

/// Run id → current body; chunks are created once and never move.
pub(super) struct RunDir {
    chunks: Box<[OnceLock<RunChunk>]>,
}

impl RunDir {
    pub(super) fn new() -> Self {
        Self {
            chunks: (0..RUN_DIR).map(|_| OnceLock::new()).collect(),
        }
    }

    pub(super) fn get(&self, run: u32) -> Option<&RunSlot> {
        let chunk = self.chunks.get(run as usize / RUN_CHUNK)?.get()?;
        chunk.get(run as usize % RUN_CHUNK)
    }

    pub(super) fn slot(&self, run: u32) -> &RunSlot {
        let chunk = self.chunks[run as usize / RUN_CHUNK]
            .get_or_init(|| (0..RUN_CHUNK).map(|_| RunSlot::empty()).collect());
        &chunk[run as usize % RUN_CHUNK]
    }
}
