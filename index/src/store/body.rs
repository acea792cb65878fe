//! A run's body: its partition, its rows (replica → row slot, sorted by
//! replica id), its published length and its data, and the reads a lookup
//! makes of it.
//!
//! A body never changes once published except through atomic words of its
//! data (cells, prefix words, hashes past the length, the length itself);
//! adding a row past the row capacity, growing the run or dropping rows
//! publishes a new body. A reader loads the length with `Acquire` and then
//! reads only positions below it.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use smallvec::SmallVec;

use super::data::{Cell, HEAD, Prefix, RunData};
use super::dir::Hint;
use super::key::{HashRef, Key, mix};
use super::{RUN_BLOCKS, prefetch, prefetch_ptr};
use crate::branches::{Branches, Lines};
use crate::catalog::{PartitionId, ReplicaId};
use crate::messages::BlockHashes;
use crate::table::Probe;

/// A row's leading stretch of held cells (see [`Body::row_stretch`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Stretch {
    /// Held cells from the first position on.
    pub blocks: usize,
    /// Oldest last-seen second among them (`u32::MAX` for none).
    pub oldest: u32,
    /// Coldest tier among them (0 for none).
    pub tier: u8,
    /// A cell not held ended the stretch before the range's end.
    pub ended: bool,
}

/// A run's rows, sorted by replica id.
pub(super) type Rows = SmallVec<[Row; 4]>;

/// One row: a replica and the slot of its cells.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Row {
    pub replica: ReplicaId,
    pub(super) slot: u32,
}

/// The lines a lookup reads first in a run it enters at position 0, as a
/// branch table keeps them: the body's address, and the data's address
/// with its block capacity and whether it stores counts in the top byte
/// (which place the prefix words).
pub(super) fn lines_of(body: &Body) -> Lines {
    let data = &body.data;
    let top = data.cap() as u64 | u64::from(data.counted()) << 7;
    [
        std::ptr::from_ref(body) as u64,
        data.words.as_ptr() as u64 & Hint::ADDRESS | top << 56,
    ]
}

/// The data's words, their block capacity and the first prefix word, as
/// a [`lines_of`] word places them.
pub(super) fn placed(data: u64) -> (*const AtomicU64, usize, *const AtomicU64) {
    let words = (data & Hint::ADDRESS) as usize as *const AtomicU64;
    let top = (data >> 56) as usize;
    let cap = top & 0x7F;
    let counts = if top & 0x80 == 0 { 0 } else { cap.div_ceil(2) };
    (words, cap, words.wrapping_add(HEAD + cap + counts))
}

/// Line words of a heads-table entry: those of [`lines_of`] (the data
/// word with the run's branch position in its free byte, bits 48 to 55),
/// the run's branch table and that table's [`Branches::place`].
pub(super) const HEAD_LINES: usize = 4;

/// The branch position a heads-table entry's data word carries (0: none).
pub(super) fn head_branch(data: u64) -> usize {
    ((data >> 48) & 0xFF) as usize
}

/// The heads-table entry of a run with body `body`, branch position
/// `branch` (0: none) and branch table `table`.
pub(super) fn head_lines(body: &Body, branch: usize, table: &Branches) -> [u64; HEAD_LINES] {
    let [at, data] = lines_of(body);
    debug_assert!(branch < RUN_BLOCKS, "a branch position fits its byte");
    [
        at,
        data | (branch as u64) << 48,
        std::ptr::from_ref(table) as u64,
        table.place(),
    ]
}

/// Starts the misses on the lines of [`lines_of`]: the body, the first
/// and the last hash line (where a request enters the run, and the last
/// block it compares when it follows a full run to its end: see
/// [`Body::follow`], which reads no other line then; the line is the
/// capacity's last, since the run's length sits in the body whose miss
/// this starts) and the first row slots' prefix words.
pub(super) fn prefetch_lines([body, data]: Lines) {
    let body = body as usize as *const u8;
    prefetch_ptr(body);
    prefetch_ptr(body.wrapping_add(64));
    let (words, cap, prefixes) = placed(data);
    prefetch_ptr(words);
    prefetch_ptr(words.wrapping_add(HEAD + cap.max(1) - 1));
    prefetch_ptr(prefixes);
}

