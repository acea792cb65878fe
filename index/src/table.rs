//! The key table: `(partition, prefix hash)` → where the block lives (run
//! and position), readable without locks while one writer changes it.
//!
//! Open addressing with linear probing over 8-byte slots, each one atomic
//! word: a 32-bit tag taken from the mixed hash (never 0) and the 32-bit
//! location. A slot is written and read whole, so a reader never sees a tag
//! without its location. A removal turns the slot into a tombstone; nothing
//! is ever moved inside a table, so a probe that is under way cannot skip an
//! entry that stays. Growth (at 3/4 of slots used, tombstones included)
//! builds a new table and swaps it in whole; readers still probing the old
//! one see the state from before the swap. At 3/4 rather than 7/8, the
//! search for an absent key (every new block) stays short through a growth
//! cycle: 237 instead of 258 instructions per ingested block with one holder
//! (`docs/performance.md`), for a bigger table only while the key count
//! sits between 3/4 and 7/8 of a power of two.
//!
//! Tags are 32 bits, so unrelated keys may share one: a caller checks each
//! candidate location against the run it names (partition and hash at that
//! position) and probes on past a mismatch.
//!
//! A key's home slot is taken from its tag, so growth moves every entry
//! from its slot word alone, without reading the run it names (a cache
//! miss per key otherwise). Keys in one stretch of slots therefore share
//! their tag's low bits; the bits above the table's size still tell them
//! apart (8 bits at 16M slots), so a probe rarely checks a run in vain.
//!
//! The writer's search (`find_or_vacant`, one per new block) is the costly
//! part of ingest for a key that is absent: it walks to the end of the
//! cluster. It reads the slots with plain loads (the writer alone changes
//! them), through a slice of exactly `mask + 1` slots so that a masked index
//! needs no bounds check, and tests the tag first: a slot under another tag
//! costs one test. A new table is zeroed by the allocator, and growth fills
//! it without counting per entry (no reader sees it before the swap).
//!
//! A table of 4 MiB or more asks the kernel for transparent huge pages
//! (`madvise(MADV_HUGEPAGE)` on its 2 MiB-aligned part; Linux, where THP
//! is `always` or `madvise`). Every probe lands on a random slot, so with
//! 4 KiB pages nearly every one is a TLB miss as well as a cache miss, and
//! growth, which writes every entry to a random slot of the new table, a
//! page walk per entry: at 10M entries with one holder ingest ran at
//! 12–13M block reports/s with 4 KiB pages and 18–20M with huge pages in
//! alternating runs. The slots are touched evenly, so resident memory is
//! what it would be with small pages.

use std::sync::atomic::{AtomicU64, Ordering};

const EMPTY: u64 = 0;
const TOMB: u64 = 1;
/// Smallest table.
const MIN_SLOTS: usize = 16;

/// Adds `delta` to a counter only the writer changes (a load and a store,
/// not a locked add).
pub(crate) fn bump(counter: &AtomicU64, delta: i64) {
    let next = counter.load(Ordering::Relaxed).wrapping_add_signed(delta);
    counter.store(next, Ordering::Relaxed);
}

/// The tag a key's slot carries (upper 32 bits), which also fixes its home slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Probe {
    tag: u64,
}

impl Probe {
    /// The probe of a mixed 64-bit hash.
    pub fn of(mixed: u64) -> Self {
        Self {
            tag: (mixed >> 32).max(1) << 32,
        }
    }

    /// The 32-bit tag.
    pub fn tag(self) -> u32 {
        (self.tag >> 32) as u32
    }
}

#[derive(Debug, Default)]
struct Slot(AtomicU64);

/// A slot where a key that was not found can be inserted (valid until the
/// next insert or the next table).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Vacant(usize);

/// One generation of the table; replaced whole when it grows.
#[derive(Debug)]
pub(crate) struct KeyTable {
    slots: Box<[Slot]>,
    mask: usize,
    /// Live keys and used slots (live + tombstones); changed by the writer only.
    live: AtomicU64,
    used: AtomicU64,
}

impl Default for KeyTable {
    fn default() -> Self {
        Self::with_slots(MIN_SLOTS)
    }
}

