//! Branch tables: the runs that continue a run, and the lines a lookup
//! reads in each.
//!
//! A request that leaves a run (a shared system prompt ends, a
//! conversation's own blocks begin) goes on in a run that starts right
//! after it. Found through the key table, that run is three dependent
//! misses away: the key-table slot, then the run's directory slot, then
//! its body and data; on a large index each is a trip to memory, and the
//! lookup waits for them one after the other. A run's branch table names,
//! for every run that starts right after one of its positions, the
//! addresses of that run's body, hash words and prefix words. It is read
//! through the parent's directory slot, which every request sharing the
//! parent keeps in cache, so a lookup that knows where it will leave a run
//! (the directory's hint) starts all of the next run's misses at once,
//! before it has compared a single hash of the run it is in.
//!
//! **Prefetch only.** Nothing is read through the addresses an entry
//! holds: a lookup still locates the next run through the key table, with
//! every check. An entry that went stale (the run's body rebuilt since, the
//! run freed) costs a wasted prefetch, never a wrong answer, and an entry
//! the writer is rewriting may be read half old, half new.
//!
//! Open addressing with linear probing over entries of three words: the
//! key word (the next run's first key's 32-bit tag in the upper half, the
//! run id in the lower; 0 empty, 1 removed) and two address words. The one
//! writer fills the address words before the key word (`Release`), updates
//! them in place when the run's body moves, and turns the key word into a
//! tombstone on removal; growth copies the live entries into a new table
//! that the store swaps in. A table holds about a third more entries than
//! it has live ones (not a power of two: the home entry is the tag scaled
//! to the size), so a shared head's table costs about 32 bytes per run
//! that continues it. Most runs have no branch table.
//!
//! The same table, with wider entries, is the store's **heads table**: the
//! runs others continue that continue no run themselves (a chain's first
//! blocks, such as a shared system prompt), under their first key's tag,
//! with the lines of their body and data, where a report last left them,
//! and where their own branch table lies. A lookup finds it through the
//! store, which every lookup keeps in cache, so it starts the first run's
//! misses and those of the run it goes on in at once, instead of the key
//! table's slot, the directory slot and the branch table one after the
//! other.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::table::bump;

const EMPTY: u64 = 0;
const TOMB: u64 = 1;
/// Entries in a new table.
const MIN_ENTRIES: usize = 4;

/// What a lookup prefetches of one run: opaque to this table.
pub(crate) type Lines = [u64; 2];

/// One run's branch table (entries of a key word and `L` words a lookup
/// reads, opaque to the table), or with wider entries the heads table.
#[derive(Debug)]
pub(crate) struct Branches<const L: usize = 2> {
    words: Box<[AtomicU64]>,
    /// Entries (not a power of two).
    n: usize,
    /// Entries taken, tombstones included (the writer's count).
    used: AtomicU64,
    live: AtomicU64,
}

impl<const L: usize> Default for Branches<L> {
    fn default() -> Self {
        Self::with_entries(MIN_ENTRIES)
    }
}

/// Words of one entry of a table of `L` line words.
const fn words_per_entry(lines: usize) -> usize {
    lines + 1
}

impl<const L: usize> Branches<L> {
    const WORDS: usize = words_per_entry(L);

    fn with_entries(n: usize) -> Self {
        let n = n.max(MIN_ENTRIES);
        Self {
            words: (0..n * Self::WORDS)
                .map(|_| AtomicU64::new(EMPTY))
                .collect(),
            n,
            used: AtomicU64::new(0),
            live: AtomicU64::new(0),
        }
    }

    fn key_at(&self, i: usize) -> &AtomicU64 {
        &self.words[i * Self::WORDS]
    }

    fn lines_at(&self, i: usize) -> &[AtomicU64] {
        &self.words[i * Self::WORDS + 1..(i + 1) * Self::WORDS]
    }

    fn lines(&self, i: usize) -> [u64; L] {
        let words = self.lines_at(i);
        std::array::from_fn(|k| words[k].load(Ordering::Relaxed))
    }

    fn set_lines(&self, i: usize, lines: [u64; L]) {
        for (word, value) in self.lines_at(i).iter().zip(lines) {
            word.store(value, Ordering::Relaxed);
        }
    }

    fn home(&self, tag: u32) -> usize {
        home_of(tag, self.n)
    }

