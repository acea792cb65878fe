//! A run's data: one allocation of atomic words that the writer changes in
//! place and readers load without locks.
//!
//! Layout: a header word (row slots handed out), then `cap` hash words,
//! then the token counts (two to a word, or none while every block has the
//! run's one count), then one prefix word per row slot, then `row_cap ×
//! cap` cells (row slot major). A [`Cell`] packs a holder's last-seen seconds,
//! LFU access count and tier (tier 0: not held); a [`Prefix`] word says how
//! many leading positions a row holds at one tier with last-seen seconds
//! that never decrease, so a lookup reads one word and one cell instead of
//! a pass over the row. The writer keeps every prefix word true at every
//! moment: it cuts a word before a write that would break it and lengthens
//! it after one that extends it, each with `Release`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

/// One holder's claim on one block: last seen (s), access count, tier (0: not held).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Cell(pub(super) u64);

impl Cell {
    pub fn new(last_seen: u32, tier: u8, access: u16) -> Self {
        Self((u64::from(last_seen) << 32) | (u64::from(access) << 8) | u64::from(tier))
    }

    pub fn held(self) -> bool {
        self.0 & 0xFF != 0
    }

    pub fn last_seen(self) -> u32 {
        (self.0 >> 32) as u32
    }

    pub fn tier(self) -> u8 {
        self.0 as u8
    }

    pub fn access(self) -> u16 {
        (self.0 >> 8) as u16
    }
}

/// What a row slot's leading cells have in common, so that a lookup over
/// them reads one cell instead of every one, and none when it starts at
/// the run's first position: positions `0..len` are all held, at one tier,
/// with last-seen seconds that never decrease along the run — so the oldest
/// of any stretch inside is its first cell, and the word keeps position
/// 0's second itself. Reports arrive in chain order and later ones are
/// never older, so appends and in-order refreshes keep or rebuild the
/// prefix; anything else shortens it and the cells past it are read one by
/// one. The version changes on every shortening, so a reader that sees the
/// same word before and after reading a stretch's first cell knows the
/// cell belongs to the prefix it saw (a reader would have to be held up
/// for 2^17 shortenings of one row between its two loads to be misled).
/// Layout: bits 0–6 length, 7–14 tier, 15–31 version, 32–63 position 0's
/// last-seen second (meaningful while the length is above 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Prefix(pub(super) u64);

const PREFIX_LEN: u64 = 0x7F;
const PREFIX_VERSION: u64 = 0x1_FFFF << 15;

impl Prefix {
    pub(super) fn len(self) -> usize {
        (self.0 & PREFIX_LEN) as usize
    }

    pub(super) fn tier(self) -> u8 {
        (self.0 >> 7) as u8
    }

    /// Position 0's last-seen second.
    pub(super) fn first_seen(self) -> u32 {
        (self.0 >> 32) as u32
    }

    /// Shortened to `len`, with a new version.
    fn cut(self, len: usize) -> Self {
        let version = (self.0 + (1 << 15)) & PREFIX_VERSION;
        Self((self.0 & !(PREFIX_VERSION | PREFIX_LEN)) | version | len as u64)
    }

    /// Lengthened to `len` at `tier`, position 0 seen at `first` (same
    /// version).
    fn grown(self, len: usize, tier: u8, first: u32) -> Self {
        Self(u64::from(first) << 32 | (self.0 & PREFIX_VERSION) | u64::from(tier) << 7 | len as u64)
    }
}

/// Full bytes of a wide run's hashes, set once per position.
type WideBytes = Box<[OnceLock<Box<[u8]>>]>;

/// Header word of a run's data: row slots handed out (shared by the
/// bodies that share the data). The published length and the capacities
/// live in the body, which a reader has in cache already.
const USED_ROWS: usize = 0;
pub(super) const HEAD: usize = 1;

/// [`RunData::uniform`] of a run that stores each position's token count.
pub(super) const COUNTED: u32 = u32::MAX;

/// Words of stored token counts for `cap` positions: two to a word, or
/// none when every position has the run's one count.
fn count_words(cap: usize, uniform: u32) -> usize {
    if uniform == COUNTED {
        cap.div_ceil(2)
    } else {
        0
    }
}

