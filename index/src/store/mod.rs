//! The block store: runs of consecutive blocks with per-holder cells,
//! readable without locks.
//!
//! Shape:
//! - A **run** holds up to [`RUN_BLOCKS`] blocks of one partition that were
//!   reported one after the other: their hashes and token counts, and one
//!   8-byte cell per (holder, block) packing last-seen seconds, LFU access
//!   count and tier (tier 0: not held). Every key lives at exactly one
//!   position of one run, and a position never changes key while its run
//!   lives, so a chain walk finds the first block through the key table and
//!   then finds how far the request follows the run from a few compares with
//!   the run's hash array (block hashes are parent-chained, so the request
//!   and the run agree over a leading stretch and never after it: see
//!   [`Body::follow`]) — one probe per run, not per block — re-probing only
//!   where the request leaves the run. Holes are exact: a holder that lost a
//!   block in the middle has a cleared cell there and its match stops at it.
//!   A run's hashes, counts (two per word, or one count for the run while
//!   all its blocks have it, as an engine's full blocks do) and cells are one
//!   allocation ([`RunData`](data::RunData)); its published length and capacities sit in
//!   the body, so
//!   once a reader has the body it knows the address of every line it needs
//!   and starts their misses together.
//! - Each row slot keeps a **prefix word** ([`Prefix`](data::Prefix)): how many leading
//!   positions are held at one tier with last-seen seconds that never
//!   decrease. A lookup's stretch inside it is answered from the word and
//!   the stretch's first cell (its oldest) instead of a pass over every
//!   cell; the writer keeps the word true at every moment (it shortens it
//!   before a write that would break it, lengthens it after one that
//!   extends it).
//! - The **key table** ([`KeyTable`]) maps `(partition, hash)` to
//!   `run << 6 | position`. Hashes of any width are kept; a wide one is
//!   compared through a 64-bit digest and then in full.
//! - **Readers** take no locks and allocate nothing: a lookup pins the
//!   epoch once (`crossbeam-epoch`) and then loads the table and every run
//!   body through plain pointers ([`Published`]), touching no reference
//!   count; everything a writer changes in place is an atomic word
//!   (hashes, counts, cells, a run's published length), and a reader loads
//!   a run's length with `Acquire` before the positions below it, which the
//!   writer filled before publishing that length with `Release`. A position
//!   below the length never changes hash. A run's directory slot also
//!   carries its data's address as a prefetch hint ([`RunSlot`](dir::RunSlot)), so a
//!   reader starts the body and the data line it compares first together;
//!   a chain walk starts the next run's that way before it reads the cells
//!   of the current one, and locates it after. A run that others continue
//!   (a shared head) also has a **branch table** in its directory slot
//!   (the `branches` module): for each run that starts right after it, that
//!   run's body, hash and prefix-word addresses, so a lookup starts all of
//!   the next run's misses as soon as it knows where it will leave this
//!   one, instead of three dependent misses one after the other. The
//!   first run of a chain that others continue is also named in the
//!   store's **heads table** (same module) under its first key, with its
//!   lines, where a report last left it and where its branch table lies: a
//!   lookup reads that one entry before anything else and starts the
//!   misses of both runs it walks first together (the first run's
//!   directory slot, body and hashes; the next run's key-table slot and
//!   branch-table entry), where the key table would take three dependent
//!   misses to reach the first run alone. Row slots of a run are never
//!   reused while the run data lives, so a row index a reader loaded never
//!   points at another replica's cells.
//! - **One writer at a time** (a mutex around [`Writer`]): ingest, removals,
//!   clears and sweeps. In-place writes are cell refreshes, new cells in a
//!   free row slot and appended positions; adding a row past the row
//!   capacity, growing a run or dropping rows builds a new body and swaps it
//!   in (a rebuild writes each word of the new data once, copied or zero,
//!   prefix words included); the old one is retired: handed to the epoch
//!   in batches whose deferred work is one flag store, and freed by the
//!   writer once every reader pinned before it unpinned, so a lookup never
//!   frees anything. A reader may see a run between two writes of one
//!   update, which is the same answer as a lookup that ran between the two.
//! - **Ingest goes a stretch at a time** ([`Writing::hold`]): the blocks a
//!   run holds one after the other from the first one located (the report's
//!   words compared with the run's side by side) are claimed with one row
//!   lookup, one token-count pass (two to a word) and one prefix update
//!   (one check for the whole stretch: cut once if its first write would
//!   break the word, lengthened once after); new blocks that follow one
//!   another are appended in one pass, each published and inserted as it
//!   goes (so a later block of the same report finds it) and the prefix
//!   taken in at the end. Appends start the key-table misses of the next
//!   `AHEAD` blocks and keep their probes; a block found in a run needs no
//!   probe at all. A stretch where the room may run out or a holder may
//!   have to make room goes block by block.
//! - **Per-replica run sets** make ALL_CLEARED cost what the replica held,
//!   and a run whose last cell goes is freed with its keys at once.
//!
//! Memory per block: 8 (hash) + 8 per row slot (cell; exactly one or two
//! slots for one or two holders, half again as many beyond) + the key
//! table's 8-byte slot at 3/8–3/4 load (+ 4 for its token count in a run
//! whose blocks' counts differ), plus a run header, a 24-byte directory
//! slot and a prefix word per row slot shared by the run's blocks, and
//! about 32 bytes in its parent's branch table for a run that continues
//! another, and about 60 in the heads table for a chain's first run that
//! others continue.