/// What a reader sees of a run: partition, published length, rows (sorted
/// by replica) and data.
#[derive(Debug)]
pub(crate) struct Body {
    pub part: PartitionId,
    /// Published positions: a reader loads it with `Acquire` before the
    /// positions below it, which the writer filled before storing it with
    /// `Release`. Kept here, not in the data, so that the data's lines a
    /// reader needs (hashes, cells) are known as soon as the body is read.
    len: AtomicU32,
    /// Inline for the common few holders: one dependent load less per run.
    pub(super) rows: Rows,
    pub(super) data: RunData,
}

impl Body {
    pub(super) fn new(part: PartitionId, len: usize, rows: Rows, data: RunData) -> Self {
        Self {
            part,
            len: AtomicU32::new(len as u32),
            rows,
            data,
        }
    }

    /// Published positions.
    pub fn len(&self) -> usize {
        self.len.load(Ordering::Acquire) as usize
    }

    /// Publishes positions below `len` (filled before).
    pub(super) fn publish_len(&self, len: usize) {
        self.len.store(len as u32, Ordering::Release);
    }

    /// Whether position `pos` (below [`len`](Self::len)) holds `key`.
    pub fn holds_key(&self, pos: usize, key: &Key<'_>) -> bool {
        self.holds(pos, key.hash, key.word)
    }

    /// Whether position `pos` holds `hash`, whose [`HashRef::word`] is `word`.
    pub fn holds(&self, pos: usize, hash: HashRef<'_>, word: u64) -> bool {
        if self.data.hash(pos) != word {
            return false;
        }
        match (&self.data.wide, hash) {
            (None, HashRef::Narrow(_)) => true,
            (Some(wide), HashRef::Wide(bytes)) => wide[pos].get().is_some_and(|b| **b == *bytes),
            _ => false,
        }
    }

    /// Stored token count of a position.
    pub fn count(&self, pos: usize) -> u32 {
        self.data.count(pos)
    }

