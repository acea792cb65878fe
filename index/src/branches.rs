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
//! Open addressing with linear probing over entries of four words: the key
//! word (the next run's first key's 32-bit tag in the upper half, the run
//! id in the lower; 0 empty, 1 removed) and three address words. The one
//! writer fills the address words before the key word (`Release`), updates
//! them in place when the run's body moves, and turns the key word into a
//! tombstone on removal; growth copies the live entries into a new table
//! that the store swaps in. Most runs have no branch table; a shared head
//! has one entry per conversation that continues it.

use std::sync::atomic::{AtomicU64, Ordering};

const EMPTY: u64 = 0;
const TOMB: u64 = 1;
const WORDS: usize = 4;
/// Entries in a new table.
const MIN_ENTRIES: usize = 4;

/// What a lookup prefetches of one run: opaque to this table.
pub(crate) type Lines = [u64; 3];

/// One run's branch table.
#[derive(Debug)]
pub(crate) struct Branches {
    words: Box<[AtomicU64]>,
    mask: usize,
    /// Entries taken, tombstones included (the writer's count).
    used: AtomicU64,
    live: AtomicU64,
}

impl Default for Branches {
    fn default() -> Self {
        Self::with_entries(MIN_ENTRIES)
    }
}

/// Adds `delta` to a count only the writer changes.
fn bump(counter: &AtomicU64, delta: i64) {
    let next = counter.load(Ordering::Relaxed).wrapping_add_signed(delta);
    counter.store(next, Ordering::Relaxed);
}

impl Branches {
    fn with_entries(n: usize) -> Self {
        let n = n.max(MIN_ENTRIES).next_power_of_two();
        Self {
            words: (0..n * WORDS).map(|_| AtomicU64::new(EMPTY)).collect(),
            mask: n - 1,
            used: AtomicU64::new(0),
            live: AtomicU64::new(0),
        }
    }

    fn key_at(&self, i: usize) -> &AtomicU64 {
        &self.words[i * WORDS]
    }

    fn lines_at(&self, i: usize) -> &[AtomicU64] {
        &self.words[i * WORDS + 1..(i + 1) * WORDS]
    }

    fn home(&self, tag: u32) -> usize {
        tag as usize & self.mask
    }

    /// The run continuing here whose first key carries `tag`, and its
    /// lines (the first such entry; tags of different keys may collide,
    /// and then a prefetch is wasted).
    pub fn find(&self, tag: u32) -> Option<(u32, Lines)> {
        let mut i = self.home(tag);
        for _ in 0..=self.mask {
            let key = self.key_at(i).load(Ordering::Acquire);
            if key == EMPTY {
                return None;
            }
            if key != TOMB && (key >> 32) as u32 == tag {
                let lines = self.lines_at(i);
                return Some((
                    key as u32,
                    [0, 1, 2].map(|k| lines[k].load(Ordering::Relaxed)),
                ));
            }
            i = (i + 1) & self.mask;
        }
        None
    }

    /// The slot of `(tag, run)`, or where it would go.
    fn slot(&self, tag: u32, run: u32) -> Result<usize, Option<usize>> {
        let want = u64::from(tag) << 32 | u64::from(run);
        let mut i = self.home(tag);
        let mut free = None;
        for _ in 0..=self.mask {
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
            i = (i + 1) & self.mask;
        }
        Err(free)
    }

    /// Names `run` (first key's tag `tag`) with `lines`, or updates its
    /// lines; false when the table has no room left for a new entry (the
    /// caller grows it).
    pub fn set(&self, tag: u32, run: u32, lines: Lines) -> bool {
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
        for (word, value) in self.lines_at(at).iter().zip(lines) {
            word.store(value, Ordering::Relaxed);
        }
        self.key_at(at)
            .store(u64::from(tag) << 32 | u64::from(run), Ordering::Release);
        true
    }

    /// Updates the lines of `run` if it is named here.
    pub fn update(&self, tag: u32, run: u32, lines: Lines) {
        if let Ok(i) = self.slot(tag, run) {
            for (word, value) in self.lines_at(i).iter().zip(lines) {
                word.store(value, Ordering::Relaxed);
            }
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
        (self.mask + 1) * 3 / 4
    }

    /// Live entries.
    pub fn len(&self) -> usize {
        self.live.load(Ordering::Relaxed) as usize
    }

    /// The runs named here.
    pub fn runs(&self) -> impl Iterator<Item = u32> + '_ {
        (0..=self.mask).filter_map(|i| {
            let key = self.key_at(i).load(Ordering::Relaxed);
            (key != EMPTY && key != TOMB).then_some(key as u32)
        })
    }

    /// A copy with room for one more entry: the live entries, in a table
    /// twice as large unless tombstones took the room.
    pub fn grown(&self) -> Self {
        let next = Self::with_entries((self.len() + 1) * 2);
        for i in 0..=self.mask {
            let key = self.key_at(i).load(Ordering::Relaxed);
            if key != EMPTY && key != TOMB {
                let lines = self.lines_at(i);
                let placed = next.set(
                    (key >> 32) as u32,
                    key as u32,
                    [0, 1, 2].map(|k| lines[k].load(Ordering::Relaxed)),
                );
                debug_assert!(placed, "a grown table has room for every live entry");
            }
        }
        next
    }
}

#[cfg(test)]
mod tests {
    use super::Branches;

    #[test]
    fn set_find_update_remove_and_grow() {
        let t = Branches::default();
        assert!(t.find(7).is_none());
        assert!(t.set(7, 1, [10, 11, 12]));
        assert!(t.set(7 + 4, 2, [20, 21, 22]), "same home, next slot");
        assert!(t.set(9, 3, [30, 31, 32]));
        assert_eq!(t.find(7), Some((1, [10, 11, 12])));
        assert_eq!(t.find(11), Some((2, [20, 21, 22])));
        // Three of four entries: full.
        assert!(!t.set(5, 4, [40, 41, 42]));
        t.update(7, 1, [13, 14, 15]);
        assert_eq!(t.find(7), Some((1, [13, 14, 15])));
        // An update of a run not named changes nothing.
        t.update(7, 9, [0, 0, 0]);
        assert_eq!(t.find(7), Some((1, [13, 14, 15])));
        t.remove(7, 1);
        assert_eq!(t.len(), 2);
        assert!(t.find(7).is_none());
        // The entry past the tombstone is still found.
        assert_eq!(t.find(11), Some((2, [20, 21, 22])));
        let g = t.grown();
        assert_eq!(g.len(), 2);
        assert_eq!(g.find(11), Some((2, [20, 21, 22])));
        assert_eq!(g.find(9), Some((3, [30, 31, 32])));
        assert!(g.set(5, 4, [40, 41, 42]));
        assert_eq!(g.runs().count(), 3);
    }

    #[test]
    fn a_full_table_of_tombstones_grows_back_to_its_live_entries() {
        let mut t = Branches::default();
        for run in 0..100u32 {
            if !t.set(run, run, [u64::from(run); 3]) {
                t = t.grown();
                assert!(t.set(run, run, [u64::from(run); 3]));
            }
            if run >= 2 {
                t.remove(run - 2, run - 2);
            }
        }
        assert_eq!(t.len(), 2);
        assert!(t.mask < 8, "{} entries for two live ones", t.mask + 1);
        assert_eq!(t.find(99), Some((99, [99; 3])));
        assert_eq!(t.find(98), Some((98, [98; 3])));
        assert!(t.find(97).is_none());
    }
}