/// The count every one of `counts` has, or [`COUNTED`] when they differ
/// (or one is [`COUNTED`] itself).
pub(super) fn uniform_count(mut counts: impl Iterator<Item = u32>) -> u32 {
    let Some(first) = counts.next() else {
        return COUNTED;
    };
    if counts.all(|c| c == first) {
        first
    } else {
        COUNTED
    }
}

/// The arrays of a run, changed in place by the writer: the header, the
/// hashes, the token counts (two per word; none while every position has
/// the same count, as engines' full blocks do) and the cells (`row_cap ×
/// cap`, row slot major) in one allocation, so a reader reaches all of
/// them from the body in one step.
#[derive(Debug, Clone)]
pub(super) struct RunData {
    pub(super) words: Arc<[AtomicU64]>,
    pub(super) wide: Option<Arc<WideBytes>>,
    /// Block and row capacity of `words` (fixed for the allocation).
    cap: u32,
    row_cap: u32,
    /// The token count of every position, or [`COUNTED`] when the counts
    /// are stored (fixed for the allocation: a count the run cannot take
    /// rebuilds it with stored counts). 4 bytes per block at one holder.
    pub(super) uniform: u32,
}

impl RunData {
    pub(super) fn new(cap: usize, row_cap: usize, wide: bool, uniform: u32) -> Self {
        let n = HEAD + cap + count_words(cap, uniform) + row_cap + row_cap * cap;
        // Zeroed by the allocator: memory fresh from the system needs no
        // clearing pass.
        #[expect(
            unsafe_code,
            reason = "an all-zero AtomicU64 is a valid value; zeroed allocation skips a clearing pass"
        )]
        // SAFETY: `new_zeroed_slice` returns `n` zero-filled elements, and
        // `AtomicU64` has the same in-memory representation as `u64`, for
        // which all-zero bits is the value 0 (`AtomicU64::new(0)`).
        let words: Arc<[AtomicU64]> = unsafe { Arc::new_zeroed_slice(n).assume_init() };
        Self {
            words,
            wide: wide.then(|| Arc::new((0..cap).map(|_| OnceLock::new()).collect())),
            cap: cap as u32,
            row_cap: row_cap as u32,
            uniform,
        }
    }

    /// A copy of `old`'s first `len` positions with block capacity `cap`
    /// and `row_cap` row slots, slot `s` holding the cells and prefix of
    /// `old`'s slot `from[s]` (none: an empty slot), `from.len()` of them
    /// handed out, and its counts stored (`uniform` [`COUNTED`]) or not
    /// (`uniform` then `old`'s). Every word is written once, copied or
    /// zero, into memory the allocator did not clear (a rebuild would
    /// otherwise write each word twice).
    pub(super) fn copied(
        old: &Self,
        len: usize,
        (cap, row_cap, uniform): (usize, usize, u32),
        from: &[Option<usize>],
    ) -> Self {
        debug_assert!(uniform == COUNTED || uniform == old.uniform);
        let counts = count_words(cap, uniform);
        let n = HEAD + cap + counts + row_cap + row_cap * cap;
        let mut words = Arc::<[AtomicU64]>::new_uninit_slice(n);
        let mut fill = Fill {
            out: Arc::get_mut(&mut words).expect("a new allocation has one owner"),
            at: 0,
        };
        fill.word(from.len() as u64);
        fill.copy(&old.words[HEAD..HEAD + len], cap);
        if old.counted() {
            let old_counts = HEAD + old.cap();
            fill.copy(&old.words[old_counts..old_counts + len.div_ceil(2)], counts);
        } else if counts > 0 {
            // Every position below `len` had the one count; past it, 0.
            let count = |pos: usize| if pos < len { u64::from(old.uniform) } else { 0 };
            for w in 0..counts {
                fill.word(count(2 * w) | count(2 * w + 1) << 32);
            }
        }
        for slot in 0..row_cap {
            let prefix = from.get(slot).copied().flatten().map(|f| old.prefix(f));
            fill.word(prefix.map_or(0, |p| p.load(Ordering::Relaxed)));
        }
        for slot in 0..row_cap {
            match from.get(slot).copied().flatten() {
                Some(f) => fill.copy(old.cells(f, 0, len), cap),
                None => fill.copy(&[], cap),
            }
        }
        fill.finish();
        #[expect(
            unsafe_code,
            reason = "every element was written by `Fill`; an uninitialised allocation skips a clearing pass"
        )]
        // SAFETY: `Fill` writes its elements in order and `finish` writes
        // every one not written yet, so all `n` elements are initialised.
        let words = unsafe { words.assume_init() };
        let wide = old.wide.as_ref().map(|from| {
            let wide: WideBytes = (0..cap).map(|_| OnceLock::new()).collect();
            for (to, from) in wide.iter().zip(from.iter()).take(len) {
                if let Some(bytes) = from.get() {
                    let _ = to.set(bytes.clone());
                }
            }
            Arc::new(wide)
        });
        Self {
            words,
            wide,
            cap: cap as u32,
            row_cap: row_cap as u32,
            uniform,
        }
    }

    /// Whether each position's token count is stored.
    pub(super) fn counted(&self) -> bool {
        self.uniform == COUNTED
    }

    /// Whether the run can take token counts `count(k)` for `k` in `0..n`
    /// as they are: it stores counts, or they are all its one count.
    pub(super) fn takes_counts(&self, n: usize, count: impl Fn(usize) -> u32) -> bool {
        self.counted() || (0..n).all(|k| count(k) == self.uniform)
    }

    /// The stored counts' words (none for a run of one count).
    pub(super) fn count_slice(&self) -> &[AtomicU64] {
        let cap = self.cap();
        &self.words[HEAD + cap..HEAD + cap + count_words(cap, self.uniform)]
    }

    pub(super) fn cap(&self) -> usize {
        self.cap as usize
    }

    pub(super) fn row_cap(&self) -> usize {
        self.row_cap as usize
    }

    /// Row slots handed out so far (writer only).
    pub(super) fn used_rows(&self) -> usize {
        self.words[USED_ROWS].load(Ordering::Relaxed) as usize
    }

    pub(super) fn set_used_rows(&self, n: usize) {
        self.words[USED_ROWS].store(n as u64, Ordering::Relaxed);
    }

    pub(super) fn hash(&self, pos: usize) -> u64 {
        self.words[HEAD + pos].load(Ordering::Relaxed)
    }

    /// The hash words of positions `from..to`.
    pub(super) fn hashes(&self, from: usize, to: usize) -> &[AtomicU64] {
        &self.words[HEAD + from..HEAD + to]
    }

    fn count_word(&self, pos: usize) -> &AtomicU64 {
        &self.words[HEAD + self.cap() + pos / 2]
    }

    pub(super) fn count(&self, pos: usize) -> u32 {
        if !self.counted() {
            return self.uniform;
        }
        (self.count_word(pos).load(Ordering::Relaxed) >> ((pos & 1) * 32)) as u32
    }

    /// Sets a token count (writer only: the other half of the word stays;
    /// a run of one count takes only that one, see [`takes_counts`]).
    ///
    /// [`takes_counts`]: Self::takes_counts
    pub(super) fn set_count(&self, pos: usize, count: u32) {
        if !self.counted() {
            debug_assert_eq!(count, self.uniform, "a count the run cannot take");
            return;
        }
        let word = self.count_word(pos);
        let shift = (pos & 1) * 32;
        let old = word.load(Ordering::Relaxed);
        let next = (old & !(0xFFFF_FFFFu64 << shift)) | (u64::from(count) << shift);
        if next != old {
            word.store(next, Ordering::Relaxed);
        }
    }

    /// Sets the token counts of positions `from..from + n` to `count(k)`
    /// for `k` in `0..n` (writer only), two to a word where both halves
    /// are set; a word is stored only where it changes.
    pub(super) fn set_counts(&self, from: usize, n: usize, count: impl Fn(usize) -> u32) {
        if !self.counted() {
            debug_assert!(self.takes_counts(n, count), "counts the run cannot take");
            return;
        }
        let words = self.count_slice();
        let mut k = 0;
        while k < n {
            let pos = from + k;
            let word = &words[pos / 2];
            let old = word.load(Ordering::Relaxed);
            let next = if pos.is_multiple_of(2) && k + 1 < n {
                k += 2;
                u64::from(count(k - 2)) | (u64::from(count(k - 1)) << 32)
            } else {
                let shift = (pos & 1) * 32;
                k += 1;
                (old & !(0xFFFF_FFFFu64 << shift)) | (u64::from(count(k - 1)) << shift)
            };
            if next != old {
                word.store(next, Ordering::Relaxed);
            }
        }
    }

    /// Where the prefix words start in `words`; the cells follow them.
    fn prefixes_at(&self) -> usize {
        let cap = self.cap();
        HEAD + cap + count_words(cap, self.uniform)
    }

    /// The [`Prefix`] word of row slot `slot`.
    pub(super) fn prefix(&self, slot: usize) -> &AtomicU64 {
        &self.words[self.prefixes_at() + slot]
    }

    /// Every row slot's cells, slot after slot (`cap` each).
    pub(super) fn cells_from(&self) -> &[AtomicU64] {
        &self.words[self.prefixes_at() + self.row_cap()..]
    }

    /// Cells of row slot `slot`, positions `from..to`.
    pub(super) fn cells(&self, slot: usize, from: usize, to: usize) -> &[AtomicU64] {
        let base = self.prefixes_at() + self.row_cap() + slot * self.cap();
        &self.words[base + from..base + to]
    }

    /// Sets a cell of row slot `slot` (writer only), keeping the slot's
    /// [`Prefix`] true at every moment a reader may look: a write that
    /// would break it shortens the prefix first (and bumps its version),
    /// a write that extends it publishes the longer prefix after the cell.
    pub(super) fn set_cell(&self, slot: usize, pos: usize, cell: Cell) {
        let cells = self.cells(slot, 0, self.cap());
        let seen = |p: usize| Cell(cells[p].load(Ordering::Relaxed)).last_seen();
        let word = self.prefix(slot);
        let prefix = Prefix(word.load(Ordering::Relaxed));
        let mut n = prefix.len();
        if pos < n {
            let keeps = cell.held()
                && cell.tier() == prefix.tier()
                && (pos == 0 || seen(pos - 1) <= cell.last_seen())
                && (pos + 1 >= n || cell.last_seen() <= seen(pos + 1));
            if !keeps {
                word.store(prefix.cut(pos).0, Ordering::Relaxed);
                n = pos;
            }
        }
        // `Release`: a reader that sees this cell sees the shortened prefix.
        cells[pos].store(cell.0, Ordering::Release);
        // A cell at the prefix's end may lengthen it.
        if pos == n {
            grow_prefix(cells, word);
        } else if pos == 0 {
            refresh_first(cells, word);
        }
    }

    pub(super) fn cell(&self, slot: usize, pos: usize) -> &AtomicU64 {
        &self.cells(slot, pos, pos + 1)[0]
    }

    /// Sets slot `slot`'s cells at `from..to` to held cells at `tier`, last
    /// seen `last_seen` (writer only): a cell that was held keeps its access
    /// count, one that was not starts at 0 and its position goes to `fresh`
    /// before it is written. One check keeps the slot's [`Prefix`] true
    /// for the whole stretch: if the first write would break it, it is cut
    /// to `from` first; each later write follows a cell just written with
    /// the same second and tier, and the old cells after the first are not
    /// older than the one after it, so none of them breaks it. A prefix
    /// that reaches the stretch is lengthened over it afterwards.
    pub(super) fn set_stretch(
        &self,
        slot: usize,
        from: usize,
        to: usize,
        last_seen: u32,
        tier: u8,
        mut fresh: impl FnMut(usize),
    ) {
        let cells = self.cells(slot, 0, self.cap());
        let word = self.prefix(slot);
        let prefix = Prefix(word.load(Ordering::Relaxed));
        let n = prefix.len();
        if from < n {
            let seen = |p: usize| Cell(cells[p].load(Ordering::Relaxed)).last_seen();
            let keeps = tier == prefix.tier()
                && (from == 0 || seen(from - 1) <= last_seen)
                && (from + 1 >= n || last_seen <= seen(from + 1));
            if !keeps {
                word.store(prefix.cut(from).0, Ordering::Relaxed);
            }
        }
        for (pos, c) in (from..).zip(&cells[from..to]) {
            let old = Cell(c.load(Ordering::Relaxed));
            let access = if old.held() {
                old.access()
            } else {
                fresh(pos);
                0
            };
            // `Release`: a reader that sees this cell sees a cut prefix.
            c.store(Cell::new(last_seen, tier, access).0, Ordering::Release);
        }
        self.join_prefix(slot, from, to, last_seen, tier);
        if from == 0 {
            refresh_first(cells, word);
        }
    }

    /// Lengthens slot `slot`'s prefix over cells `from..to`, just written
    /// held at `tier` and `last_seen`, when it ends inside them or at their
    /// start with a cell they may follow, and on over the held cells after
    /// them that keep the tier and are not older (writer only).
    pub(super) fn join_prefix(
        &self,
        slot: usize,
        from: usize,
        to: usize,
        last_seen: u32,
        tier: u8,
    ) {
        let cells = self.cells(slot, 0, self.cap());
        let word = self.prefix(slot);
        let prefix = Prefix(word.load(Ordering::Relaxed));
        let n = prefix.len();
        let joins = from <= n
            && n < to
            && (n > from
                || n == 0
                || (prefix.tier() == tier
                    && Cell(cells[n - 1].load(Ordering::Relaxed)).last_seen() <= last_seen));
        if joins {
            extend_over(cells, word, prefix, to, tier, last_seen);
        }
    }

    /// Lengthens slot `slot`'s prefix over the held cells after it that
    /// keep its tier and do not get older.
    pub(super) fn extend_prefix(&self, slot: usize) {
        grow_prefix(self.cells(slot, 0, self.cap()), self.prefix(slot));
    }
}