use std::sync::Arc;

use crossbeam_epoch as epoch;
use parking_lot::Mutex;

use crate::branches::{Branches, home_line};
use crate::catalog::PartitionId;
use crate::messages::BlockHashes;
use crate::table::KeyTable;

/// Blocks one run holds at most.
pub(crate) const RUN_BLOCKS: usize = 64;
/// New blocks whose key-table slots an append starts loading ahead.
const AHEAD: usize = 16;
const POS_BITS: u32 = 6;
/// Runs the store can address.
const MAX_RUNS: u32 = 1 << (32 - POS_BITS);
/// Runs per directory chunk, and chunks.
const RUN_CHUNK: usize = 1 << 12;
const RUN_DIR: usize = (MAX_RUNS as usize).div_ceil(RUN_CHUNK);

/// Hints that the cache line holding `value` will be read soon, so that its
/// miss is under way while other work goes on; unlike a load, the CPU does
/// not wait for it.
#[inline(always)]
pub(crate) fn prefetch<T>(value: &T) {
    prefetch_ptr(std::ptr::from_ref(value));
}

/// [`prefetch`] of any address, valid or not (it is never read through).
#[inline(always)]
fn prefetch_ptr<T>(at: *const T) {
    #[cfg(target_arch = "x86_64")]
    #[expect(
        unsafe_code,
        reason = "a prefetch instruction is a hint: it never faults and changes no state"
    )]
    // SAFETY: `prefetcht0` never faults and has no effect on program state
    // whatever the address, and nothing is read through `at`.
    unsafe {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        _mm_prefetch::<_MM_HINT_T0>(at.cast::<i8>());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = at;
}

mod body;
mod data;
mod dir;
mod key;
mod publish;
mod writing;

pub(crate) use body::Stretch;
use body::{Body, HEAD_LINES, head_branch, prefetch_lines};
pub(crate) use data::Cell;
pub(crate) use dir::Ahead;
use dir::RunDir;
use key::split;
pub(crate) use key::{HashRef, Key, NarrowChain};
use publish::Published;
use writing::Writer;
pub(crate) use writing::{Claim, Holding, Removed, Writing};

#[cfg(test)]
mod tests;

/// The store.
pub(crate) struct Store {
    table: Published<KeyTable>,
    heads: Published<Branches<HEAD_LINES>>,
    runs: RunDir,
    writer: Mutex<Writer>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").finish_non_exhaustive()
    }
}

impl Default for Store {
    fn default() -> Self {
        let table = Arc::new(KeyTable::default());
        let heads = Arc::new(Branches::default());
        Self {
            table: Published::new(table.clone()),
            heads: Published::new(heads.clone()),
            runs: RunDir::new(),
            writer: Mutex::new(Writer::new(table, heads)),
        }
    }
}

/// A reader's view: an epoch pin, under which every key table and run body
/// it loads stays alive, and the store.
pub(crate) struct Reader<'s> {
    pin: epoch::Guard,
    store: &'s Store,
}

