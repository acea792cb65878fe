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
//!   then compares the following request hashes with the run's hash array in
//!   order — one probe per run, not per block — re-probing only where the
//!   request leaves the run. Holes are exact: a holder that lost a block in
//!   the middle has a cleared cell there and its match stops at it. A run's
//!   hashes, counts (two per word, or one count for the run while all its
//!   blocks have it, as an engine's full blocks do) and cells are one
//!   allocation ([`RunData`]); its published length and capacities sit in
//!   the body, so
//!   once a reader has the body it knows the address of every line it needs
//!   and starts their misses together.
//! - Each row slot keeps a **prefix word** ([`Prefix`]): how many leading
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
//!   carries its data's address as a prefetch hint ([`RunSlot`]), so a
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

use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use crossbeam_epoch as epoch;
use hashbrown::{HashMap, HashSet};
use parking_lot::{Mutex, MutexGuard};
use smallvec::SmallVec;

use crate::branches::{Branches, Lines, home_line};
use crate::catalog::{PartitionId, ReplicaId};
use crate::messages::BlockHashes;
use crate::table::{KeyTable, Probe, Vacant};

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

/// A prefix hash as the store sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HashRef<'a> {
    /// 8-byte hash, big-endian on the wire.
    Narrow(u64),
    /// Any other width.
    Wide(&'a [u8]),
}

impl<'a> HashRef<'a> {
    pub fn from_bytes(bytes: &'a [u8]) -> Self {
        match <[u8; 8]>::try_from(bytes) {
            Ok(array) => Self::Narrow(u64::from_be_bytes(array)),
            Err(_) => Self::Wide(bytes),
        }
    }

    /// The 64-bit word a run stores: the hash itself, or a digest of a wide one.
    pub fn word(self) -> u64 {
        match self {
            Self::Narrow(h) => h,
            Self::Wide(bytes) => {
                let mut acc = 0xcbf2_9ce4_8422_2325u64 ^ bytes.len() as u64;
                for chunk in bytes.chunks(8) {
                    let mut word = [0u8; 8];
                    word[..chunk.len()].copy_from_slice(chunk);
                    acc = mix(acc ^ u64::from_le_bytes(word), 0);
                }
                acc
            }
        }
    }

    pub fn is_wide(self) -> bool {
        matches!(self, Self::Wide(_))
    }
}

/// A key resolved for the store: its word and table probe.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Key<'a> {
    pub hash: HashRef<'a>,
    pub word: u64,
    probe: Probe,
}

impl<'a> Key<'a> {
    pub fn new(part: PartitionId, hash: HashRef<'a>) -> Self {
        let word = hash.word();
        Self {
            hash,
            word,
            probe: Probe::of(mix(word, part)),
        }
    }

    pub fn of_bytes(part: PartitionId, bytes: &'a [u8]) -> Self {
        Self::new(part, HashRef::from_bytes(bytes))
    }
}

/// The blocks of one report, in order, as [`Writing::hold`] reads them:
/// each block's hash and token count, its key built only where it is
/// needed (a block found at the next position of a run needs its word
/// alone, not its table probe).
pub(crate) trait Blocks {
    /// Number of blocks.
    fn len(&self) -> usize;
    /// Block `i`'s hash.
    fn hash(&self, i: usize) -> HashRef<'_>;
    /// Block `i`'s token count.
    fn count(&self, i: usize) -> u32;
    /// Block `i`'s word (what a run stores).
    fn word(&self, i: usize) -> u64 {
        self.hash(i).word()
    }
    /// Block `i`'s key in `part`.
    fn key(&self, part: PartitionId, i: usize) -> Key<'_> {
        Key::new(part, self.hash(i))
    }

    /// How many blocks from `i` on `body` holds one after the other at its
    /// positions from `pos` on, below `len`.
    fn held_from(&self, i: usize, body: &Body, pos: usize, len: usize) -> usize {
        (i..self.len())
            .zip(pos..len)
            .take_while(|&(i, p)| {
                let hash = self.hash(i);
                body.holds(p, hash, hash.word())
            })
            .count()
    }
}

/// Keys resolved up front (any width), with their token counts.
impl Blocks for [(Key<'_>, u32)] {
    fn len(&self) -> usize {
        <[_]>::len(self)
    }

    fn hash(&self, i: usize) -> HashRef<'_> {
        self[i].0.hash
    }

    fn count(&self, i: usize) -> u32 {
        self[i].1
    }

    fn word(&self, i: usize) -> u64 {
        self[i].0.word
    }

    fn key(&self, _: PartitionId, i: usize) -> Key<'_> {
        self[i].0
    }
}

/// A chain of 8-byte hashes (big-endian, as on the wire) and its token
/// counts: a block's word is its hash, so a key costs one mix.
pub(crate) struct NarrowChain<'a> {
    pub hashes: &'a [[u8; 8]],
    pub counts: &'a [u32],
}

impl Blocks for NarrowChain<'_> {
    fn len(&self) -> usize {
        self.counts.len().min(self.hashes.len())
    }

    fn hash(&self, i: usize) -> HashRef<'_> {
        HashRef::Narrow(u64::from_be_bytes(self.hashes[i]))
    }

    fn count(&self, i: usize) -> u32 {
        self.counts[i]
    }

    /// The chain's words against the run's, side by side.
    fn held_from(&self, i: usize, body: &Body, pos: usize, len: usize) -> usize {
        if body.is_wide() || pos >= len {
            return 0;
        }
        let stored = &body.data.words[HEAD + pos..HEAD + len];
        let asked = self.hashes.get(i..).unwrap_or_default();
        stored
            .iter()
            .zip(asked)
            .take_while(|(s, w)| s.load(Ordering::Relaxed) == u64::from_be_bytes(**w))
            .count()
    }
}

fn mix(hash: u64, part: PartitionId) -> u64 {
    let x = hash ^ u64::from(part).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let m = u128::from(x) * 0xA076_1D64_78BD_642F;
    (m as u64) ^ ((m >> 64) as u64)
}

fn loc(run: u32, pos: usize) -> u32 {
    (run << POS_BITS) | pos as u32
}

fn split(loc: u32) -> (u32, usize) {
    (loc >> POS_BITS, (loc & ((1 << POS_BITS) - 1)) as usize)
}

/// One holder's claim on one block: last seen (s), access count, tier (0: not held).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Cell(u64);

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
struct Prefix(u64);

const PREFIX_LEN: u64 = 0x7F;
const PREFIX_VERSION: u64 = 0x1_FFFF << 15;

impl Prefix {
    fn len(self) -> usize {
        (self.0 & PREFIX_LEN) as usize
    }

    fn tier(self) -> u8 {
        (self.0 >> 7) as u8
    }