/// Writes a new allocation's words in order (see [`RunData::copied`]).
struct Fill<'a> {
    out: &'a mut [std::mem::MaybeUninit<AtomicU64>],
    at: usize,
}

impl Fill<'_> {
    fn word(&mut self, w: u64) {
        if let Some(slot) = self.out.get_mut(self.at) {
            slot.write(AtomicU64::new(w));
            self.at += 1;
        }
    }

    /// `from` and zeros after it, `n` words in all.
    fn copy(&mut self, from: &[AtomicU64], n: usize) {
        let end = (self.at + n).min(self.out.len());
        let (to, zeros) = self.out[self.at..end].split_at_mut(from.len().min(end - self.at));
        for (to, from) in to.iter_mut().zip(from) {
            to.write(AtomicU64::new(from.load(Ordering::Relaxed)));
        }
        for to in zeros {
            to.write(AtomicU64::new(0));
        }
        self.at = end;
    }

    /// Zeros every word not written yet.
    fn finish(mut self) {
        let rest = self.out.len() - self.at;
        self.copy(&[], rest);
    }
}

/// Lengthens the prefix in `word` over the held `cells` after it that keep
/// its tier and do not get older (writer only).
fn grow_prefix(cells: &[AtomicU64], word: &AtomicU64) {
    let prefix = Prefix(word.load(Ordering::Relaxed));
    let start = prefix.len();
    let (tier, last) = match start.checked_sub(1) {
        Some(p) => (
            prefix.tier(),
            Cell(cells[p].load(Ordering::Relaxed)).last_seen(),
        ),
        None => (0, 0),
    };
    extend_over(cells, word, prefix, start, tier, last);
}