impl Reader<'_> {
    fn table(&self) -> &KeyTable {
        self.store
            .table
            .load(&self.pin)
            .expect("a store always has a table")
    }

    /// Loads the key's home slot so that a [`locate`](Self::locate) soon
    /// after finds it in cache.
    pub fn touch(&self, key: &Key<'_>) {
        self.table().touch(key.probe);
    }

    /// Starts loading the body of the run the key's slot names (the first
    /// one under its tag, unchecked: a hint) and the data line of the key's
    /// position, so that a [`locate`](Self::locate) soon after finds both
    /// in cache. Returns where a request that reaches the run at the key
    /// is likely to leave it (by the directory's hint; nothing when the key
    /// is not found), so that the caller can start those blocks' key-table
    /// misses too.
    pub fn touch_run(&self, key: &Key<'_>) -> Ahead<'_> {
        let mut ahead = Ahead::default();
        self.table().find(key.probe, |loc| {
            let (run, pos) = split(loc);
            if let Some(slot) = self.store.runs.get(run) {
                ahead = Ahead {
                    next: slot.branches.load(&self.pin),
                    ..slot.touch(pos)
                };
            }
            true
        });
        ahead
    }

    /// Starts the misses of the run a request's first block `key` (of
    /// `hashes`, in `part`) likely lies in, if the heads table names a run
    /// under its tag, and of the run the request likely goes on in: the
    /// first run's directory slot, body, first and last hash lines and
    /// first prefix words, and at its branch the key-table slot of the
    /// request's block there, the branch table and that block's entry in
    /// it, all at once (see the `branches` module). A hint: a collision of
    /// tags or an entry gone stale costs wasted prefetches, never an answer.
    pub fn touch_head(&self, part: PartitionId, hashes: &BlockHashes, key: &Key<'_>) {
        let Some((run, [body, data, table, place])) = self
            .store
            .heads
            .load(&self.pin)
            .and_then(|heads| heads.find(key.probe.tag()))
        else {
            return;
        };
        if let Some(slot) = self.store.runs.get(run) {
            prefetch(slot);
        }
        prefetch_lines([body, data]);
        let branch = head_branch(data);
        if branch > 0 && branch < hashes.len() {
            let next = Key::new(part, hashes.hash(branch));
            self.touch(&next);
            prefetch_ptr(table as usize as *const u8);
            prefetch_ptr(home_line::<2>(place, next.probe.tag()));
        }
    }

    /// Starts the misses of the run that `key` begins, if the run of
    /// `ahead` names it in its branch table: its directory slot, body,
    /// first and last hash lines and first prefix words, all at once (see
    /// the `branches` module).
    pub fn touch_next(&self, ahead: &Ahead<'_>, key: &Key<'_>) {
        let Some((run, lines)) = ahead.next.and_then(|b| b.find(key.probe.tag())) else {
            return;
        };
        if let Some(slot) = self.store.runs.get(run) {
            prefetch(slot);
        }
        prefetch_lines(lines);
    }

    /// Starts loading the directory slot of the run the key's table slot
    /// names (a hint, as [`touch_run`](Self::touch_run)): for a key whose
    /// table slot was asked for earlier and has likely arrived, so that a
    /// `touch_run` of it soon after finds both.
    pub fn touch_slot(&self, key: &Key<'_>) {
        self.table().find(key.probe, |loc| {
            if let Some(slot) = self.store.runs.get(split(loc).0) {
                prefetch(slot);
            }
            true
        });
    }

    /// The body and position holding `key` in `part`.
    pub fn locate(&self, part: PartitionId, key: &Key<'_>) -> Option<(&Body, usize)> {
        let mut found = None;
        self.table().find(key.probe, |loc| {
            let (run, pos) = split(loc);
            let slot = self.store.runs.get(run);
            // The hash compared below is one miss away from the slot, not
            // two (see `RunSlot`).
            if let Some(slot) = slot {
                slot.touch_words(pos);
            }
            let body = slot
                .and_then(|s| s.body.load(&self.pin))
                .filter(|b| b.part == part && pos < b.len() && b.holds_key(pos, key));
            found = body.map(|b| (b, pos));
            found.is_some()
        })?;
        found
    }
}

impl Store {
    /// A lock-free reader.
    pub fn reader(&self) -> Reader<'_> {
        Reader {
            pin: epoch::pin(),
            store: self,
        }
    }
}