    /// Position 0's last-seen second.
    fn first_seen(self) -> u32 {
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
struct RunSlot {
    body: Published<Body>,
    hint: AtomicU64,
    /// The runs that start right after one of this run's positions (see
    /// the `branches` module); none for most runs.
    branches: Published<Branches>,
}

/// A [`RunSlot`]'s hint word. Layout: bits 0–47 the data's address,
/// 48–55 the branch position (0: none), 56–63 the published length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Hint(u64);

impl Hint {
    const ADDRESS: u64 = (1 << 48) - 1;
    const BRANCH: u64 = 0xFF << 48;
    const LEN: u64 = 0xFF << 56;

    fn words(self) -> *const AtomicU64 {
        (self.0 & Self::ADDRESS) as usize as *const AtomicU64
    }

    fn branch(self) -> usize {
        ((self.0 & Self::BRANCH) >> 48) as usize
    }

    fn len(self) -> usize {
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
    next: Option<&'r Branches>,
}

impl RunSlot {
    fn empty() -> Self {
        Self {
            body: Published::empty(),
            hint: AtomicU64::new(0),
            branches: Published::empty(),
        }
    }

    fn hint(&self) -> Hint {
        Hint(self.hint.load(Ordering::Relaxed))
    }

    fn set_hint(&self, hint: Hint) {
        self.hint.store(hint.0, Ordering::Relaxed);
    }

    /// Publishes `body` (see [`Published::swap`]) and its hint; a body
    /// that replaces another of the run keeps the run's branch.
    fn swap(&self, body: Option<Arc<Body>>) -> Option<Arc<Body>> {
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
    fn hint_len(&self, len: usize) {
        self.set_hint(self.hint().with_len(len));
    }

    /// Notes that a report went on elsewhere after position `pos - 1`;
    /// whether that moved the run's branch.
    fn hint_branch(&self, pos: usize) -> bool {
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
    fn touch(&self, pos: usize) -> Ahead<'static> {
        prefetch_ptr(self.body.ptr.load(Ordering::Relaxed));
        let hint = self.hint();
        prefetch_ptr(hint.words().wrapping_add(HEAD + pos));
        Ahead {
            branch: hint.branch().saturating_sub(pos),
            end: hint.len().saturating_sub(pos),
            next: None,
        }
    }

    /// Starts the miss on the data line of position `pos`'s hash.
    fn touch_words(&self, pos: usize) {
        prefetch_ptr(self.hint().words().wrapping_add(HEAD + pos));
    }
}

/// Header word of a run's data: row slots handed out (shared by the
/// bodies that share the data). The published length and the capacities
/// live in the body, which a reader has in cache already.
const USED_ROWS: usize = 0;
const HEAD: usize = 1;

/// [`RunData::uniform`] of a run that stores each position's token count.
const COUNTED: u32 = u32::MAX;

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
fn uniform_count(mut counts: impl Iterator<Item = u32>) -> u32 {
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
struct RunData {
    words: Arc<[AtomicU64]>,
    wide: Option<Arc<WideBytes>>,
    /// Block and row capacity of `words` (fixed for the allocation).
    cap: u32,
    row_cap: u32,
    /// The token count of every position, or [`COUNTED`] when the counts
    /// are stored (fixed for the allocation: a count the run cannot take
    /// rebuilds it with stored counts). 4 bytes per block at one holder.
    uniform: u32,
}

impl RunData {
    fn new(cap: usize, row_cap: usize, wide: bool, uniform: u32) -> Self {
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
    fn copied(
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
    fn counted(&self) -> bool {
        self.uniform == COUNTED
    }

    /// Whether the run can take token counts `count(k)` for `k` in `0..n`
    /// as they are: it stores counts, or they are all its one count.
    fn takes_counts(&self, n: usize, count: impl Fn(usize) -> u32) -> bool {
        self.counted() || (0..n).all(|k| count(k) == self.uniform)
    }

    /// The stored counts' words (none for a run of one count).
    fn count_slice(&self) -> &[AtomicU64] {
        let cap = self.cap();
        &self.words[HEAD + cap..HEAD + cap + count_words(cap, self.uniform)]
    }

    fn cap(&self) -> usize {
        self.cap as usize
    }

    fn row_cap(&self) -> usize {
        self.row_cap as usize
    }

    /// Row slots handed out so far (writer only).
    fn used_rows(&self) -> usize {
        self.words[USED_ROWS].load(Ordering::Relaxed) as usize
    }

    fn set_used_rows(&self, n: usize) {
        self.words[USED_ROWS].store(n as u64, Ordering::Relaxed);
    }

    fn hash(&self, pos: usize) -> u64 {
        self.words[HEAD + pos].load(Ordering::Relaxed)
    }

    fn count_word(&self, pos: usize) -> &AtomicU64 {
        &self.words[HEAD + self.cap() + pos / 2]
    }

    fn count(&self, pos: usize) -> u32 {
        if !self.counted() {
            return self.uniform;
        }
        (self.count_word(pos).load(Ordering::Relaxed) >> ((pos & 1) * 32)) as u32
    }

    /// Sets a token count (writer only: the other half of the word stays;
    /// a run of one count takes only that one, see [`takes_counts`]).
    ///
    /// [`takes_counts`]: Self::takes_counts
    fn set_count(&self, pos: usize, count: u32) {
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
    fn set_counts(&self, from: usize, n: usize, count: impl Fn(usize) -> u32) {
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
    fn prefix(&self, slot: usize) -> &AtomicU64 {
        &self.words[self.prefixes_at() + slot]
    }

    /// Every row slot's cells, slot after slot (`cap` each).
    fn cells_from(&self) -> &[AtomicU64] {
        &self.words[self.prefixes_at() + self.row_cap()..]
    }

    /// Cells of row slot `slot`, positions `from..to`.
    fn cells(&self, slot: usize, from: usize, to: usize) -> &[AtomicU64] {
        let base = self.prefixes_at() + self.row_cap() + slot * self.cap();
        &self.words[base + from..base + to]
    }

    /// Sets a cell of row slot `slot` (writer only), keeping the slot's
    /// [`Prefix`] true at every moment a reader may look: a write that
    /// would break it shortens the prefix first (and bumps its version),
    /// a write that extends it publishes the longer prefix after the cell.
    fn set_cell(&self, slot: usize, pos: usize, cell: Cell) {
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

    fn cell(&self, slot: usize, pos: usize) -> &AtomicU64 {
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
    fn set_stretch(
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
    fn join_prefix(&self, slot: usize, from: usize, to: usize, last_seen: u32, tier: u8) {
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
    fn extend_prefix(&self, slot: usize) {
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
type Rows = SmallVec<[Row; 4]>;

/// One row: a replica and the slot of its cells.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Row {
    pub replica: ReplicaId,
    slot: u32,
}

/// The lines a lookup reads first in a run it enters at position 0, as a
/// branch table keeps them: the body's address, and the data's address
/// with its block capacity and whether it stores counts in the top byte
/// (which place the prefix words).
fn lines_of(body: &Body) -> Lines {
    let data = &body.data;
    let top = data.cap() as u64 | u64::from(data.counted()) << 7;
    [
        std::ptr::from_ref(body) as u64,
        data.words.as_ptr() as u64 & Hint::ADDRESS | top << 56,
    ]
}

/// The data's words, their block capacity and the first prefix word, as
/// a [`lines_of`] word places them.
fn placed(data: u64) -> (*const AtomicU64, usize, *const AtomicU64) {
    let words = (data & Hint::ADDRESS) as usize as *const AtomicU64;
    let top = (data >> 56) as usize;
    let cap = top & 0x7F;
    let counts = if top & 0x80 == 0 { 0 } else { cap.div_ceil(2) };
    (words, cap, words.wrapping_add(HEAD + cap + counts))
}

/// Line words of a heads-table entry: those of [`lines_of`] (the data
/// word with the run's branch position in its free byte, bits 48 to 55),
/// the run's branch table and that table's [`Branches::place`].
const HEAD_LINES: usize = 4;

/// The branch position a heads-table entry's data word carries (0: none).
fn head_branch(data: u64) -> usize {
    ((data >> 48) & 0xFF) as usize
}

/// The heads-table entry of a run with body `body`, branch position
/// `branch` (0: none) and branch table `table`.
fn head_lines(body: &Body, branch: usize, table: &Branches) -> [u64; HEAD_LINES] {
    let [at, data] = lines_of(body);
    debug_assert!(branch < RUN_BLOCKS, "a branch position fits its byte");
    [
        at,
        data | (branch as u64) << 48,
        std::ptr::from_ref(table) as u64,
        table.place(),
    ]
}

/// Starts the misses on the lines of [`lines_of`]: the body, the hash
/// words from position 0 to the capacity and the first row slots' prefix
/// words.
fn prefetch_lines([body, data]: Lines) {
    let body = body as usize as *const u8;
    prefetch_ptr(body);
    prefetch_ptr(body.wrapping_add(64));
    let (words, cap, prefixes) = placed(data);
    let mut at = 0;
    while at < HEAD + cap {
        prefetch_ptr(words.wrapping_add(at));
        at += 8;
    }
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
    rows: Rows,
    data: RunData,
}

impl Body {
    fn new(part: PartitionId, len: usize, rows: Rows, data: RunData) -> Self {
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
    fn publish_len(&self, len: usize) {
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
    fn scan_stretch(&self, slot: usize, from: usize, to: usize) -> Stretch {
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
    pub fn follow(&self, pos: usize, len: usize, request: &BlockHashes, at: usize) -> usize {
        let n = request.len();
        let mut m = 1;
        if self.data.wide.is_none() {
            let stored = &self.data.words[HEAD + pos + 1..HEAD + len];
            if let BlockHashes::Narrow(words) = request {
                // Both sides are arrays of words: four blocks are compared
                // with one branch (their differences or-ed together), the
                // last few and the one that differs one by one.
                let asked = &words[at + 1..];
                let n = stored.len().min(asked.len());
                let (stored, asked) = (&stored[..n], &asked[..n]);
                let mut k = 0;
                for (s, w) in stored.chunks_exact(4).zip(asked.chunks_exact(4)) {
                    let differ = (s[0].load(Ordering::Relaxed) ^ u64::from_be_bytes(w[0]))
                        | (s[1].load(Ordering::Relaxed) ^ u64::from_be_bytes(w[1]))
                        | (s[2].load(Ordering::Relaxed) ^ u64::from_be_bytes(w[2]))
                        | (s[3].load(Ordering::Relaxed) ^ u64::from_be_bytes(w[3]));
                    if differ != 0 {
                        break;
                    }
                    k += 4;
                }
                return 1
                    + k
                    + stored[k..]
                        .iter()
                        .zip(&asked[k..])
                        .take_while(|(s, w)| s.load(Ordering::Relaxed) == u64::from_be_bytes(**w))
                        .count();
            }
            while at + m < n && m <= stored.len() {
                let HashRef::Narrow(word) = request.hash(at + m) else {
                    break;
                };
                if stored[m - 1].load(Ordering::Relaxed) != word {
                    break;
                }
                m += 1;
            }
            return m;
        }
        while at + m < n && pos + m < len {
            let hash = request.hash(at + m);
            if !self.holds(pos + m, hash, hash.word()) {
                break;
            }
            m += 1;
        }
        m
    }

    /// Starts loading the rows' prefix words, the first cells from `pos` of
    /// the first rows (none from position 0) and the hashes from `pos` on,
    /// so that their misses are under way together while the caller
    /// compares hashes. With a `branch` (blocks from `pos` to where
    /// requests were seen to leave the run; 0 for none) the hashes up to
    /// it: a request that goes on past it reads the rest in order, and one
    /// that leaves there (the end of a shared system prompt, say) does not
    /// wait behind lines it never compares.
    pub fn touch_cells(&self, pos: usize, branch: usize) {
        let len = match branch {
            0 => self.len(),
            k => self.len().min(pos + k + 1),
        };
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
        let mut at = pos;
        while at < len {
            prefetch(&self.data.words[HEAD + at]);
            at += 8;
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

    fn set(&self, row: usize, pos: usize, cell: Cell) {
        self.data.set_cell(self.rows[row].slot as usize, pos, cell);
    }

    /// Rows holding position `pos`.
    fn holders_at(&self, pos: usize) -> usize {
        (0..self.rows.len())
            .filter(|&r| self.cell(r, pos).held())
            .count()
    }

    /// Whether any row holds position `pos`.
    fn held_by_any(&self, pos: usize) -> bool {
        (0..self.rows.len()).any(|r| self.cell(r, pos).held())
    }

    fn row_live(&self, row: usize) -> usize {
        let len = self.len();
        self.cells(row, 0, len).filter(|c| c.held()).count()
    }

    fn is_wide(&self) -> bool {
        self.data.wide.is_some()
    }

    /// The probe of position `pos`.
    fn probe(&self, pos: usize) -> Probe {
        Probe::of(mix(self.data.hash(pos), self.part))
    }
}

/// Run id → current body; chunks are created once and never move.
struct RunDir {
    chunks: Box<[OnceLock<RunChunk>]>,
}

impl RunDir {
    fn new() -> Self {
        Self {
            chunks: (0..RUN_DIR).map(|_| OnceLock::new()).collect(),
        }
    }

    fn get(&self, run: u32) -> Option<&RunSlot> {
        let chunk = self.chunks.get(run as usize / RUN_CHUNK)?.get()?;
        chunk.get(run as usize % RUN_CHUNK)
    }

    fn slot(&self, run: u32) -> &RunSlot {
        let chunk = self.chunks[run as usize / RUN_CHUNK]
            .get_or_init(|| (0..RUN_CHUNK).map(|_| RunSlot::empty()).collect());
        &chunk[run as usize % RUN_CHUNK]
    }
}

/// One published `Arc<T>`, or none, that readers load under an epoch pin
/// without touching its count: the slot owns one strong count, and a value
/// swapped out is dropped only once every reader pinned before the swap
/// has unpinned ([`Writing`] retires it).
struct Published<T> {
    ptr: AtomicPtr<T>,
    owns: PhantomData<Arc<T>>,
}

impl<T> Published<T> {
    fn empty() -> Self {
        Self {
            ptr: AtomicPtr::new(std::ptr::null_mut()),
            owns: PhantomData,
        }
    }

    fn new(value: Arc<T>) -> Self {
        let slot = Self::empty();
        drop(slot.swap(Some(value)));
        slot
    }

    /// The value as of now, valid while `pin` is held (and the slot
    /// lives).
    fn load<'a>(&'a self, _pin: &'a epoch::Guard) -> Option<&'a T> {
        let ptr = self.ptr.load(Ordering::Acquire);
        #[expect(
            unsafe_code,
            reason = "an epoch-protected load: no reference count is touched on the read path"
        )]
        // SAFETY: a non-null pointer came from `Arc::into_raw` in `swap`, and
        // the strong count it stands for is released only by dropping what
        // `swap` returned, which the writer retires past every pin taken
        // before the swap, `_pin` included (`Writing::retire`), or by the
        // slot's own drop, which `'a` rules out; the value therefore
        // outlives `'a`. `T` is only read through `&T` (its changing parts
        // are atomics).
        unsafe {
            ptr.as_ref()
        }
    }

    /// Publishes `value` (with `Release`: everything written to it before
    /// is visible to a reader that loads it) and hands back the old one's
    /// count, which the caller must retire rather than drop while readers
    /// may hold it.
    fn swap(&self, value: Option<Arc<T>>) -> Option<Arc<T>> {
        let new = value.map_or(std::ptr::null_mut(), |v| Arc::into_raw(v).cast_mut());
        let old = self.ptr.swap(new, Ordering::AcqRel);
        #[expect(unsafe_code, reason = "takes back the strong count the slot owned")]
        // SAFETY: a non-null `old` came from `Arc::into_raw` above, and the
        // slot owned that one count, which it gives up here.
        (!old.is_null()).then(|| unsafe { Arc::from_raw(old) })
    }
}

impl<T> Drop for Published<T> {
    fn drop(&mut self) {
        // No reader borrows the store any more.
        drop(self.swap(None));
    }
}

/// A value swapped out of the store that a reader may still be reading.
#[expect(dead_code, reason = "held only to be dropped later")]
enum Retired {
    Body(Arc<Body>),
    Table(Arc<KeyTable>),
    Branches(Arc<Branches>),
    Heads(Arc<Branches<HEAD_LINES>>),
}

/// Where a run that starts right after another one is named: the run it
/// continues (whose branch table has an entry for it) and its first key's
/// tag.
#[derive(Debug, Clone, Copy)]
struct Link {
    parent: u32,
    tag: u32,
}

impl Link {
    /// A run made without a parent (a chain's first run, or the first of
    /// a report whose earlier blocks are not stored).
    const NONE: Self = Self {
        parent: u32::MAX,
        tag: 0,
    };
    /// A run whose parent was freed: not a chain's first run.
    const ORPHAN: Self = Self {
        parent: u32::MAX - 1,
        tag: 0,
    };
}

/// Values retired together, and whether every reader pinned before they
/// were handed to the epoch has unpinned (then the next write drops them).
struct RetiredBatch {
    done: Arc<AtomicBool>,
    #[expect(dead_code, reason = "held only to be dropped later")]
    values: Vec<Retired>,
}

/// Retired values handed to the epoch together: one deferred flag store
/// per batch, so that a lookup that runs the epoch's deferred work does
/// next to nothing, and a write's cost does not grow with what it retires.
const RETIRE_BATCH: usize = 32;

/// Writer-side state.
#[derive(Default)]
pub(crate) struct Writer {
    table: Arc<KeyTable>,
    /// Mirror of the published bodies, by run id.
    bodies: Vec<Option<Arc<Body>>>,
    /// Held cells per run.
    live: Vec<u32>,
    /// Per run, the run it continues and its entry there (see
    /// [`Link`]).
    links: Vec<Link>,
    /// The published branch tables, by the run they belong to.
    branches: HashMap<u32, Arc<Branches>>,
    /// The published heads table.
    heads: Arc<Branches<HEAD_LINES>>,
    free: Vec<u32>,
    by_replica: HashMap<ReplicaId, HashSet<u32>>,
    /// Held cells in the store.
    entries: u64,
    /// Key tables and run bodies swapped out by earlier writes, kept until
    /// the epoch says no reader still holds them, so the writer, not a
    /// lookup, pays for freeing them (a lookup that freed a body on its own
    /// time showed in the p99 of lookups under a fast writer). Oldest
    /// first: batches come done in about the order they went.
    retired: std::collections::VecDeque<RetiredBatch>,
    /// Swapped out and not yet handed to the epoch (fewer than
    /// [`RETIRE_BATCH`]: at most that many values wait for more writes).
    retiring: Vec<Retired>,
}

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
            writer: Mutex::new(Writer {
                table,
                heads,
                ..Writer::default()
            }),
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
    /// first run's directory slot, body, hash words and first prefix words,
    /// and at its branch the key-table slot of the request's block there,
    /// the branch table and that block's entry in it, all at once (see the
    /// `branches` module). A hint: a collision of tags or an entry gone
    /// stale costs wasted prefetches, never an answer.
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
    /// `ahead` names it in its branch table: its directory slot, body, hash
    /// words and first prefix words, all at once (see the `branches`
    /// module).
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

/// A new claim: replica, time and tier.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Claim {
    pub replica: ReplicaId,
    pub last_seen: u32,
    pub tier: u8,
}

/// What an ingest may add and what it did.
#[derive(Debug, Default)]
pub(crate) struct Holding {
    /// New entries that may still be added (global cap and tenant quota).
    pub room: i64,
    /// Most holders a key keeps; past it the stalest holder makes room.
    pub max_holders: usize,
    pub written: u64,
    pub added: i64,
    pub new_keys: i64,
    pub refused: u64,
    /// Holders that made room (holders-per-key bound).
    pub displaced: Vec<ReplicaId>,
}

/// What a removal took away: entries per replica and keys, per partition.
pub(crate) trait Removed {
    fn entry(&mut self, part: PartitionId, replica: ReplicaId);
    fn key(&mut self, part: PartitionId);
}

/// Exclusive access for changes.
pub(crate) struct Writing<'s> {
    store: &'s Store,
    w: MutexGuard<'s, Writer>,
}

impl Store {
    /// A lock-free reader.
    pub fn reader(&self) -> Reader<'_> {
        Reader {
            pin: epoch::pin(),
            store: self,
        }
    }

    /// The writer (blocks other writers, never readers). Frees what earlier
    /// writes retired once no reader can hold it.
    pub fn write(&self) -> Writing<'_> {
        let mut w = self.writer.lock();
        if !w.retired.is_empty() {
            // Moves the epoch on and runs the deferred work that is due here,
            // so that retired values (an outgrown key table among them) do
            // not wait for lookups to do it.
            epoch::pin().flush();
            while w
                .retired
                .front()
                .is_some_and(|b| b.done.load(Ordering::Acquire))
            {
                w.retired.pop_front();
            }
        }
        Writing { store: self, w }
    }
}

impl Writing<'_> {
    fn body(&self, run: u32) -> Option<&Arc<Body>> {
        self.w.bodies.get(run as usize)?.as_ref()
    }

    /// Held cells in the store.
    pub fn entries(&self) -> u64 {
        self.w.entries
    }

    /// Gives back the room of the per-replica run sets after many
    /// replicas were cleared.
    pub fn shrink(&mut self) {
        crate::catalog::shrink_map(&mut self.w.by_replica);
        crate::catalog::shrink_map(&mut self.w.branches);
    }

    /// Whether `replica` has a cell anywhere.
    pub fn holds_any(&self, replica: ReplicaId) -> bool {
        self.w.by_replica.contains_key(&replica)
    }

    /// Run id bound, for sweeps.
    pub fn run_bound(&self) -> u32 {
        self.w.bodies.len() as u32
    }

    /// Keys in the table, run bodies and bytes held by the table.
    #[cfg(test)]
    pub fn shape(&self) -> (usize, usize, usize) {
        let runs = self.w.bodies.iter().filter(|b| b.is_some()).count();
        (self.w.table.len(), runs, self.w.table.bytes())
    }

    /// Runs `replica` has a row in.
    #[cfg(test)]
    pub fn runs_of(&self, replica: ReplicaId) -> usize {
        self.w.by_replica.get(&replica).map_or(0, HashSet::len)
    }

    fn locate(&self, part: PartitionId, key: &Key<'_>) -> Option<(u32, usize)> {
        self.locate_or_vacant(part, key).ok()
    }

    /// Where `key` is, or the key-table slot it would go to. The search is
    /// inlined into its callers; a slot under the key's tag (rare on the
    /// way to an absent key's slot) is checked out of line, the key passed
    /// by value so that only that path copies it to memory (by reference,
    /// every search stored it first: 4.5 instructions per block).
    #[inline]
    fn locate_or_vacant(&self, part: PartitionId, key: &Key<'_>) -> Result<(u32, usize), Vacant> {
        let loc = self
            .w
            .table
            .find_or_vacant(key.probe, |loc| self.holds_at(part, *key, loc))?;
        Ok(split(loc))
    }

    /// Whether location `loc` holds `key` in `part`.
    #[inline(never)]
    fn holds_at(&self, part: PartitionId, key: Key<'_>, loc: u32) -> bool {
        let (run, pos) = split(loc);
        self.body(run)
            .is_some_and(|b| b.part == part && pos < b.len() && b.holds_key(pos, &key))
    }

    fn publish(&mut self, run: u32, body: Body) -> Arc<Body> {
        let body = Arc::new(body);
        let old = self.store.runs.slot(run).swap(Some(body.clone()));
        self.w.bodies[run as usize] = Some(body.clone());
        self.retire(old.map(Retired::Body));
        // The run it continues names where its lines are now.
        let link = self.w.links[run as usize];
        if link.parent != Link::NONE.parent
            && let Some(table) = self.w.branches.get(&link.parent)
        {
            table.update(link.tag, run, lines_of(&body));
        }
        // So does the heads table, if it names the run.
        if self.is_head(run) {
            self.refresh_head(run);
        }
        body
    }

    /// Whether the heads table names `run`: made without a parent, and
    /// continued by others (it has a branch table).
    fn is_head(&self, run: u32) -> bool {
        self.head_table(run).is_some()
    }

    /// The branch table of `run` if the heads table names it (see
    /// [`is_head`](Self::is_head)).
    fn head_table(&self, run: u32) -> Option<&Arc<Branches>> {
        if self.w.links[run as usize].parent != Link::NONE.parent {
            return None;
        }
        self.w.branches.get(&run)
    }

    /// Makes the heads table's entry for `run` true: a run made without a
    /// parent that has a branch table is named there under its first key's
    /// tag (see [`head_lines`]), any other is not.
    fn refresh_head(&mut self, run: u32) {
        let Some(body) = self.body(run).filter(|b| b.len() > 0) else {
            return;
        };
        let tag = body.probe(0).tag();
        let lines = self
            .head_table(run)
            .map(|table| head_lines(body, self.store.runs.slot(run).hint().branch(), table));
        let Some(lines) = lines else {
            self.w.heads.remove(tag, run);
            return;
        };
        if self.w.heads.set(tag, run, lines) {
            return;
        }
        let next = self.w.heads.grown();
        let placed = next.set(tag, run, lines);
        debug_assert!(placed, "a grown heads table has room");
        let next = Arc::new(next);
        let old = self.store.heads.swap(Some(next.clone()));
        self.w.heads = next;
        self.retire(old.map(Retired::Heads));
    }

    /// Rebuilds `run` to store each position's token count (it kept one
    /// count for all), for a count it could not take.
    fn keep_counts(&mut self, run: u32) {
        let Some(body) = self.body(run).cloned() else {
            return;
        };
        if !body.data.counted() {
            let next = rebuilt_counting(&body, body.data.cap(), None, COUNTED);
            self.publish(run, next);
        }
    }

    /// Names `run`, which starts right after a position of `parent` with
    /// the key of `probe`, in `parent`'s branch table (made or grown as
    /// needed).
    fn link(&mut self, parent: u32, run: u32, probe: Probe) {
        let Some(lines) = self.body(run).map(|b| lines_of(b)) else {
            return;
        };
        let tag = probe.tag();
        let table = match self.w.branches.get(&parent) {
            Some(table) if table.set(tag, run, lines) => None,
            Some(table) => Some(table.grown()),
            None => Some(Branches::default()),
        };
        if let Some(table) = table {
            let placed = table.set(tag, run, lines);
            debug_assert!(placed, "a new or grown branch table has room");
            let table = Arc::new(table);
            let old = self
                .store
                .runs
                .slot(parent)
                .branches
                .swap(Some(table.clone()));
            self.w.branches.insert(parent, table);
            self.retire(old.map(Retired::Branches));
            // The heads table names where the parent's table lies now.
            self.refresh_head(parent);
        }
        self.w.links[run as usize] = Link { parent, tag };
    }

    /// Drops `run` from the branch table of the run it continues, and its
    /// own branch table (and heads-table entry) with it.
    fn unlink(&mut self, run: u32) {
        let link = std::mem::replace(&mut self.w.links[run as usize], Link::NONE);
        if let Some(table) = self.w.branches.get(&link.parent) {
            table.remove(link.tag, run);
        }
        if let Some(table) = self.w.branches.remove(&run) {
            for child in table.runs() {
                if let Some(l) = self.w.links.get_mut(child as usize)
                    && l.parent == run
                {
                    *l = Link::ORPHAN;
                }
            }
            let old = self.store.runs.slot(run).branches.swap(None);
            self.retire(old.map(Retired::Branches));
            self.refresh_head(run);
        }
    }

    /// Keeps the directory's count of a value swapped out of it until no
    /// reader can hold it: values go to the epoch [`RETIRE_BATCH`] at a
    /// time (a key table at once: it is large), and [`Store::write`] drops
    /// a batch once every reader pinned before it went has unpinned.
    fn retire(&mut self, old: Option<Retired>) {
        let Some(old) = old else {
            return;
        };
        let now = matches!(old, Retired::Table(_));
        self.w.retiring.push(old);
        if now || self.w.retiring.len() >= RETIRE_BATCH {
            self.hand_to_epoch();
        }
    }

    /// Hands the values retired so far to the epoch: one deferred flag
    /// store for the batch, pushed to the collector now (a lookup that runs
    /// it does one store).
    fn hand_to_epoch(&mut self) {
        if self.w.retiring.is_empty() {
            return;
        }
        let done = Arc::new(AtomicBool::new(false));
        let flag = done.clone();
        let pin = epoch::pin();
        pin.defer(move || flag.store(true, Ordering::Release));
        pin.flush();
        let values = std::mem::take(&mut self.w.retiring);
        self.w.retired.push_back(RetiredBatch { done, values });
    }

    /// Swaps in a grown table holding the key at `at` as well.
    #[cold]
    #[inline(never)]
    fn grow_table_with(&mut self, probe: Probe, at: u32) {
        let next = self.w.table.rebuilt(0);
        self.swap_table(next);
        self.w.table.insert(probe, at);
    }

    fn swap_table(&mut self, next: KeyTable) {
        let next = Arc::new(next);
        let old = self.store.table.swap(Some(next.clone()));
        self.w.table = next;
        self.retire(old.map(Retired::Table));
    }

    /// Shrinks the key table if removals left it mostly empty.
    pub fn compact_table(&mut self) {
        if !self.w.table.sparse() {
            return;
        }
        let next = self.w.table.rebuilt(0);
        self.swap_table(next);
    }

    fn new_run_id(&mut self) -> Option<u32> {
        if let Some(id) = self.w.free.pop() {
            return Some(id);
        }
        let id = u32::try_from(self.w.bodies.len()).ok()?;
        if id >= MAX_RUNS {
            return None;
        }
        self.w.bodies.push(None);
        self.w.live.push(0);
        self.w.links.push(Link::NONE);
        Some(id)
    }

    /// Records that `replica` claims `blocks` (in report order) in `part`.
    ///
    /// A report's blocks are taken a stretch at a time: the blocks a run
    /// holds one after the other from the first one located are claimed
    /// with one row lookup and one prefix update, and new blocks that
    /// follow one another are appended to one run, each published as it is
    /// added (the table still needs one probe per new block, to keep every
    /// key at one position).
    pub fn hold<B: Blocks + ?Sized>(
        &mut self,
        part: PartitionId,
        blocks: &B,
        claim: Claim,
        h: &mut Holding,
    ) {
        let n = blocks.len();
        // Where the previous block went, and whether the stretch claimed
        // there is known to end before the next block.
        let mut prev: Option<(u32, usize)> = None;
        let mut ended = false;
        // The search for the next block, when the appends made it already.
        let mut ahead = None;
        let mut i = 0;
        while i < n {
            let next = ahead.take().unwrap_or_else(|| {
                let hash = blocks.hash(i);
                prev.filter(|_| !ended)
                    .and_then(|(run, pos)| {
                        let body = self.body(run)?;
                        (pos + 1 < body.len() && body.holds(pos + 1, hash, hash.word()))
                            .then_some((run, pos + 1))
                    })
                    .map_or_else(|| self.locate_or_vacant(part, &blocks.key(part, i)), Ok)
            });
            match next {
                Ok((run, pos)) => {
                    let taken = self.claim_from(part, run, pos, blocks, i, claim, h);
                    prev = Some((run, pos + taken - 1));
                    ended = true;
                    i += taken;
                }
                Err(_) if h.room <= 0 => {
                    h.refused += 1;
                    prev = None;
                    i += 1;
                }
                Err(vacant) => {
                    let (at, taken, searched) =
                        self.add_blocks(part, prev, vacant, blocks, i, claim, h);
                    prev = at;
                    ended = true;
                    ahead = searched;
                    i += taken;
                }
            }
        }
    }

    /// Claims block `first`, located at `run`'s position `pos`, and the
    /// blocks after it that the run holds at the positions after it;
    /// returns how many it claimed (the run's next position does not hold
    /// the next block).
    #[expect(clippy::too_many_arguments, reason = "one private call site")]
    fn claim_from<B: Blocks + ?Sized>(
        &mut self,
        part: PartitionId,
        run: u32,
        pos: usize,
        blocks: &B,
        first: usize,
        claim: Claim,
        h: &mut Holding,
    ) -> usize {
        let Some(body) = self.body(run) else {
            return 1;
        };
        let n = 1 + blocks.held_from(first + 1, body, pos + 1, body.len());
        // Counts the run cannot take as it is (it keeps one count for all
        // its positions): it stores each position's from now on.
        if !body.data.takes_counts(n, |k| blocks.count(first + k)) {
            self.keep_counts(run);
        }
        let Some(len) = self.body(run).map(|b| b.len()) else {
            return n;
        };
        // The report leaves the run inside it: a later request that shares
        // this report's head likely leaves it there too (and the heads
        // table says so, if it names the run).
        if first + n < blocks.len()
            && pos + n < len
            && self.store.runs.slot(run).hint_branch(pos + n)
            && self.is_head(run)
        {
            self.refresh_head(run);
        }
        let Some(body) = self.body(run) else {
            return n;
        };
        // The block after the stretch is searched for next (a shared head
        // ends, a private tail begins): start its miss before the claim.
        if first + n < blocks.len() {
            self.w.table.touch_path(blocks.key(part, first + n).probe);
        }
        // A holder may have to make room, or the room may run out: block
        // by block (neither changes the run's hashes or length).
        if body.row_count() >= h.max_holders.max(1) || h.room < n as i64 {
            for k in 0..n {
                self.claim_at(run, pos + k, blocks.count(first + k), claim, h);
            }
            return n;
        }
        body.data.set_counts(pos, n, |k| blocks.count(first + k));
        let row = match body.row(claim.replica) {
            Some(row) => row,
            None => match self.ensure_row(run, claim.replica) {
                Some(row) => row,
                None => return n,
            },
        };
        // The body is borrowed, not cloned: a reference count changed per
        // stretch costs an atomic instruction on the body's line.
        let w = &mut *self.w;
        let Some(body) = w.bodies.get(run as usize).and_then(Option::as_ref) else {
            return n;
        };
        let data = &body.data;
        let slot = body.rows[row].slot as usize;
        // A new cell is a new key where no other row holds the position.
        let rows: &[Row] = &body.rows;
        let (cells, cap) = (data.cells_from(), data.cap());
        let (mut added, mut new_keys) = (0u32, 0i64);
        data.set_stretch(slot, pos, pos + n, claim.last_seen, claim.tier, |p| {
            added += 1;
            let held = rows.iter().any(|r| {
                let s = r.slot as usize;
                s != slot && Cell(cells[s * cap + p].load(Ordering::Relaxed)).held()
            });
            new_keys += i64::from(!held);
        });
        w.live[run as usize] += added;
        w.entries += u64::from(added);
        h.written += n as u64;
        h.added += i64::from(added);
        h.room -= i64::from(added);
        h.new_keys += new_keys;
        n
    }

    fn claim_at(&mut self, run: u32, pos: usize, count: u32, claim: Claim, h: &mut Holding) {
        if self
            .body(run)
            .is_some_and(|b| !b.data.takes_counts(1, |_| count))
        {
            self.keep_counts(run);
        }
        // The body is borrowed, not cloned: a reference count changed per
        // block costs an atomic instruction on the body's line.
        let w = &mut *self.w;
        let Some(body) = w.bodies.get(run as usize).and_then(Option::as_ref) else {
            return;
        };
        body.data.set_count(pos, count);
        let own = body.row(claim.replica);
        if let Some(row) = own {
            let old = body.cell(row, pos);
            if old.held() {
                body.set(
                    row,
                    pos,
                    Cell::new(claim.last_seen, claim.tier, old.access()),
                );
                h.written += 1;
                return;
            }
        }
        if h.room <= 0 {
            h.refused += 1;
            return;
        }
        // Counting stops early when the bound cannot be reached.
        let holders = if body.row_count() < h.max_holders.max(1) {
            usize::from(body.held_by_any(pos))
        } else {
            body.holders_at(pos)
        };
        let mut displaced = false;
        if holders >= h.max_holders.max(1) {
            // The stalest other holder makes room (ties: lowest replica id).
            let victim = (0..body.row_count())
                .filter(|&r| body.replica(r) != claim.replica && body.cell(r, pos).held())
                .min_by_key(|&r| body.cell(r, pos).last_seen());
            if let Some(r) = victim {
                body.set(r, pos, Cell::default());
                w.live[run as usize] -= 1;
                w.entries -= 1;
                h.displaced.push(body.replica(r));
                displaced = true;
            }
        }
        if holders == 0 {
            h.new_keys += 1;
        }
        // A row of its own found above stands (rows change only by
        // `ensure_row` and by dropping empty ones, after this write).
        let row = match own {
            Some(row) => row,
            None => match self.ensure_row(run, claim.replica) {
                Some(row) => row,
                None => return,
            },
        };
        if let Some(body) = self.body(run) {
            body.set(row, pos, Cell::new(claim.last_seen, claim.tier, 0));
        }
        self.w.live[run as usize] += 1;
        self.w.entries += 1;
        h.written += 1;
        h.added += 1;
        if !displaced {
            h.room -= 1;
        }
        if let Some(&victim) = h.displaced.last().filter(|_| displaced) {
            self.drop_empty_rows(run, Some(victim));
        }
    }

    /// The row of `replica` in `run`'s body, adding one if needed.
    fn ensure_row(&mut self, run: u32, replica: ReplicaId) -> Option<usize> {
        let body = self.body(run)?;
        if let Some(row) = body.row(replica) {
            return Some(row);
        }
        let data = &body.data;
        let used = data.used_rows();
        let next = if used < data.row_cap() {
            data.set_used_rows(used + 1);
            let mut rows = body.rows.clone();
            let at = rows.partition_point(|r| r.replica < replica);
            rows.insert(
                at,
                Row {
                    replica,
                    slot: used as u32,
                },
            );
            Body::new(body.part, body.len(), rows, body.data.clone())
        } else {
            rebuilt(body, data.cap(), Some(replica))
        };
        self.w.by_replica.entry(replica).or_default().insert(run);
        self.publish(run, next).row(replica)
    }

    /// Adds block `first` (absent; its search stopped at `vacant`) and the
    /// absent blocks after it to the run of the previous block when that
    /// block ends it, else to a new run, up to the run's capacity; returns
    /// where the last one went, how many it added and, when it searched for
    /// the block after them, what that search found.
    #[expect(clippy::type_complexity, reason = "one private call site")]
    #[expect(clippy::too_many_arguments, reason = "one private call site")]
    fn add_blocks<B: Blocks + ?Sized>(
        &mut self,
        part: PartitionId,
        prev: Option<(u32, usize)>,
        vacant: Vacant,
        blocks: &B,
        first: usize,
        claim: Claim,
        h: &mut Holding,
    ) -> (
        Option<(u32, usize)>,
        usize,
        Option<Result<(u32, usize), Vacant>>,
    ) {
        let wide = blocks.hash(first).is_wide();
        // Append to the run of the previous block when that block ends it.
        let tail = prev.filter(|&(run, pos)| {
            self.body(run)
                .is_some_and(|b| pos + 1 == b.len() && pos + 1 < RUN_BLOCKS && b.is_wide() == wide)
        });
        let (run, start) = match tail {
            Some((run, pos)) => {
                let Some(body) = self.body(run) else {
                    return (None, 1, None);
                };
                if pos + 1 == body.data.cap() {
                    let cap = (body.data.cap() * 2).clamp(pos + 2, RUN_BLOCKS);
                    let next = rebuilt(body, cap, None);
                    self.publish(run, next);
                }
                // A run of one count that the blocks it may take do not all
                // have stores each position's count from now on (a new run
                // below is made to fit its blocks).
                let takes = self.body(run).is_none_or(|b| {
                    let n = (b.data.cap() - (pos + 1)).min(blocks.len() - first);
                    b.data.takes_counts(n, |k| blocks.count(first + k))
                });
                if !takes {
                    self.keep_counts(run);
                }
                (run, pos + 1)
            }
            None => {
                let Some(run) = self.new_run_id() else {
                    h.refused += 1;
                    return (None, 1, None);
                };
                // The new run starts with the claiming replica's row, and
                // keeps one count for all its positions if the blocks it may
                // take have one.
                let cap = (blocks.len() - first).clamp(1, RUN_BLOCKS);
                let uniform = uniform_count((first..first + cap).map(|i| blocks.count(i)));
                let data = RunData::new(cap, 1, wide, uniform);
                data.set_used_rows(1);
                let rows = Rows::from_slice(&[Row {
                    replica: claim.replica,
                    slot: 0,
                }]);
                self.publish(run, Body::new(part, 0, rows, data));
                self.w
                    .by_replica
                    .entry(claim.replica)
                    .or_default()
                    .insert(run);
                // A run that continues another one is named in its branch
                // table.
                if let Some((parent, _)) = prev {
                    self.link(parent, run, blocks.key(part, first).probe);
                }
                (run, 0)
            }
        };
        let Some(row) = self.ensure_row(run, claim.replica) else {
            return (None, 1, None);
        };
        // One reference for the whole stretch: the table may grow (a new
        // table, `&mut self`) while the run's body stays.
        let Some(body) = self.body(run).cloned() else {
            return (None, 1, None);
        };
        let data = &body.data;
        let slot = body.rows[row].slot as usize;
        let cap = data.cap();
        let counts = data.count_slice();
        let cell = Cell::new(claim.last_seen, claim.tier, 0).0;
        // Start the table misses of the next few blocks (most likely new
        // as well) so that they are under way together; a block found in
        // a run needs no probe, so only new ones look ahead.
        // Their probes are kept for their own searches.
        let end = blocks.len();
        let mut key = blocks.key(part, first);
        let mut probes = [key.probe; AHEAD];
        let ahead = |i: usize, table: &KeyTable, probes: &mut [Probe; AHEAD]| {
            if i < end {
                let probe = blocks.key(part, i).probe;
                probes[i % AHEAD] = probe;
                table.touch_path(probe);
            }
        };
        // The table, held here (not reached through `self` at every use);
        // taken again after a growth.
        let mut table = Arc::clone(&self.w.table);
        for i in first + 1..first + 1 + AHEAD {
            ahead(i, &table, &mut probes);
        }
        let mut pos = start;
        let mut vacant = vacant;
        // Blocks the run and the room take (the caller found room for
        // one): one bound for the loop to test.
        let limit = (cap - start).min(usize::try_from(h.room).unwrap_or(usize::MAX));
        // The hashes and cells the loop may write, `added` indexing them.
        let hashes = &data.words[HEAD + start..HEAD + start + limit];
        let cells = data.cells(slot, start, start + limit);
        let mut added = 0;
        let searched = loop {
            hashes[added].store(key.word, Ordering::Relaxed);
            // A position past the length has a zero count: an even one
            // sets its word, an odd one the upper half of its word (a run
            // of one count has it already).
            if !counts.is_empty() {
                let count = u64::from(blocks.count(first + added));
                let word = &counts[pos / 2];
                if pos.is_multiple_of(2) {
                    word.store(count, Ordering::Relaxed);
                } else {
                    let low = word.load(Ordering::Relaxed) & 0xFFFF_FFFF;
                    word.store(low | (count << 32), Ordering::Relaxed);
                }
            }
            if let (Some(wide), HashRef::Wide(bytes)) = (&data.wide, key.hash) {
                let _ = wide[pos].set(bytes.into());
            }
            cells[added].store(cell, Ordering::Release);
            body.publish_len(pos + 1);
            // The slot its failed search found: nothing since touched the table.
            if table.full() {
                self.grow_table_with(key.probe, loc(run, pos));
                table = Arc::clone(&self.w.table);
            } else {
                table.insert_at(vacant, key.probe, loc(run, pos));
            }
            added += 1;
            let i = first + added;
            if i == end {
                break None;
            }
            let probe = probes[i % AHEAD];
            ahead(i + AHEAD, &table, &mut probes);
            key = Key {
                hash: blocks.hash(i),
                word: blocks.word(i),
                probe,
            };
            let found = table.find_or_vacant(key.probe, |loc| self.holds_at(part, key, loc));
            match found {
                Err(next) if added < limit && key.hash.is_wide() == wide => {
                    vacant = next;
                    pos += 1;
                }
                other => break Some(other.map(split)),
            }
        };
        // The prefix was left as it was while the cells were added (true,
        // if short); it takes them in now.
        data.join_prefix(slot, start, pos + 1, claim.last_seen, claim.tier);
        self.store.runs.slot(run).hint_len(pos + 1);
        self.w.live[run as usize] += added as u32;
        self.w.entries += added as u64;
        h.room -= added as i64;
        h.written += added as u64;
        h.added += added as i64;
        h.new_keys += added as i64;
        (Some((run, pos)), added, searched)
    }

    /// Removes `replica`'s claim on a key; returns (entry removed, key removed).
    pub fn release(
        &mut self,
        part: PartitionId,
        key: &Key<'_>,
        replica: ReplicaId,
    ) -> (bool, bool) {
        let Some((run, pos)) = self.locate(part, key) else {
            return (false, false);
        };
        let Some(body) = self.body(run).cloned() else {
            return (false, false);
        };
        let Some(row) = body.row(replica) else {
            return (false, false);
        };
        if !body.cell(row, pos).held() {
            return (false, false);
        }
        body.set(row, pos, Cell::default());
        self.w.live[run as usize] -= 1;
        self.w.entries -= 1;
        let key_gone = body.holders_at(pos) == 0;
        self.drop_empty_rows(run, Some(replica));
        (true, key_gone)
    }

    /// Drops every cell of `replica` in the partitions `wanted` accepts.
    pub fn clear(
        &mut self,
        replica: ReplicaId,
        wanted: impl Fn(PartitionId) -> bool,
        removed: &mut impl Removed,
    ) {
        let Some(runs) = self.w.by_replica.get(&replica) else {
            return;
        };
        let runs: Vec<u32> = runs.iter().copied().collect();
        for run in runs {
            let Some(body) = self.body(run).cloned() else {
                continue;
            };
            if !wanted(body.part) {
                continue;
            }
            let Some(row) = body.row(replica) else {
                continue;
            };
            let len = body.len();
            for pos in 0..len {
                if !body.cell(row, pos).held() {
                    continue;
                }
                body.set(row, pos, Cell::default());
                self.w.live[run as usize] -= 1;
                self.w.entries -= 1;
                removed.entry(body.part, replica);
                if body.holders_at(pos) == 0 {
                    removed.key(body.part);
                }
            }
            self.drop_empty_rows(run, Some(replica));
        }
    }

    /// Visits every cell of a run: `keep` returns false to clear it.
    pub fn retain(
        &mut self,
        run: u32,
        mut keep: impl FnMut(PartitionId, ReplicaId, Cell) -> bool,
        removed: &mut impl Removed,
    ) {
        let Some(body) = self.body(run).cloned() else {
            return;
        };
        let len = body.len();
        let mut changed = false;
        for pos in 0..len {
            let mut cleared = false;
            for row in 0..body.row_count() {
                let cell = body.cell(row, pos);
                if cell.held() && !keep(body.part, body.replica(row), cell) {
                    body.set(row, pos, Cell::default());
                    self.w.live[run as usize] -= 1;
                    self.w.entries -= 1;
                    removed.entry(body.part, body.replica(row));
                    cleared = true;
                }
            }
            if cleared && body.holders_at(pos) == 0 {
                removed.key(body.part);
            }
            changed |= cleared;
        }
        if changed {
            self.drop_empty_rows(run, None);
        }
    }

    /// Visits every held cell of a run.
    pub fn for_each(&self, run: u32, mut visit: impl FnMut(PartitionId, ReplicaId, Cell)) {
        let Some(body) = self.body(run) else {
            return;
        };
        let len = body.len();
        for row in 0..body.row_count() {
            for cell in body.cells(row, 0, len).filter(|c| c.held()) {
                visit(body.part, body.replica(row), cell);
            }
        }
    }

    /// Drops rows without a held cell (only `replica`'s when given); frees
    /// the run when none is left.
    fn drop_empty_rows(&mut self, run: u32, replica: Option<ReplicaId>) {
        let Some(body) = self.body(run).cloned() else {
            return;
        };
        if self.w.live[run as usize] == 0 {
            self.free_run(run, &body);
            return;
        }
        let rows = match replica {
            Some(r) => body.row(r).map_or(0..0, |row| row..row + 1),
            None => 0..body.row_count(),
        };
        let empty: Vec<ReplicaId> = rows
            .filter(|&r| body.row_live(r) == 0)
            .map(|r| body.replica(r))
            .collect();
        if empty.is_empty() {
            return;
        }
        for replica in &empty {
            self.forget(*replica, run);
        }
        let rows: Vec<Row> = body
            .rows
            .iter()
            .copied()
            .filter(|r| !empty.contains(&r.replica))
            .collect();
        let data = &body.data;
        // Dead slots are never reused in place (a reader may still hold an
        // index naming them); rebuild when most row slots are dead.
        let next = if rows.len() * 2 < data.used_rows() {
            let trimmed = Body::new(
                body.part,
                body.len(),
                Rows::from_vec(rows),
                body.data.clone(),
            );
            rebuilt(&trimmed, data.cap(), None)
        } else {
            Body::new(
                body.part,
                body.len(),
                Rows::from_vec(rows),
                body.data.clone(),
            )
        };
        self.publish(run, next);
    }

    fn forget(&mut self, replica: ReplicaId, run: u32) {
        if let Some(set) = self.w.by_replica.get_mut(&replica) {
            set.remove(&run);
            if set.is_empty() {
                self.w.by_replica.remove(&replica);
            }
        }
    }

    fn free_run(&mut self, run: u32, body: &Arc<Body>) {
        let len = body.len();
        for pos in 0..len {
            self.w.table.remove(body.probe(pos), loc(run, pos));
        }
        for replica in body.replicas().collect::<Vec<_>>() {
            self.forget(replica, run);
        }
        self.unlink(run);
        let old = self.store.runs.slot(run).swap(None);
        self.w.bodies[run as usize] = None;
        self.retire(old.map(Retired::Body));
        self.w.free.push(run);
    }
}

/// Row slots a rebuilt run gets for `rows` rows: exact for the common one
/// or two holders (8 bytes per block and holder, nothing spare), half
/// again as many beyond, so adding holders one by one rebuilds rarely.
fn row_capacity(rows: usize) -> usize {
    match rows {
        0..=2 => rows.max(1),
        n => n + n / 2,
    }
}

/// A copy of `body` with `cap` block capacity, its live rows packed into
/// fresh slots and a row for `add` if given.
fn rebuilt(body: &Body, cap: usize, add: Option<ReplicaId>) -> Body {
    rebuilt_counting(body, cap, add, body.data.uniform)
}

/// [`rebuilt`], storing each position's count if `uniform` is
/// [`COUNTED`].
fn rebuilt_counting(body: &Body, cap: usize, add: Option<ReplicaId>, uniform: u32) -> Body {
    /// Slot of a row that had none.
    const NEW: u32 = u32::MAX;
    let mut rows = body.rows.clone();
    if let Some(replica) = add {
        let at = rows.partition_point(|r| r.replica < replica);
        rows.insert(at, Row { replica, slot: NEW });
    }
    let from: SmallVec<[Option<usize>; 8]> = rows
        .iter_mut()
        .enumerate()
        .map(|(slot, row)| {
            let from = std::mem::replace(&mut row.slot, slot as u32);
            (from != NEW).then_some(from as usize)
        })
        .collect();
    let len = body.len();
    let data = RunData::copied(
        &body.data,
        len,
        (cap, row_capacity(rows.len()), uniform),
        &from,
    );
    // The same cells: each prefix holds for them as it is, and may reach
    // further if it was cut short.
    for (slot, from) in from.iter().enumerate() {
        if from.is_some() {
            data.extend_prefix(slot);
        }
    }
    Body::new(body.part, len, rows, data)
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Count(Vec<(PartitionId, Option<ReplicaId>)>);

    impl Removed for Count {
        fn entry(&mut self, part: PartitionId, replica: ReplicaId) {
            self.0.push((part, Some(replica)));
        }
        fn key(&mut self, part: PartitionId) {
            self.0.push((part, None));
        }
    }

    fn holding(room: i64) -> Holding {
        Holding {
            room,
            max_holders: usize::MAX,
            ..Holding::default()
        }
    }

    fn claim(replica: ReplicaId, last_seen: u32) -> Claim {
        Claim {
            replica,
            last_seen,
            tier: 1,
        }
    }

    fn keys(part: PartitionId, range: std::ops::Range<u64>) -> Vec<(Key<'static>, u32)> {
        range
            .map(|h| (Key::new(part, HashRef::Narrow(h)), 16))
            .collect()
    }

    /// The body and position holding key `h` of `part`, which is stored.
    fn located<'r>(reader: &'r Reader<'_>, part: PartitionId, h: u64) -> (&'r Body, usize) {
        reader
            .locate(part, &Key::new(part, HashRef::Narrow(h)))
            .expect("stored")
    }

    /// Held cells of `replica` along `range` as a reader sees them.
    fn held(
        store: &Store,
        part: PartitionId,
        range: std::ops::Range<u64>,
        replica: ReplicaId,
    ) -> Vec<bool> {
        let reader = store.reader();
        range
            .map(|h| {
                let key = Key::new(part, HashRef::Narrow(h));
                reader.locate(part, &key).is_some_and(|(body, pos)| {
                    body.row(replica).is_some_and(|r| body.cell(r, pos).held())
                })
            })
            .collect()
    }

    #[test]
    fn layout_is_compact() {
        assert_eq!(std::mem::size_of::<Cell>(), 8);
        let c = Cell::new(0x1234_5678, 3, 9);
        assert_eq!(
            (c.last_seen(), c.tier(), c.access(), c.held()),
            (0x1234_5678, 3, 9, true)
        );
        assert!(!Cell::default().held());
    }

    #[test]
    fn chains_share_runs_and_holes_are_exact() {
        let store = Store::default();
        let mut w = store.write();
        let mut h = holding(1000);
        w.hold(1, &keys(1, 0..10)[..], claim(7, 100), &mut h);
        assert_eq!((h.added, h.new_keys, h.written), (10, 10, 10));
        assert_eq!(w.shape().1, 1, "one report, one run");
        // A second holder of the head and a divergent tail.
        let mut h = holding(1000);
        let mut other = keys(1, 0..4);
        other.extend(keys(1, 100..104));
        w.hold(1, &other[..], claim(3, 101), &mut h);
        assert_eq!((h.added, h.new_keys), (8, 4));
        assert_eq!(w.shape(), (14, 2, w.shape().2));
        // A refresh adds nothing.
        let mut h = holding(0);
        w.hold(1, &keys(1, 0..10)[..], claim(7, 102), &mut h);
        assert_eq!((h.added, h.refused, h.written), (0, 0, 10));
        // A hole in the middle.
        assert_eq!(
            w.release(1, &Key::new(1, HashRef::Narrow(5)), 7),
            (true, true)
        );
        assert_eq!(
            w.release(1, &Key::new(1, HashRef::Narrow(5)), 7),
            (false, false)
        );
        assert_eq!(w.entries(), 17);
        drop(w);
        let mut expect = vec![true; 10];
        expect[5] = false;
        assert_eq!(held(&store, 1, 0..10, 7), expect);
        assert_eq!(
            held(&store, 1, 0..10, 3)[..5],
            [true, true, true, true, false]
        );
        assert_eq!(
            held(&store, 2, 0..10, 7),
            vec![false; 10],
            "partitions are apart"
        );
    }

    /// Pins and unpins on another thread until every batch the writer
    /// retired is marked done (the epoch moved past every earlier pin), as
    /// lookups on other threads would; false if that does not happen
    /// `within` (the epoch is the process's: a test on another thread that
    /// is pinned holds it up for as long).
    fn others_pass_the_epoch(store: &Store, within: std::time::Duration) -> bool {
        let all_done = || {
            let w = store.writer.lock();
            !w.retired.is_empty() && w.retired.iter().all(|b| b.done.load(Ordering::Acquire))
        };
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    let deadline = std::time::Instant::now() + within;
                    while std::time::Instant::now() < deadline {
                        if all_done() {
                            return true;
                        }
                        epoch::pin().flush();
                        std::thread::yield_now();
                    }
                    false
                })
                .join()
                .expect("pinning thread")
        })
    }

    /// The current body of the run holding key `h` of `part`, weakly.
    fn body_of(store: &Store, part: PartitionId, h: u64) -> std::sync::Weak<Body> {
        let w = store.write();
        let (run, _) = w
            .locate(part, &Key::new(part, HashRef::Narrow(h)))
            .expect("stored");
        Arc::downgrade(w.body(run).expect("a body"))
    }

    /// With no reader pinned any more: lookups' threads pass the epoch and
    /// mark `old`'s batch done without dropping it, and the next write
    /// frees it.
    fn freed_by_the_next_write<T>(store: &Store, old: &std::sync::Weak<T>) {
        assert!(
            others_pass_the_epoch(store, std::time::Duration::from_secs(20)),
            "the epoch moves on"
        );
        assert!(old.upgrade().is_some(), "not freed on a reader's thread");
        drop(store.write());
        assert!(old.upgrade().is_none(), "freed by the writer");
    }

    #[test]
    fn a_body_a_reader_holds_is_freed_by_the_writer_not_the_reader() {
        let store = Store::default();
        let mut w = store.write();
        w.hold(1, &keys(1, 0..8)[..], claim(7, 100), &mut holding(1000));
        drop(w);
        let old = body_of(&store, 1, 0);
        let reader = store.reader();
        let (held, _) = located(&reader, 1, 0);
        // A second holder needs a row the run has no room for: a new body.
        let mut w = store.write();
        w.hold(1, &keys(1, 0..8)[..], claim(9, 100), &mut holding(1000));
        w.hand_to_epoch();
        drop(w);
        // However much the others pin and the writer writes, the body this
        // reader holds stays whole while it is pinned.
        assert!(
            !others_pass_the_epoch(&store, std::time::Duration::from_millis(50)),
            "the reader's pin holds the epoch"
        );
        for _ in 0..100 {
            drop(store.write());
            epoch::pin().flush();
        }
        assert!(old.upgrade().is_some(), "the reader's body waits");
        assert_eq!(held.len(), 8);
        let row = held.row(7).expect("the first holder's row");
        assert!(held.cell(row, 0).held(), "still readable");
        drop(reader);
        freed_by_the_next_write(&store, &old);
        // A freed run's body goes the same way.
        let old = body_of(&store, 1, 0);
        let reader = store.reader();
        let (held, _) = located(&reader, 1, 0);
        let mut w = store.write();
        let mut count = Count(Vec::new());
        w.clear(7, |_| true, &mut count);
        w.clear(9, |_| true, &mut count);
        assert_eq!(w.shape().1, 0, "the run is freed");
        w.hand_to_epoch();
        drop(w);
        assert!(old.upgrade().is_some(), "the reader's body waits");
        assert_eq!(held.len(), 8);
        drop(reader);
        freed_by_the_next_write(&store, &old);
    }

    #[test]
    fn an_outgrown_key_table_a_reader_holds_waits_for_it() {
        let store = Store::default();
        let reader = store.reader();
        let old = Arc::downgrade(&store.writer.lock().table);
        let held = reader.table();
        let before = held.bytes();
        // Enough new blocks to grow the table several times.
        let mut w = store.write();
        for start in (0..4096u64).step_by(64) {
            w.hold(
                1,
                &keys(1, start..start + 64)[..],
                claim(7, 100),
                &mut holding(1 << 20),
            );
        }
        drop(w);
        assert!(store.write().w.table.bytes() > before, "the table grew");
        assert!(old.upgrade().is_some(), "the reader's table waits");
        assert_eq!(held.bytes(), before, "and still reads whole");
        assert!(
            reader.table().bytes() > before,
            "a new load sees the new one"
        );
        drop(reader);
        freed_by_the_next_write(&store, &old);
        let reader = store.reader();
        assert!(reader.locate(1, &keys(1, 4095..4096)[0].0).is_some());
    }

    #[test]
    fn a_request_follows_a_run_exactly_as_far_as_its_hashes_agree() {
        let store = Store::default();
        let mut w = store.write();
        w.hold(1, &keys(1, 0..64)[..], claim(7, 100), &mut holding(1000));
        drop(w);
        let reader = store.reader();
        for from in [0u64, 1, 3, 17, 60] {
            let (body, pos) = located(&reader, 1, from);
            let len = body.len();
            for agree in 1..=(64 - from as usize) {
                // Two blocks of the request before the run's, then `agree`
                // of the run's, then one that differs and the run's again.
                let mut hashes: Vec<Vec<u8>> = vec![999u64.to_be_bytes().to_vec(); 2];
                hashes.extend((from..from + agree as u64).map(|h| h.to_be_bytes().to_vec()));
                hashes.push(5_000u64.to_be_bytes().to_vec());
                hashes.extend((from + agree as u64 + 1..64).map(|h| h.to_be_bytes().to_vec()));
                let chain =
                    crate::BlockChain::new(&hashes, vec![16; hashes.len()]).expect("a chain");
                let followed = body.follow(pos, len, &chain.hashes, 2);
                assert_eq!(followed, agree, "from {from}, agreeing for {agree}");
            }
        }
    }

    /// Length of `replica`'s prefix word in the run holding key `h`.
    fn prefix_len(store: &Store, part: PartitionId, h: u64, replica: ReplicaId) -> usize {
        let reader = store.reader();
        let (body, _) = located(&reader, part, h);
        let slot = body.rows[body.row(replica).expect("a row")].slot as usize;
        Prefix(body.data.prefix(slot).load(Ordering::Relaxed)).len()
    }

    /// Replica 7 reports blocks `range` of `part`, seen at `seen`.
    fn report_7(store: &Store, part: PartitionId, range: std::ops::Range<u64>, seen: u32) {
        store.write().hold(
            part,
            &keys(part, range)[..],
            claim(7, seen),
            &mut holding(1000),
        );
    }

    /// Replica 7's stretch over positions `from..to` of the run holding key
    /// 0 of `part`, asserting that reading it through the prefix word and
    /// cell by cell agree; its blocks and oldest second.
    fn stretch_7(store: &Store, part: PartitionId, from: usize, to: usize) -> (usize, u32) {
        let reader = store.reader();
        let (body, pos) = located(&reader, part, 0);
        let row = body.rows()[body.row(7).expect("a row")];
        let fast = body.row_stretch(row, pos + from, pos + to);
        let slow = body.scan_stretch(row.slot as usize, pos + from, pos + to);
        assert_eq!(
            (fast.blocks, fast.oldest, fast.tier, fast.ended),
            (slow.blocks, slow.oldest, slow.tier, slow.ended),
            "{from}..{to}: through the word and cell by cell"
        );
        (fast.blocks, fast.oldest)
    }

    #[test]
    fn prefix_words_cover_what_reports_wrote_in_order() {
        let store = Store::default();
        report_7(&store, 1, 0..64, 100);
        assert_eq!(prefix_len(&store, 1, 0, 7), 64, "one report in order");
        // A later refresh of the middle: the blocks after it are older.
        report_7(&store, 1, 10..20, 105);
        assert_eq!(prefix_len(&store, 1, 0, 7), 20);
        // A refresh of the whole chain in order covers it all again.
        report_7(&store, 1, 0..64, 110);
        assert_eq!(prefix_len(&store, 1, 0, 7), 64);
        // A hole ends it; a colder tier too.
        store
            .write()
            .release(1, &Key::new(1, HashRef::Narrow(30)), 7);
        assert_eq!(prefix_len(&store, 1, 0, 7), 30);
        let cold = Claim {
            tier: 2,
            ..claim(7, 111)
        };
        store
            .write()
            .hold(1, &keys(1, 0..1)[..], cold, &mut holding(1000));
        assert_eq!(prefix_len(&store, 1, 0, 7), 1, "block 0 alone at T2");
        // Stretches read through the word and cell by cell agree.
        for (from, to) in [(0, 1), (0, 30), (1, 30), (5, 29), (0, 64)] {
            stretch_7(&store, 1, from, to);
        }
    }

    #[test]
    fn the_prefix_word_keeps_position_zeros_second() {
        let store = Store::default();
        report_7(&store, 0, 0..3, 10);
        assert_eq!(stretch_7(&store, 0, 0, 3), (3, 10));
        // The blocks after the first refreshed later: still in order.
        report_7(&store, 0, 1..3, 20);
        assert_eq!(prefix_len(&store, 0, 0, 7), 3);
        assert_eq!(stretch_7(&store, 0, 0, 3), (3, 10));
        // The first block alone, at the second the others were seen: the
        // prefix stays, and so must the word's copy of position 0's second.
        report_7(&store, 0, 0..1, 20);
        assert_eq!(prefix_len(&store, 0, 0, 7), 3);
        assert_eq!(stretch_7(&store, 0, 0, 3), (3, 20));
        assert_eq!(stretch_7(&store, 0, 0, 1), (1, 20));
        // A newer first block breaks the order: the prefix is cut and
        // rebuilt from it.
        report_7(&store, 0, 0..1, 30);
        assert_eq!(stretch_7(&store, 0, 0, 3), (3, 20));
        assert_eq!(stretch_7(&store, 0, 0, 1), (1, 30));
    }

    #[test]
    fn room_cap_and_displacement() {
        let store = Store::default();
        let mut w = store.write();
        let mut h = holding(3);
        w.hold(0, &keys(0, 0..5)[..], claim(1, 10), &mut h);
        assert_eq!((h.added, h.refused), (3, 2));
        let mut h = Holding {
            room: 10,
            max_holders: 2,
            ..Holding::default()
        };
        w.hold(0, &keys(0, 0..1)[..], claim(2, 11), &mut h);
        w.hold(0, &keys(0, 0..1)[..], claim(3, 12), &mut h);
        assert_eq!(h.displaced, vec![1], "the stalest holder made room");
        drop(w);
        assert_eq!(held(&store, 0, 0..1, 1), [false]);
        assert_eq!(held(&store, 0, 0..1, 3), [true]);
    }

    #[test]
    fn a_block_named_twice_in_one_report_keeps_one_position() {
        let store = Store::default();
        let mut w = store.write();
        let mut h = holding(1000);
        let mut twice = keys(1, 0..3);
        twice.extend(keys(1, 1..2));
        twice.extend(keys(1, 3..5));
        w.hold(1, &twice[..], claim(7, 100), &mut h);
        assert_eq!((h.added, h.new_keys, h.written), (5, 5, 6));
        assert_eq!(w.shape().0, 5, "five keys");
        drop(w);
        assert_eq!(held(&store, 1, 0..5, 7), vec![true; 5]);
    }

    #[test]
    fn room_running_out_inside_a_stretch_refuses_the_rest() {
        let store = Store::default();
        let mut w = store.write();
        w.hold(1, &keys(1, 0..10)[..], claim(7, 100), &mut holding(1000));
        w.hold(1, &keys(1, 0..5)[..], claim(3, 100), &mut holding(1000));
        // Five refreshes, then room for three of the five new cells.
        let mut h = holding(3);
        w.hold(1, &keys(1, 0..10)[..], claim(3, 101), &mut h);
        assert_eq!((h.written, h.added, h.refused, h.new_keys), (8, 3, 2, 0));
        drop(w);
        let mut expect = vec![true; 8];
        expect.extend([false, false]);
        assert_eq!(held(&store, 1, 0..10, 3), expect);
        // The prefix word agrees with the cells it covers.
        assert_eq!(prefix_len(&store, 1, 0, 3), 8);
    }

    #[test]
    fn wide_chains_append_and_claim_in_runs() {
        let store = Store::default();
        let bytes: Vec<[u8; 16]> = (0..6u8).map(|b| [b; 16]).collect();
        let wide: Vec<(Key<'_>, u32)> = bytes
            .iter()
            .map(|b| (Key::new(2, HashRef::from_bytes(b)), 16))
            .collect();
        let mut w = store.write();
        let mut h = holding(100);
        w.hold(2, &wide[..4], claim(1, 10), &mut h);
        w.hold(2, &wide[..], claim(2, 11), &mut h);
        assert_eq!((h.added, h.new_keys, h.written), (10, 6, 10));
        assert_eq!(w.shape().1, 1, "appended to the one run");
        drop(w);
        let reader = store.reader();
        for (key, _) in &wide {
            let (body, pos) = reader.locate(2, key).expect("stored");
            assert!(body.row(2).is_some_and(|r| body.cell(r, pos).held()));
            assert_eq!(
                body.row(1).is_some_and(|r| body.cell(r, pos).held()),
                pos < 4
            );
        }
    }

    #[test]
    fn clear_frees_runs_and_keys() {
        let store = Store::default();
        let mut w = store.write();
        let mut h = holding(1000);
        for r in 0..3 {
            w.hold(0, &keys(0, 0..70)[..], claim(r, 5), &mut h);
        }
        w.hold(0, &keys(0, 500..501)[..], claim(9, 5), &mut h);
        assert_eq!(w.entries(), 211);
        let mut count = Count(Vec::new());
        w.clear(1, |_| true, &mut count);
        assert_eq!(count.0.len(), 70);
        assert_eq!(w.runs_of(1), 0);
        w.clear(0, |_| true, &mut count);
        w.clear(2, |_| true, &mut count);
        assert_eq!(count.0.iter().filter(|(_, r)| r.is_none()).count(), 70);
        assert_eq!(w.shape().0, 1, "only the other replica's key is left");
        assert_eq!(w.shape().1, 1);
        drop(w);
        assert_eq!(held(&store, 0, 500..501, 9), [true]);
    }

    /// Every directory slot's data hint names its current body's data, and
    /// none is left once the run is freed, through appends, rebuilds for new
    /// holders and clears.
    fn assert_hints_follow_bodies(store: &Store) {
        let pin = epoch::pin();
        for run in 0..store.write().run_bound() {
            let Some(slot) = store.runs.get(run) else {
                continue;
            };
            let hint = slot.hint().words();
            let len = slot.hint().len();
            match slot.body.load(&pin) {
                Some(body) => {
                    assert_eq!(hint, body.data.words.as_ptr(), "run {run}");
                    assert_eq!(len, body.len(), "run {run}'s length hint");
                }
                None => assert!(hint.is_null(), "freed run {run} keeps a hint"),
            }
        }
    }

    #[test]
    fn directory_hints_follow_their_bodies() {
        let store = Store::default();
        let mut h = holding(10_000);
        for r in 0..4 {
            store
                .write()
                .hold(0, &keys(0, 0..70)[..], claim(r, 5), &mut h);
            assert_hints_follow_bodies(&store);
        }
        store
            .write()
            .hold(0, &keys(0, 500..530)[..], claim(9, 5), &mut h);
        let mut count = Count(Vec::new());
        for r in 0..4 {
            store.write().clear(r, |_| true, &mut count);
            assert_hints_follow_bodies(&store);
        }
        assert_eq!(held(&store, 0, 500..530, 9), vec![true; 30]);
    }

    #[test]
    fn a_run_hints_where_requests_leave_it() {
        let store = Store::default();
        let mut h = holding(10_000);
        let key = |k: u64| Key::new(0, HashRef::Narrow(k));
        let ahead_of = |k: u64| {
            let reader = store.reader();
            let ahead = reader.touch_run(&key(k));
            (ahead.branch, ahead.end)
        };
        // One report of 40 blocks: one run, nowhere to branch yet.
        store
            .write()
            .hold(0, &keys(0, 0..40)[..], claim(1, 5), &mut h);
        assert_eq!(ahead_of(0), (0, 40));
        // Another shares its first 16 blocks, then goes on elsewhere.
        let mut other = keys(0, 0..16);
        other.extend(keys(0, 100..120));
        store.write().hold(0, &other[..], claim(2, 5), &mut h);
        assert_eq!(ahead_of(0), (16, 40));
        // From inside the run both count from the key's position; past the
        // branch only the end is ahead.
        assert_eq!(ahead_of(10), (6, 30));
        assert_eq!(ahead_of(20), (0, 20));
        // A new holder's row rebuilds the body: the branch stays.
        store
            .write()
            .hold(0, &keys(0, 0..40)[..], claim(3, 5), &mut h);
        assert_hints_follow_bodies(&store);
        assert_eq!(ahead_of(0).0, 16);
        // A key the table lacks: nothing ahead.
        assert_eq!(ahead_of(999), (0, 0));
    }

    /// The entry `parent`'s branch table has for the run that `first`
    /// (a key of partition 0) begins, as a reader finds it.
    fn branch_entry(store: &Store, parent: u64, first: u64) -> Option<(u32, Lines)> {
        let key = |k: u64| Key::new(0, HashRef::Narrow(k));
        let reader = store.reader();
        let ahead = reader.touch_run(&key(parent));
        ahead.next.and_then(|b| b.find(key(first).probe.tag()))
    }

    #[test]
    fn a_run_names_the_runs_that_continue_it() {
        let store = Store::default();
        let mut h = holding(10_000);
        let run_of = |k: u64| {
            let reader = store.reader();
            let loc = reader
                .table()
                .find(Key::new(0, HashRef::Narrow(k)).probe, |_| true)
                .expect("stored");
            split(loc).0
        };
        let lines_now = |k: u64| {
            let reader = store.reader();
            let (body, pos) = located(&reader, 0, k);
            assert_eq!(pos, 0, "key {k} begins its run");
            lines_of(body)
        };
        // One report: one run, which nothing continues.
        store
            .write()
            .hold(0, &keys(0, 0..40)[..], claim(1, 5), &mut h);
        let reader = store.reader();
        assert!(
            reader
                .touch_run(&Key::new(0, HashRef::Narrow(0)))
                .next
                .is_none()
        );
        drop(reader);
        // Two more share its first 16 blocks and go on in runs of their own:
        // the first run names both, with the lines a reader reads there.
        for (r, tail) in [(2, 100..120), (3, 200..230)] {
            let mut report = keys(0, 0..16);
            report.extend(keys(0, tail));
            store.write().hold(0, &report[..], claim(r, 5), &mut h);
        }
        assert_eq!(
            branch_entry(&store, 0, 100),
            Some((run_of(100), lines_now(100)))
        );
        assert_eq!(
            branch_entry(&store, 0, 200),
            Some((run_of(200), lines_now(200)))
        );
        // Asked from inside the run, the same table answers.
        assert_eq!(
            branch_entry(&store, 10, 100).map(|e| e.0),
            Some(run_of(100))
        );
        // A block of the run itself, or one no run begins: no entry.
        assert_eq!(branch_entry(&store, 0, 16), None);
        assert_eq!(branch_entry(&store, 0, 105), None);
        // A second holder rebuilds the run at 100: its entry follows the
        // new body and data.
        let before = lines_now(100);
        let mut report = keys(0, 0..16);
        report.extend(keys(0, 100..120));
        store.write().hold(0, &report[..], claim(4, 5), &mut h);
        assert_ne!(lines_now(100), before, "rebuilt");
        assert_eq!(
            branch_entry(&store, 0, 100),
            Some((run_of(100), lines_now(100)))
        );
        // A freed run leaves its parent's table.
        let mut count = Count(Vec::new());
        store.write().clear(3, |_| true, &mut count);
        assert_eq!(branch_entry(&store, 0, 200), None);
        assert!(branch_entry(&store, 0, 100).is_some());
        // A freed parent takes its table with it, and its children no
        // longer name it.
        let child = run_of(100);
        for r in [1, 2, 4] {
            store.write().clear(r, |_| true, &mut count);
        }
        let w = store.write();
        assert!(w.w.branches.is_empty());
        assert!(w.w.bodies.iter().all(Option::is_none));
        assert_eq!(w.w.links[child as usize].parent, Link::NONE.parent);
    }

    /// The stored token counts of keys `range` (partition 0), and whether
    /// each one's run stores counts.
    fn counts_of(store: &Store, range: std::ops::Range<u64>) -> Vec<(u32, bool)> {
        let reader = store.reader();
        range
            .map(|k| {
                let (body, pos) = located(&reader, 0, k);
                (body.count(pos), body.data.counted())
            })
            .collect()
    }

    /// Keys `range` of 16 tokens each, but the `at`-th with `count`.
    fn keys_but(
        range: std::ops::Range<u64>,
        (at, count): (usize, u32),
    ) -> Vec<(Key<'static>, u32)> {
        let mut out = keys(0, range);
        out[at].1 = count;
        out
    }

    /// `n` stored counts of 16, but the `at`-th `count`.
    fn stored_but(n: usize, (at, count): (usize, u32)) -> Vec<(u32, bool)> {
        let mut out = vec![(16, true); n];
        out[at].0 = count;
        out
    }

    #[test]
    fn a_run_of_one_token_count_stores_none() {
        let store = Store::default();
        let mut h = holding(10_000);
        // Full blocks: one count for the run, no count words.
        store
            .write()
            .hold(0, &keys(0, 0..40)[..], claim(1, 5), &mut h);
        assert_eq!(counts_of(&store, 0..40), vec![(16, false); 40]);
        // A second holder rebuilds the run: still one count.
        store
            .write()
            .hold(0, &keys(0, 0..40)[..], claim(2, 5), &mut h);
        assert_eq!(counts_of(&store, 0..40), vec![(16, false); 40]);
        {
            let reader = store.reader();
            let (body, _) = located(&reader, 0, 0);
            assert_eq!(
                body.data.words.len(),
                HEAD + 40 + 2 + 2 * 40,
                "no count words"
            );
        }
        // A chain whose last block is partial stores its counts.
        let partial = keys_but(100..110, (9, 5));
        store.write().hold(0, &partial[..], claim(1, 5), &mut h);
        assert_eq!(counts_of(&store, 100..110), stored_but(10, (9, 5)));
    }

    #[test]
    fn a_count_a_run_cannot_take_makes_it_store_them_all() {
        let mut h = holding(10_000);
        let held = |range: std::ops::Range<u64>, h: &mut Holding| {
            let store = Store::default();
            store.write().hold(0, &keys(0, range)[..], claim(1, 5), h);
            store
        };
        // A claim of known blocks with other counts (a stretch).
        let store = held(0..20, &mut h);
        let other = keys_but(0..6, (5, 7));
        store.write().hold(0, &other[..], claim(2, 5), &mut h);
        assert_eq!(counts_of(&store, 0..20), stored_but(20, (5, 7)));
        // Block by block (no room left for a new cell: the count is still
        // written).
        let store = held(0..20, &mut h);
        let other = keys_but(3..4, (0, 9));
        store
            .write()
            .hold(0, &other[..], claim(2, 5), &mut holding(0));
        assert_eq!(counts_of(&store, 0..20), stored_but(20, (3, 9)));
        // An append of a block with another count to a run of one count.
        let store = held(0..10, &mut h);
        let longer = keys_but(0..14, (13, 3));
        store.write().hold(0, &longer[..], claim(1, 5), &mut h);
        assert_eq!(counts_of(&store, 0..14), stored_but(14, (13, 3)));
        // Appends and new holders keep them.
        let longer = keys_but(0..30, (13, 3));
        store.write().hold(0, &longer[..], claim(2, 5), &mut h);
        assert_eq!(counts_of(&store, 0..30), stored_but(30, (13, 3)));
    }

    #[test]
    fn branch_lines_place_the_prefix_words_with_and_without_counts() {
        let store = Store::default();
        let mut h = holding(10_000);
        store
            .write()
            .hold(0, &keys(0, 0..40)[..], claim(1, 5), &mut h);
        let partial = keys_but(100..109, (8, 5));
        store.write().hold(0, &partial[..], claim(1, 5), &mut h);
        let reader = store.reader();
        for k in [0, 100] {
            let (body, _) = located(&reader, 0, k);
            let [at, data] = lines_of(body);
            assert_eq!(at, std::ptr::from_ref(body) as u64);
            let (words, cap, prefixes) = placed(data);
            assert_eq!(words, body.data.words.as_ptr());
            assert_eq!(cap, body.data.cap());
            assert_eq!(prefixes, std::ptr::from_ref(body.data.prefix(0)), "key {k}");
        }
    }

    /// The heads table's entry under the tag of key `first`.
    fn head_entry(store: &Store, first: u64) -> Option<(u32, [u64; HEAD_LINES])> {
        let reader = store.reader();
        let heads = reader.store.heads.load(&reader.pin)?;
        heads.find(Key::new(0, HashRef::Narrow(first)).probe.tag())
    }

    /// What the heads table should say of the run key `first` begins,
    /// from the run's body, hint and branch table as they are.
    fn head_expected(store: &Store, first: u64) -> (u32, [u64; HEAD_LINES]) {
        let reader = store.reader();
        let key = Key::new(0, HashRef::Narrow(first));
        let loc = reader.table().find(key.probe, |_| true).expect("stored");
        let (run, pos) = split(loc);
        assert_eq!(pos, 0, "key {first} begins its run");
        let slot = reader.store.runs.get(run).expect("a slot");
        let body = slot.body.load(&reader.pin).expect("a body");
        let table = slot.branches.load(&reader.pin).expect("a branch table");
        (run, head_lines(body, slot.hint().branch(), table))
    }

    #[test]
    fn a_chains_first_run_others_continue_is_named_in_the_heads_table() {
        let store = Store::default();
        let mut h = holding(100_000);
        let report = |head: std::ops::Range<u64>, tail: std::ops::Range<u64>| {
            let mut r = keys(0, head);
            r.extend(keys(0, tail));
            r
        };
        // A run nothing continues is not named.
        store
            .write()
            .hold(0, &keys(0, 0..40)[..], claim(1, 5), &mut h);
        assert_eq!(head_entry(&store, 0), None);
        // After a report, the run of key 0 is named as it is now, with
        // branch position `branch`.
        let named_with = |branch: usize| {
            let entry = head_entry(&store, 0).expect("named");
            assert_eq!(entry, head_expected(&store, 0));
            assert_eq!(head_branch(entry.1[1]), branch, "the branch position");
            entry
        };
        // Continued after its 16th block: named, with its lines, its
        // branch (16) and its branch table.
        store
            .write()
            .hold(0, &report(0..16, 100..120)[..], claim(2, 5), &mut h);
        let entry = named_with(16);
        // A new holder rebuilds its body: the entry follows.
        store
            .write()
            .hold(0, &keys(0, 0..16)[..], claim(3, 5), &mut h);
        assert_ne!(head_entry(&store, 0), Some(entry), "rebuilt");
        assert_eq!(head_entry(&store, 0), Some(head_expected(&store, 0)));
        // A report that leaves it earlier moves the branch.
        store
            .write()
            .hold(0, &report(0..8, 300..310)[..], claim(4, 5), &mut h);
        let entry = named_with(8);
        // Enough runs continue it that its branch table grows: the entry
        // names the new table.
        let place = entry.1[3];
        for k in 0..20u64 {
            let tail = 1_000 + k * 100..1_000 + k * 100 + 4;
            store
                .write()
                .hold(0, &report(0..16, tail)[..], claim(5, 5), &mut h);
        }
        let entry = head_entry(&store, 0).expect("named");
        assert_ne!(entry.1[3], place, "a grown table");
        assert_eq!(entry, head_expected(&store, 0));
        // A run others continue that continues a run itself is not named.
        store
            .write()
            .hold(0, &report(0..26, 500..504)[..], claim(6, 5), &mut h);
        store.write().hold(
            0,
            &[
                &keys(0, 0..16)[..],
                &keys(0, 100..110)[..],
                &keys(0, 600..604)[..],
            ]
            .concat()[..],
            claim(6, 5),
            &mut h,
        );
        assert!(branch_entry(&store, 100, 600).is_some(), "it has a table");
        assert_eq!(head_entry(&store, 100), None);
        // A lookup's touch of it, or of a key no run is named under, only
        // prefetches.
        let reader = store.reader();
        let hashes = BlockHashes::Narrow((0..40u64).map(u64::to_be_bytes).collect());
        reader.touch_head(0, &hashes, &Key::new(0, HashRef::Narrow(0)));
        reader.touch_head(0, &hashes, &Key::new(0, HashRef::Narrow(7_777)));
        drop(reader);
        // Freed, it leaves the table.
        let mut w = store.write();
        let mut count = Count(Vec::new());
        for replica in 1..=6 {
            w.clear(replica, |_| true, &mut count);
        }
        assert_eq!(w.w.heads.len(), 0);
        drop(w);
        assert_eq!(head_entry(&store, 0), None);
    }

    #[test]
    fn a_freed_parent_unlinks_its_children() {
        let store = Store::default();
        let mut h = holding(10_000);
        // Replica 1 holds the head alone; replica 2 the head and a tail.
        store
            .write()
            .hold(0, &keys(0, 0..40)[..], claim(1, 5), &mut h);
        let mut report = keys(0, 0..16);
        report.extend(keys(0, 100..120));
        store.write().hold(0, &report[..], claim(2, 5), &mut h);
        assert!(branch_entry(&store, 0, 100).is_some());
        // The head run goes (both drop it); the tail stays, unlinked.
        let mut count = Count(Vec::new());
        store.write().clear(1, |_| true, &mut count);
        let part_of_head = keys(0, 0..16);
        let mut w = store.write();
        for (key, _) in &part_of_head {
            w.release(0, key, 2);
        }
        assert!(w.w.branches.is_empty(), "the head's table went with it");
        assert_eq!(w.w.heads.len(), 0, "and its heads-table entry");
        // The tail names no parent, and is not taken for a chain's first.
        assert!(
            w.w.links
                .iter()
                .all(|l| l.parent == Link::NONE.parent || l.parent == Link::ORPHAN.parent)
        );
        drop(w);
        assert_eq!(held(&store, 0, 100..120, 2), vec![true; 20]);
        // A new report over the tail's first block links nothing stale.
        store
            .write()
            .hold(0, &keys(0, 0..16)[..], claim(3, 5), &mut h);
        assert!(branch_entry(&store, 0, 100).is_none());
    }

    #[test]
    fn wide_keys_work() {
        let store = Store::default();
        let bytes = [7u8; 16];
        let other = [8u8; 16];
        let mut w = store.write();
        let mut h = holding(10);
        let k = Key::new(0, HashRef::from_bytes(&bytes));
        w.hold(0, &[(k, 32)][..], claim(3, 1), &mut h);
        drop(w);
        let reader = store.reader();
        let (body, pos) = reader.locate(0, &k).expect("stored");
        assert_eq!(body.count(pos), 32);
        assert!(
            reader
                .locate(0, &Key::new(0, HashRef::from_bytes(&other)))
                .is_none()
        );
        assert_eq!(HashRef::from_bytes(&5u64.to_be_bytes()), HashRef::Narrow(5));
    }
}