impl KeyTable {
    fn with_slots(n: usize) -> Self {
        let n = n.max(MIN_SLOTS).next_power_of_two();
        // Zeroed by the allocator: a large table comes as fresh pages from
        // the system, which need no clearing pass.
        #[expect(
            unsafe_code,
            reason = "an all-zero slot is a valid (empty) slot; zeroed allocation skips a clearing pass"
        )]
        // SAFETY: `new_zeroed_slice` returns `n` zero-filled elements, and a
        // `Slot` is one `AtomicU64`, for which all-zero bits is the value 0
        // (`EMPTY`).
        let slots: Box<[Slot]> = unsafe { Box::new_zeroed_slice(n).assume_init() };
        advise_huge_pages(&slots);
        Self {
            slots,
            mask: n - 1,
            live: AtomicU64::new(0),
            used: AtomicU64::new(0),
        }
    }

    fn home(&self, probe: Probe) -> usize {
        (probe.tag >> 32) as usize & self.mask
    }

    /// The first location stored under the probe's tag that `accept` takes.
    pub fn find(&self, probe: Probe, mut accept: impl FnMut(u32) -> bool) -> Option<u32> {
        let mut i = self.home(probe);
        loop {
            let word = self.slots[i].0.load(Ordering::Acquire);
            if word == EMPTY {
                return None;
            }
            if word & !0xFFFF_FFFF == probe.tag && accept(word as u32) {
                return Some(word as u32);
            }
            i = (i + 1) & self.mask;
        }
    }

    /// [`find`](Self::find), or where an insert of the probe would go (the
    /// first empty or removed slot on its path), so that a writer adding a
    /// key it did not find probes once, not twice.
    ///
    /// For the writer only (it alone changes slots, so its loads need no
    /// ordering). The slots and mask are read once, and a slot under
    /// another tag — most of a probe's path — costs one test: a tag is
    /// never 0, so neither `EMPTY` nor `TOMB` passes for one.
    pub fn find_or_vacant(
        &self,
        probe: Probe,
        mut accept: impl FnMut(u32) -> bool,
    ) -> Result<u32, Vacant> {
        let mask = self.mask;
        // `mask + 1` slots, so that a slot index masked with it needs no
        // bounds check.
        let slots = &self.slots[..=mask];
        let mut i = self.home(probe);
        let mut vacant = None;
        loop {
            let word = slots[i & mask].0.load(Ordering::Relaxed);
            if (word ^ probe.tag) >> 32 == 0 {
                if accept(word as u32) {
                    return Ok(word as u32);
                }
            } else if word <= TOMB {
                if word == EMPTY {
                    return Err(Vacant(vacant.unwrap_or(i)));
                }
                vacant.get_or_insert(i);
            }
            i = (i + 1) & mask;
        }
    }

    /// Adds a key at `loc` in the slot [`find_or_vacant`](Self::find_or_vacant)
    /// found for it, when nothing was inserted since and the table is not
    /// [`full`](Self::full).
    pub fn insert_at(&self, vacant: Vacant, probe: Probe, loc: u32) {
        let slot = &self.slots[vacant.0].0;
        let word = slot.load(Ordering::Relaxed);
        debug_assert!(word == EMPTY || word == TOMB, "a vacant slot");
        slot.store(probe.tag | u64::from(loc), Ordering::Release);
        bump(&self.live, 1);
        if word == EMPTY {
            bump(&self.used, 1);
        }
    }

    /// Starts loading the key's home slot into the cache (a prefetch: it
    /// does not wait for the line), so that a caller about to probe many
    /// keys one after the other has their cache misses under way together
    /// instead of one at a time.
    pub fn touch(&self, probe: Probe) {
        crate::store::prefetch(&self.slots[self.home(probe)]);
    }

    /// [`touch`](Self::touch), and the slots eight on: a search for an
    /// absent key (the writer's, for a new block) runs on past its home
    /// slot, often into the next cache line.
    pub fn touch_path(&self, probe: Probe) {
        let mask = self.mask;
        let slots = &self.slots[..=mask];
        let home = (probe.tag >> 32) as usize;
        crate::store::prefetch(&slots[home & mask]);
        crate::store::prefetch(&slots[(home + 8) & mask]);
    }

    /// Whether one more insert needs a bigger table.
    pub fn full(&self) -> bool {
        (self.used.load(Ordering::Relaxed) as usize + 1) * 4 > self.slots.len() * 3
    }

    /// Live keys.
    pub fn len(&self) -> usize {
        self.live.load(Ordering::Relaxed) as usize
    }

    /// Bytes held by the slots.
    #[cfg(test)]
    pub fn bytes(&self) -> usize {
        self.slots.len() * std::mem::size_of::<Slot>()
    }

    /// Adds a key at `loc` (the caller knows it is absent and that the table
    /// is not [`full`](Self::full)).
    pub fn insert(&self, probe: Probe, loc: u32) {
        let mut i = self.home(probe);
        loop {
            let slot = &self.slots[i].0;
            let word = slot.load(Ordering::Relaxed);
            if word == EMPTY || word == TOMB {
                slot.store(probe.tag | u64::from(loc), Ordering::Release);
                // One writer: a load and a store, not a locked add.
                bump(&self.live, 1);
                if word == EMPTY {
                    bump(&self.used, 1);
                }
                return;
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Removes the key stored at `loc`; false if there is none.
    pub fn remove(&self, probe: Probe, loc: u32) -> bool {
        let mut i = self.home(probe);
        let want = probe.tag | u64::from(loc);
        loop {
            let slot = &self.slots[i].0;
            match slot.load(Ordering::Relaxed) {
                EMPTY => return false,
                word if word == want => {
                    slot.store(TOMB, Ordering::Release);
                    bump(&self.live, -1);
                    return true;
                }
                _ => {}
            }
            i = (i + 1) & self.mask;
        }
    }

    /// A table with room for twice the live keys (at least `min_live`) and
    /// at most twice as many slots, holding the same entries (each moved
    /// by its tag alone).
    pub fn rebuilt(&self, min_live: usize) -> Self {
        let live = self.len().max(min_live);
        // Room for twice the live keys under a 7/8 bound, but at most
        // double the table: rounding that room up to a power of two would
        // otherwise quadruple a table that filled up (16 bytes per key
        // instead of 8–16 at 1M keys).
        let slots = ((live + 1) * 2 * 8 / 7 + 1)
            .next_power_of_two()
            .min(self.slots.len() * 2);
        let next = Self::with_slots(slots);
        // No reader sees the new table before it is swapped in, and it has
        // no tombstones: each entry goes to the first empty slot from its
        // home, and the counts are set once at the end.
        let mask = next.mask;
        let to = &next.slots[..=mask];
        let mut moved = 0;
        for slot in self.slots.iter() {
            let word = slot.0.load(Ordering::Relaxed);
            if word <= TOMB {
                continue;
            }
            let mut i = (word >> 32) as usize;
            loop {
                let slot = &to[i & mask].0;
                if slot.load(Ordering::Relaxed) == EMPTY {
                    slot.store(word, Ordering::Relaxed);
                    break;
                }
                i += 1;
            }
            moved += 1;
        }
        next.live.store(moved, Ordering::Relaxed);
        next.used.store(moved, Ordering::Relaxed);
        next
    }

    /// Whether growth and tombstones left the table mostly empty (under 1/16 live).
    pub fn sparse(&self) -> bool {
        self.slots.len() > MIN_SLOTS * 4 && self.len() * 16 < self.slots.len()
    }
}

/// Tables from this size on ask for huge pages (see the module notes).
const HUGE_PAGE_TABLE: usize = 4 << 20;
const HUGE_PAGE: usize = 2 << 20;

/// Advises the kernel to back the 2 MiB-aligned part of a large table with
/// transparent huge pages; returns whether it took the advice (a small
/// table, another OS or a kernel without THP: `false`, and nothing changes).
fn advise_huge_pages(slots: &[Slot]) -> bool {
    let bytes = std::mem::size_of_val(slots);
    if bytes < HUGE_PAGE_TABLE {
        return false;
    }
    let start = slots.as_ptr() as usize;
    let from = start.next_multiple_of(HUGE_PAGE);
    let to = (start + bytes) / HUGE_PAGE * HUGE_PAGE;
    to > from && advise(from, to - from)
}

#[cfg(target_os = "linux")]
fn advise(from: usize, len: usize) -> bool {
    #[expect(
        unsafe_code,
        reason = "madvise is a hint about pages the table owns; it changes no byte of them"
    )]
    // SAFETY: `from..from + len` lies inside one live allocation (the
    // table's slots), page-aligned; MADV_HUGEPAGE only changes how the
    // kernel backs those pages, never their contents.
    let done = unsafe { libc::madvise(from as *mut libc::c_void, len, libc::MADV_HUGEPAGE) };
    done == 0
}

