//! The writer side: ingest, removals, ALL_CLEARED, sweeps and eviction,
//! one at a time under the store's mutex.
//!
//! Changes that fit are written in place (cells, free row slots, appended
//! positions); anything else builds a new body and publishes it. Values
//! swapped out (bodies, key tables, branch and heads tables) are retired in
//! batches of [`RETIRE_BATCH`], each handed to the epoch as one deferred
//! flag store, and freed by a later write once every reader pinned before
//! them has unpinned, so a lookup never frees anything.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crossbeam_epoch as epoch;
use hashbrown::{HashMap, HashSet};
use parking_lot::MutexGuard;
use smallvec::SmallVec;

use super::body::{Body, HEAD_LINES, Row, Rows, head_lines, lines_of};
use super::data::{COUNTED, Cell, HEAD, RunData, uniform_count};
use super::key::{Blocks, HashRef, Key, loc, split};
use super::{AHEAD, MAX_RUNS, RUN_BLOCKS, Store};
use crate::branches::Branches;
use crate::catalog::{PartitionId, ReplicaId};
use crate::table::{KeyTable, Probe, Vacant};

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
pub(super) struct Link {
    pub(super) parent: u32,
    tag: u32,
}

impl Link {
    /// A run made without a parent (a chain's first run, or the first of
    /// a report whose earlier blocks are not stored).
    pub(super) const NONE: Self = Self {
        parent: u32::MAX,
        tag: 0,
    };
    /// A run whose parent was freed: not a chain's first run.
    pub(super) const ORPHAN: Self = Self {
        parent: u32::MAX - 1,
        tag: 0,
    };
}

/// Values retired together, and whether every reader pinned before they
/// were handed to the epoch has unpinned (then the next write drops them).
pub(super) struct RetiredBatch {
    pub(super) done: Arc<AtomicBool>,
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
    pub(super) table: Arc<KeyTable>,
    /// Mirror of the published bodies, by run id.
    pub(super) bodies: Vec<Option<Arc<Body>>>,
    /// Held cells per run.
    live: Vec<u32>,
    /// Per run, the run it continues and its entry there (see
    /// [`Link`]).
    pub(super) links: Vec<Link>,
    /// The published branch tables, by the run they belong to.
    pub(super) branches: HashMap<u32, Arc<Branches>>,
    /// The published heads table.
    pub(super) heads: Arc<Branches<HEAD_LINES>>,
    free: Vec<u32>,
    by_replica: HashMap<ReplicaId, HashSet<u32>>,
    /// Held cells in the store.
    entries: u64,
    /// Key tables and run bodies swapped out by earlier writes, kept until
    /// the epoch says no reader still holds them, so the writer, not a
    /// lookup, pays for freeing them (a lookup that freed a body on its own
    /// time showed in the p99 of lookups under a fast writer). Oldest
    /// first: batches come done in about the order they went.
    pub(super) retired: std::collections::VecDeque<RetiredBatch>,
    /// Swapped out and not yet handed to the epoch (fewer than
    /// [`RETIRE_BATCH`]: at most that many values wait for more writes).
    retiring: Vec<Retired>,
}

impl Writer {
    /// A writer of the store that publishes `table` and `heads`.
    pub(super) fn new(table: Arc<KeyTable>, heads: Arc<Branches<HEAD_LINES>>) -> Self {
        Self {
            table,
            heads,
            ..Self::default()
        }
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
    pub(super) w: MutexGuard<'s, Writer>,
}

impl Store {
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
    pub(super) fn body(&self, run: u32) -> Option<&Arc<Body>> {
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

    pub(super) fn locate(&self, part: PartitionId, key: &Key<'_>) -> Option<(u32, usize)> {
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
    pub(super) fn hand_to_epoch(&mut self) {
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