    /// Where the table's entries lie and how many there are, in one word
    /// (the address in the low 48 bits, the count above it, 0 past what
    /// 16 bits hold), for [`home_line`].
    pub fn place(&self) -> u64 {
        let n = u64::try_from(self.n)
            .ok()
            .filter(|&n| n < 1 << 16)
            .unwrap_or(0);
        self.words.as_ptr() as u64 & ADDRESS | n << 48
    }

    fn next(&self, i: usize) -> usize {
        if i + 1 == self.n { 0 } else { i + 1 }
    }

    /// The run continuing here whose first key carries `tag`, and its
    /// lines (the first such entry; tags of different keys may collide,
    /// and then a prefetch is wasted).
    pub fn find(&self, tag: u32) -> Option<(u32, [u64; L])> {
        let mut i = self.home(tag);
        for _ in 0..self.n {
            let key = self.key_at(i).load(Ordering::Acquire);
            if key == EMPTY {
                return None;
            }
            if key != TOMB && (key >> 32) as u32 == tag {
                return Some((key as u32, self.lines(i)));
            }
            i = self.next(i);
        }
        None
    }

    /// The slot of `(tag, run)`, or where it would go.
    fn slot(&self, tag: u32, run: u32) -> Result<usize, Option<usize>> {
        let want = u64::from(tag) << 32 | u64::from(run);
        let mut i = self.home(tag);
        let mut free = None;
        for _ in 0..self.n {
            let key = self.key_at(i).load(Ordering::Relaxed);
            if key == want {
                return Ok(i);
            }
            if key == EMPTY {
                return Err(free.or(Some(i)));
            }
            if key == TOMB && free.is_none() {
                free = Some(i);
            }
            i = self.next(i);
        }
        Err(free)
    }

    /// Names `run` (first key's tag `tag`) with `lines`, or updates its
    /// lines; false when the table has no room left for a new entry (the
    /// caller grows it).
    pub fn set(&self, tag: u32, run: u32, lines: [u64; L]) -> bool {
        debug_assert_ne!(tag, 0, "a key-table tag is never 0");
        let at = match self.slot(tag, run) {
            Ok(i) => i,
            Err(Some(i)) if self.used.load(Ordering::Relaxed) < self.limit() as u64 => {
                if self.key_at(i).load(Ordering::Relaxed) == EMPTY {
                    bump(&self.used, 1);
                }
                bump(&self.live, 1);
                i
            }
            Err(_) => return false,
        };
        self.set_lines(at, lines);
        self.key_at(at)
            .store(u64::from(tag) << 32 | u64::from(run), Ordering::Release);
        true
    }

    /// Updates the lines of `run` if it is named here.
    pub fn update(&self, tag: u32, run: u32, lines: [u64; L]) {
        if let Ok(i) = self.slot(tag, run) {
            self.set_lines(i, lines);
        }
    }

    /// Drops `run`'s entry, if any.
    pub fn remove(&self, tag: u32, run: u32) {
        if let Ok(i) = self.slot(tag, run) {
            self.key_at(i).store(TOMB, Ordering::Release);
            bump(&self.live, -1);
        }
    }

    /// Entries taken before the table counts as full: three quarters.
    fn limit(&self) -> usize {
        self.n * 3 / 4
    }

    /// Live entries.
    pub fn len(&self) -> usize {
        self.live.load(Ordering::Relaxed) as usize
    }

    /// The runs named here.
    pub fn runs(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.n).filter_map(|i| {
            let key = self.key_at(i).load(Ordering::Relaxed);
            (key != EMPTY && key != TOMB).then_some(key as u32)
        })
    }

    /// A copy with room for more entries: the live entries, in a table
    /// half again as large as they need (two thirds full).
    pub fn grown(&self) -> Self {
        let next = Self::with_entries((self.len() + 1) * 3 / 2 + 1);
        for i in 0..self.n {
            let key = self.key_at(i).load(Ordering::Relaxed);
            if key != EMPTY && key != TOMB {
                let placed = next.set((key >> 32) as u32, key as u32, self.lines(i));
                debug_assert!(placed, "a grown table has room for every live entry");
            }
        }
        next
    }
}

const ADDRESS: u64 = (1 << 48) - 1;

/// The home entry of `tag` in a table of `n` entries.
fn home_of(tag: u32, n: usize) -> usize {
    ((u64::from(tag) * n as u64) >> 32) as usize
}

/// The address of the home entry of `tag` in the table of a
/// [`Branches::place`] word of a table of `L` line words (its first entry
/// when the word holds no count): for prefetching only, never read
/// through.
pub(crate) fn home_line<const L: usize>(place: u64, tag: u32) -> *const AtomicU64 {
    let words = (place & ADDRESS) as usize as *const AtomicU64;
    let n = (place >> 48) as usize;
    words.wrapping_add(home_of(tag, n) * words_per_entry(L))
}