#[cfg(not(target_os = "linux"))]
fn advise(_from: usize, _len: usize) -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mixed(i: u64) -> u64 {
        i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (i << 40)
    }

    /// The `VmFlags` of the mapping of this process that holds `addr`.
    #[cfg(target_os = "linux")]
    fn vm_flags_at(addr: usize) -> Option<String> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let mut inside = false;
        for line in smaps.lines() {
            let range = line.split(' ').next().and_then(|r| r.split_once('-'));
            if let Some((from, to)) = range
                && let (Ok(from), Ok(to)) = (
                    usize::from_str_radix(from, 16),
                    usize::from_str_radix(to, 16),
                )
            {
                inside = (from..to).contains(&addr);
            } else if inside && let Some(flags) = line.strip_prefix("VmFlags:") {
                return Some(flags.trim().to_owned());
            }
        }
        None
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn a_large_table_asks_for_huge_pages_and_a_small_one_does_not() {
        let thp = std::path::Path::new("/sys/kernel/mm/transparent_hugepage").exists();
        // 8 MiB of slots: at least 4 MiB of it 2 MiB-aligned.
        let large = KeyTable::with_slots(1 << 20);
        let at = (large.slots.as_ptr() as usize).next_multiple_of(HUGE_PAGE);
        let flags = vm_flags_at(at).expect("the table's mapping");
        assert_eq!(
            flags.split(' ').any(|f| f == "hg"),
            thp,
            "VmFlags {flags:?} of the table's pages (THP in this kernel: {thp})"
        );
        assert_eq!(advise_huge_pages(&large.slots), thp);
        // Below 4 MiB nothing is asked.
        let small = KeyTable::with_slots(HUGE_PAGE_TABLE / 8 / 2);
        assert!(!advise_huge_pages(&small.slots));
        // The advice changes no slot: the large table works as any other.
        let t = large;
        for i in 0..10_000u64 {
            t.insert(Probe::of(mixed(i)), i as u32);
        }
        assert_eq!(t.len(), 10_000);
    }

    #[test]
    fn insert_find_remove_and_rebuild() {
        let mut t = KeyTable::default();
        for i in 0..1000u64 {
            if t.full() {
                t = t.rebuilt(0);
            }
            t.insert(Probe::of(mixed(i)), i as u32);
        }
        assert_eq!(t.len(), 1000);
        for i in 0..1000u64 {
            assert_eq!(t.find(Probe::of(mixed(i)), |_| true), Some(i as u32));
        }
        // Two entries under one tag are told apart by the caller.
        let p = Probe::of(mixed(5));
        t.insert(p, 777);
        assert_eq!(t.find(p, |loc| loc == 777), Some(777));
        assert!(t.remove(p, 5));
        assert!(!t.remove(p, 5));
        assert_eq!(t.find(p, |_| true), Some(777));
        assert_eq!(Probe::of(5).tag, 1 << 32, "a zero tag is never stored");
        for i in 0..1000u64 {
            t.remove(Probe::of(mixed(i)), i as u32);
        }
        assert_eq!(t.len(), 1);
        assert!(t.sparse());
        let small = t.rebuilt(0);
        assert_eq!(small.find(p, |_| true), Some(777));
        assert!(small.bytes() < t.bytes());
    }

    #[test]
    fn growth_keeps_used_slots_within_three_quarters_and_doubles() {
        let mut t = KeyTable::default();
        let mut sizes = vec![t.slots.len()];
        for i in 0..10_000u64 {
            if t.full() {
                t = t.rebuilt(0);
                sizes.push(t.slots.len());
            }
            t.insert(Probe::of(mixed(i)), i as u32);
            let used = t.used.load(Ordering::Relaxed) as usize;
            assert!(used * 4 <= t.slots.len() * 3, "{used} of {}", t.slots.len());
        }
        // 10,000 keys: 16,384 slots hold them within the bound.
        assert_eq!(t.slots.len(), 16_384);
        assert!(sizes.windows(2).all(|w| w[1] == w[0] * 2), "{sizes:?}");
    }

    #[test]
    fn a_key_not_found_goes_where_the_probe_stopped() {
        let t = KeyTable::with_slots(64);
        let p = Probe::of(mixed(1));
        t.insert(p, 10);
        let q = Probe {
            tag: p.tag ^ (1 << 32) ^ (1 << 40),
        };
        let vacant = t.find_or_vacant(q, |_| true).expect_err("absent");
        t.insert_at(vacant, q, 11);
        assert_eq!(t.find_or_vacant(q, |loc| loc == 11), Ok(11));
        assert_eq!(t.find(p, |loc| loc == 10), Some(10));
        assert_eq!(t.len(), 2);
        // A removed slot on the path is reused before the empty one after it.
        assert!(t.remove(p, 10));
        let used = t.used.load(Ordering::Relaxed);
        let r = Probe {
            tag: p.tag ^ (1 << 48),
        };
        let vacant = t.find_or_vacant(r, |_| true).expect_err("absent");
        t.insert_at(vacant, r, 12);
        assert_eq!(
            t.used.load(Ordering::Relaxed),
            used,
            "the tombstone was reused"
        );
        assert_eq!(t.find(r, |loc| loc == 12), Some(12));
        assert_eq!(t.find(q, |loc| loc == 11), Some(11));
    }
}