    /// Replicas with cells in the run, ascending.
    pub fn replicas(&self) -> impl ExactSizeIterator<Item = ReplicaId> + '_ {
        self.rows.iter().map(|r| r.replica)
    }

    /// Number of rows.
    pub fn row_count(&self) -> usize {
        self.rows.len()
    }

    /// The rows, sorted by replica id: a walk over them reads the list
    /// once rather than indexing it per row.
    pub fn rows(&self) -> &[Row] {
        &self.rows
    }

    /// Row index of `replica`, searching from row `from` on.
    pub fn row_from(&self, replica: ReplicaId, from: usize) -> Option<usize> {
        let rest = self.rows.get(from..)?;
        rest.binary_search_by_key(&replica, |r| r.replica)
            .ok()
            .map(|i| from + i)
    }

    pub fn row(&self, replica: ReplicaId) -> Option<usize> {
        self.row_from(replica, 0)
    }

    pub fn replica(&self, row: usize) -> ReplicaId {
        self.rows[row].replica
    }

    fn cell_at(&self, row: usize, pos: usize) -> &AtomicU64 {
        self.data.cell(self.rows[row].slot as usize, pos)
    }

    pub fn cell(&self, row: usize, pos: usize) -> Cell {
        Cell(self.cell_at(row, pos).load(Ordering::Relaxed))
    }

    /// Cells of row `row` from `pos` on (up to the published length).
    pub fn cells(&self, row: usize, pos: usize, len: usize) -> impl Iterator<Item = Cell> + '_ {
        self.data
            .cells(self.rows[row].slot as usize, pos, len)
            .iter()
            .map(|c| Cell(c.load(Ordering::Relaxed)))
    }

    /// The held stretch of `row` over positions `from..to`: how many
    /// cells from `from` on are held (the first one not held ends it), their
    /// oldest last-seen second and their coldest (highest) tier. Inlined
    /// into the walk, which reads one per candidate and run: as a call it
    /// was about 280 of a four-holder lookup's instructions.
    #[inline(always)]
    pub fn row_stretch(&self, row: Row, from: usize, to: usize) -> Stretch {
        let slot = row.slot as usize;
        // Inside the slot's prefix the stretch is known from its first cell.
        let word = self.data.prefix(slot);
        let prefix = Prefix(word.load(Ordering::Acquire));
        if from < prefix.len() && from < to {
            // From position 0 the word alone tells; further on, the first
            // cell does, if the prefix is still the one seen.
            let (oldest, kept) = if from == 0 {
                (prefix.first_seen(), true)
            } else {
                let first = Cell(self.data.cell(slot, from).load(Ordering::Acquire));
                (
                    first.last_seen(),
                    Prefix(word.load(Ordering::Relaxed)) == prefix,
                )
            };
            if kept {
                let end = to.min(prefix.len());
                let known = Stretch {
                    blocks: end - from,
                    oldest,
                    tier: prefix.tier(),
                    ended: false,
                };
                if end == to {
                    return known;
                }
                let rest = self.scan_stretch(slot, end, to);
                return Stretch {
                    blocks: known.blocks + rest.blocks,
                    oldest: known.oldest.min(rest.oldest),
                    tier: known.tier.max(rest.tier),
                    ended: rest.ended,
                };
            }
        }
        self.scan_stretch(slot, from, to)
    }

    /// [`row_stretch`](Self::row_stretch) read cell by cell.
    pub(super) fn scan_stretch(&self, slot: usize, from: usize, to: usize) -> Stretch {
        let cells = self.data.cells(slot, from, to);
        // Four lanes, so the min / max chains do not wait on each other.
        let mut oldest = [u32::MAX; 4];
        let mut tier = [0u8; 4];
        let mut k = 0;
        let mut quads = cells.chunks_exact(4);
        for quad in quads.by_ref() {
            let words = [
                quad[0].load(Ordering::Relaxed),
                quad[1].load(Ordering::Relaxed),
                quad[2].load(Ordering::Relaxed),
                quad[3].load(Ordering::Relaxed),
            ];
            if words.iter().any(|&w| !Cell(w).held()) {
                break;
            }
            for lane in 0..4 {
                oldest[lane] = oldest[lane].min(Cell(words[lane]).last_seen());
                tier[lane] = tier[lane].max(Cell(words[lane]).tier());
            }
            k += 4;
        }
        let mut oldest = oldest.into_iter().min().unwrap_or(u32::MAX);
        let mut tier = tier.into_iter().max().unwrap_or(0);
        let mut ended = false;
        for cell in &cells[k..] {
            let cell = Cell(cell.load(Ordering::Relaxed));
            if !cell.held() {
                ended = true;
                break;
            }
            oldest = oldest.min(cell.last_seen());
            tier = tier.max(cell.tier());
            k += 1;
        }
        Stretch {
            blocks: k,
            oldest,
            tier,
            ended: ended || k < cells.len(),
        }
    }

    /// How many positions from `pos` (which holds request block `at`) the
    /// request follows this run: 1 plus the following blocks whose hashes
    /// equal the run's next positions, up to the published length `len`.
    ///
    /// Block hashes are parent-chained (the wire contract's assumption: a
    /// block's hash identifies the whole prefix that ends in it), and a
    /// run's positions are blocks reported one after another, each an
    /// ancestor of the next. So where the request's block `at + k` equals
    /// position `pos + k`, every block between agrees too: agreement holds
    /// for a leading stretch and never again after it. The stretch's end is
    /// found by comparing the last block the run and the request share, and
    /// where that differs by bisection, tried first at `leave` (how many
    /// positions from `pos` earlier requests followed before leaving, 0 when
    /// unknown): two or three compares where a block-by-block pass made one
    /// per block and read every hash line of the stretch.
    pub fn follow(
        &self,
        pos: usize,
        len: usize,
        request: &BlockHashes,
        at: usize,
        leave: usize,
    ) -> usize {
        debug_assert!(pos < len && at < request.len(), "a located block");
        let n = (len - pos).min(request.len() - at);
        match (&self.data.wide, request) {
            // Words against words: 181 fewer instructions a lookup than
            // asking `holds` (callgrind, `lookup_profile`, one holder).
            (None, BlockHashes::Narrow(words)) => {
                let stored = self.data.hashes(pos, pos + n);
                let asked = &words[at..at + n];
                leading_stretch(n, leave, |k| {
                    stored[k].load(Ordering::Relaxed) == u64::from_be_bytes(asked[k])
                })
            }
            _ => leading_stretch(n, leave, |k| {
                let hash = request.hash(at + k);
                self.holds(pos + k, hash, hash.word())
            }),
        }
    }

    /// Starts loading the rows' prefix words, the first cells from `pos` of
    /// the first rows (none from position 0) and the hashes
    /// [`follow`](Self::follow) compares first, so that their misses are
    /// under way together: the last position the run and the request share
    /// (`rest`: the request's blocks from the one at `pos` on) and, with a
    /// `branch` (positions from `pos` earlier requests followed before
    /// leaving; 0 for none), the two either side of where they left.
    pub fn touch_cells(&self, pos: usize, branch: usize, rest: usize) {
        if let Some(row) = self.rows.first() {
            prefetch(self.data.prefix(row.slot as usize));
        }
        // From position 0 a row's prefix word holds what its first cell
        // would tell.
        if pos > 0 {
            for row in self.rows.iter().take(8) {
                prefetch(self.data.cell(row.slot as usize, pos));
            }
        }
        let len = self.len();
        let last = pos + (len - pos).min(rest).max(1) - 1;
        prefetch(&self.data.words[HEAD + last]);
        if branch > 0 && pos + branch < last {
            prefetch(&self.data.words[HEAD + pos + branch - 1]);
            prefetch(&self.data.words[HEAD + pos + branch]);
        }
    }

    /// Adds one to a cell's access count (saturating); lock-free, so a
    /// credit racing a writer that rebuilds the run may be lost.
    pub fn credit(&self, row: usize, pos: usize) {
        let _ = self
            .cell_at(row, pos)
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| {
                let cell = Cell(c);
                (cell.held() && cell.access() < u16::MAX)
                    .then(|| Cell::new(cell.last_seen(), cell.tier(), cell.access() + 1).0)
            });
    }

    pub(super) fn set(&self, row: usize, pos: usize, cell: Cell) {
        self.data.set_cell(self.rows[row].slot as usize, pos, cell);
    }

    /// Rows holding position `pos`.
    pub(super) fn holders_at(&self, pos: usize) -> usize {
        (0..self.rows.len())
            .filter(|&r| self.cell(r, pos).held())
            .count()
    }

    /// Whether any row holds position `pos`.
    pub(super) fn held_by_any(&self, pos: usize) -> bool {
        (0..self.rows.len()).any(|r| self.cell(r, pos).held())
    }

    pub(super) fn row_live(&self, row: usize) -> usize {
        let len = self.len();
        self.cells(row, 0, len).filter(|c| c.held()).count()
    }

    pub(super) fn is_wide(&self) -> bool {
        self.data.wide.is_some()
    }

    /// The probe of position `pos`.
    pub(super) fn probe(&self, pos: usize) -> Probe {
        Probe::of(mix(self.data.hash(pos), self.part))
    }
}

/// How many of positions `0..n` agree, where position 0 does and agreement
/// holds for a leading stretch only (see [`Body::follow`]): `agree` is asked
/// of the last position, then of `leave` and the one before it (a guess at
/// the answer; ignored when 0 or out of range), then by bisection.
fn leading_stretch(n: usize, leave: usize, agree: impl Fn(usize) -> bool) -> usize {
    if n <= 1 || agree(n - 1) {
        return n;
    }
    // Every position below `lo` agrees; position `hi` does not.
    let (mut lo, mut hi) = (1, n - 1);
    if leave > lo && leave < hi {
        if agree(leave) {
            lo = leave + 1;
        } else if agree(leave - 1) {
            return leave;
        } else {
            hi = leave - 1;
        }
    }
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if agree(mid) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}