/// Stores `prefix` lengthened to `from` (its last cell at `tier`, seen
/// `last`; any tier when `from` is 0) and on over the held cells from
/// `from` that keep the tier and are not older (writer only).
fn extend_over(
    cells: &[AtomicU64],
    word: &AtomicU64,
    prefix: Prefix,
    from: usize,
    mut tier: u8,
    mut last: u32,
) {
    let mut n = from;
    for c in &cells[from..] {
        let c = Cell(c.load(Ordering::Relaxed));
        if !c.held() || (n > 0 && (c.tier() != tier || c.last_seen() < last)) {
            break;
        }
        tier = c.tier();
        last = c.last_seen();
        n += 1;
    }
    if n != prefix.len() {
        let first = match n {
            0 => 0,
            _ => Cell(cells[0].load(Ordering::Relaxed)).last_seen(),
        };
        // `Release`: the cells it covers were written before.
        word.store(prefix.grown(n, tier, first).0, Ordering::Release);
    }
}

/// Keeps the prefix word's copy of position 0's second true after position
/// 0 was written under a prefix that the write kept (writer only).
fn refresh_first(cells: &[AtomicU64], word: &AtomicU64) {
    let prefix = Prefix(word.load(Ordering::Relaxed));
    if prefix.len() > 0 {
        let first = Cell(cells[0].load(Ordering::Relaxed)).last_seen();
        if first != prefix.first_seen() {
            // `Release`: after the cell, as every prefix word.
            let next = prefix.grown(prefix.len(), prefix.tier(), first);
            word.store(next.0, Ordering::Release);
        }
    }
}