#[cfg(test)]
mod tests {
    use super::{Branches, home_line};

    /// A tag whose home entry in a table of `n` entries is `at`.
    fn tag_at(at: usize, n: usize, salt: u32) -> u32 {
        ((at as u64) << 32).div_ceil(n as u64) as u32 + salt
    }

    #[test]
    fn set_find_update_remove_and_grow() {
        let t = Branches::default();
        let (a, b, c) = (tag_at(1, 4, 0), tag_at(1, 4, 1), tag_at(3, 4, 0));
        assert!(t.find(a).is_none());
        assert!(t.set(a, 1, [10, 11]));
        assert!(t.set(b, 2, [20, 21]), "same home, next entry");
        assert!(t.set(c, 3, [30, 31]));
        assert_eq!(t.find(a), Some((1, [10, 11])));
        assert_eq!(t.find(b), Some((2, [20, 21])));
        // Three of four entries: full.
        assert!(!t.set(tag_at(0, 4, 1), 4, [40, 41]));
        t.update(a, 1, [13, 14]);
        assert_eq!(t.find(a), Some((1, [13, 14])));
        // An update of a run not named changes nothing.
        t.update(a, 9, [0, 0]);
        assert_eq!(t.find(a), Some((1, [13, 14])));
        t.remove(a, 1);
        assert_eq!(t.len(), 2);
        assert!(t.find(a).is_none());
        // The entry past the tombstone is still found.
        assert_eq!(t.find(b), Some((2, [20, 21])));
        let g = t.grown();
        assert_eq!(g.len(), 2);
        assert_eq!(g.find(b), Some((2, [20, 21])));
        assert_eq!(g.find(c), Some((3, [30, 31])));
        assert!(g.set(tag_at(0, 4, 1), 4, [40, 41]));
        assert_eq!(g.runs().count(), 3);
    }

    #[test]
    fn a_table_stays_within_half_again_its_live_entries() {
        let mut t = Branches::default();
        let tag = |run: u32| run.wrapping_mul(0x9E37_79B9) | 1;
        for run in 0..1000u32 {
            if !t.set(tag(run), run, [u64::from(run); 2]) {
                t = t.grown();
                assert!(t.set(tag(run), run, [u64::from(run); 2]));
            }
            assert!(
                t.n <= (t.len() * 3 / 2 + 2).max(4) * 4 / 3 + 1,
                "{} entries for {}",
                t.n,
                t.len()
            );
        }
        for run in 0..1000u32 {
            assert_eq!(t.find(tag(run)), Some((run, [u64::from(run); 2])));
        }
        // Removals leave tombstones; growth packs the live entries again.
        for run in 0..990u32 {
            t.remove(tag(run), run);
        }
        let g = t.grown();
        assert_eq!(g.len(), 10);
        assert!(g.n < 20, "{} entries for 10", g.n);
        assert_eq!(g.find(tag(995)), Some((995, [995; 2])));
        assert!(g.find(tag(5)).is_none());
    }

    #[test]
    fn wide_entries_and_the_home_line_of_a_place_word() {
        let t: Branches<4> = Branches::default();
        let (a, b) = (tag_at(2, 4, 0), tag_at(2, 4, 1));
        assert!(t.set(a, 7, [1, 2, 3, 4]));
        assert!(t.set(b, 8, [5, 6, 7, 8]));
        assert_eq!(t.find(a), Some((7, [1, 2, 3, 4])));
        assert_eq!(t.find(b), Some((8, [5, 6, 7, 8])));
        t.update(b, 8, [9, 9, 9, 9]);
        assert_eq!(t.grown().find(b), Some((8, [9, 9, 9, 9])));
        // The home line of a tag is the address of its home entry's key
        // word, for either width.
        let words = t.words.as_ptr();
        assert_eq!(home_line::<4>(t.place(), a), words.wrapping_add(2 * 5));
        let narrow = Branches::<2>::default();
        let c = tag_at(3, 4, 0);
        assert_eq!(
            home_line::<2>(narrow.place(), c),
            narrow.words.as_ptr().wrapping_add(3 * 3)
        );
        // A table past what the word's count holds names its first entry.
        let big = Branches::<2>::with_entries(1 << 16);
        assert_eq!(home_line::<2>(big.place(), c), big.words.as_ptr());
    }
}
