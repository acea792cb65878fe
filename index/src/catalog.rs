//! Interned names, index partitions and serving scopes.
//!
//! Every tenant / model / hash-scheme / adapter string is interned once into a
//! `u32`; replica ids have their own table so holder lists stay compact. A
//! *partition* is `(tenant, model, scheme, adapter)` and prefixes the key of
//! every block entry; a *scope* is the adapter-blind `(tenant, model, scheme)`
//! and records which replicas hold at least one entry in it (the serving set
//! behind distinguishing power, TENANT_HOT, AFFINITY_HINT and the diagnostics).
//!
//! Concurrency: the catalog sits behind a sharded reader-writer lock
//! (`ReadMostly` in `index.rs`) that is written only when a never-seen name or
//! partition appears or a sweep frees ids; lookups take it shared.
//! Per-partition counters are atomics; a scope's per-replica entry counts sit
//! under a mutex that only writers take (once per ingest batch), and lookups
//! read the scope's holders from a bitmap they need no lock for
//! ([`HolderSet`]).

use std::collections::BTreeMap;
use std::ops::Bound;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, Ordering};

use arc_swap::ArcSwap;
use hashbrown::{HashMap, HashSet};
use parking_lot::Mutex;
use smallvec::SmallVec;

use crate::parts_map::PartsMap;

/// Interned id of a tenant, model, scheme or adapter string.
pub(crate) type NameId = u32;
/// Interned id of a replica.
pub(crate) type ReplicaId = u32;
/// Index of a partition in [`Catalog::partitions`].
pub(crate) type PartitionId = u32;

/// Counters of one `(tenant, model, scheme, adapter)` partition.
#[derive(Debug)]
pub(crate) struct Partition {
    pub tenant: NameId,
    pub model: NameId,
    pub adapter: NameId,
    pub scope: u32,
    /// Distinct prefix keys.
    pub keys: AtomicI64,
    /// Block-replica entries.
    pub entries: AtomicI64,
    /// Block-replica entries of the whole tenant (shared by its partitions).
    pub tenant_entries: Arc<AtomicI64>,
}

/// Adapter-blind `(tenant, model, scheme)` scope and its serving replicas.
///
/// Writers (ingest, removals, sweeps) keep the entry count of each replica
/// under a mutex; lookups never take it. They read the replicas holding at
/// least one entry from a [`HolderSet`] that a writer updates whenever a
/// replica starts or stops holding (rare next to the entries themselves),
/// without a lock, so an ingest that is counting entries here never holds a
/// lookup up.
#[derive(Debug)]
pub(crate) struct Scope {
    pub tenant: NameId,
    pub model: NameId,
    /// Entries per replica across the scope's partitions.
    replicas: Mutex<HashMap<ReplicaId, i64>>,
    /// The keys of `replicas`: what lookups read.
    holders: HolderSet,
    /// Replicas with at least one entry.
    serving: AtomicU32,
}

impl Scope {
    fn new(tenant: NameId, model: NameId) -> Self {
        Self {
            tenant,
            model,
            replicas: Mutex::new(HashMap::new()),
            holders: HolderSet::default(),
            serving: AtomicU32::new(0),
        }
    }

    /// Adds `delta` entries to `replica`'s count, keeping the serving count exact.
    pub fn add(&self, replica: ReplicaId, delta: i64) {
        if delta == 0 {
            return;
        }
        let mut replicas = self.replicas.lock();
        let count = replicas.entry(replica).or_insert(0);
        let before = *count;
        *count += delta;
        let after = *count;
        if after <= 0 {
            replicas.remove(&replica);
        }
        // Under the mutex: the holder set's one writer at a time.
        if before <= 0 && after > 0 {
            self.serving.fetch_add(1, Ordering::Relaxed);
            self.holders.insert(replica);
        } else if before > 0 && after <= 0 {
            self.serving.fetch_sub(1, Ordering::Relaxed);
            self.holders.remove(replica);
        }
    }

    /// Number of replicas holding at least one entry.
    pub fn serving_count(&self) -> u32 {
        self.serving.load(Ordering::Relaxed)
    }

    /// Whether `replica` holds at least one entry in the scope (lock-free).
    pub fn holds(&self, replica: ReplicaId) -> bool {
        self.holders.contains(replica)
    }

    /// The replicas holding at least one entry, in id order (lock-free).
    pub fn holders(&self) -> SmallVec<[ReplicaId; 16]> {
        self.holders.ids()
    }

    /// The writers' mutex, as an ingest counting entries here holds it.
    #[cfg(test)]
    pub(crate) fn counting(&self) -> parking_lot::MutexGuard<'_, HashMap<ReplicaId, i64>> {
        self.replicas.lock()
    }

    /// Replicas holding at least one entry, with their entry counts (for
    /// snapshots: takes the writers' mutex).
    pub fn serving(&self) -> Vec<(ReplicaId, i64)> {
        self.replicas.lock().iter().map(|(&r, &n)| (r, n)).collect()
    }
}

/// Ids per chunk of a [`HolderSet`]: a chunk is 512 bytes.
const HOLDER_CHUNK: usize = 4096;

/// A set of replica ids that readers test and list without a lock, while
/// one writer at a time (the caller sees to that) puts ids in and takes
/// them out. A bitmap in chunks of [`HOLDER_CHUNK`] ids, each allocated
/// once an id of its range is in the set and dropped once none is: a bit
/// is set or cleared in place (an atomic word), and only a chunk coming or
/// going replaces the table of chunks (through `arc-swap`, a copy of one
/// pointer per chunk). So no change copies the set, however many replicas
/// hold (a sorted list replaced on every change would copy it: time
/// growing with the square of a flood of replica ids), and memory follows
/// the id ranges in use, an eighth of a byte per id of a chunk.
#[derive(Debug, Default)]
pub(crate) struct HolderSet {
    chunks: ArcSwap<Vec<Option<Arc<HolderChunk>>>>,
}

#[derive(Debug)]
struct HolderChunk {
    words: [AtomicU64; HOLDER_CHUNK / 64],
}

impl HolderSet {
    /// Where `id`'s bit is: its chunk, word and bit.
    fn place(id: ReplicaId) -> (usize, usize, u64) {
        let id = id as usize;
        (id / HOLDER_CHUNK, id % HOLDER_CHUNK / 64, 1 << (id % 64))
    }

    pub fn contains(&self, id: ReplicaId) -> bool {
        let (c, w, bit) = Self::place(id);
        let chunks = self.chunks.load();
        chunks
            .get(c)
            .and_then(Option::as_ref)
            .is_some_and(|chunk| chunk.words[w].load(Ordering::Acquire) & bit != 0)
    }

    /// The ids in the set, in order, each as it was at some moment of the
    /// call (a listing beside the writer is not one instant's).
    pub fn ids(&self) -> SmallVec<[ReplicaId; 16]> {
        let chunks = self.chunks.load();
        let mut ids = SmallVec::new();
        for (c, chunk) in chunks.iter().enumerate() {
            let Some(chunk) = chunk else { continue };
            for (w, word) in chunk.words.iter().enumerate() {
                let mut bits = word.load(Ordering::Acquire);
                while bits != 0 {
                    let at = c * HOLDER_CHUNK + w * 64 + bits.trailing_zeros() as usize;
                    ids.push(at as ReplicaId);
                    bits &= bits - 1;
                }
            }
        }
        ids
    }

    /// Puts `id` in (one writer at a time).
    pub fn insert(&self, id: ReplicaId) {
        let (c, w, bit) = Self::place(id);
        let chunks = self.chunks.load();
        if let Some(Some(chunk)) = chunks.get(c) {
            chunk.words[w].fetch_or(bit, Ordering::Release);
            return;
        }
        let chunk = HolderChunk {
            words: std::array::from_fn(|_| AtomicU64::new(0)),
        };
        chunk.words[w].store(bit, Ordering::Relaxed);
        let mut table = Vec::clone(&chunks);
        if table.len() <= c {
            table.resize(c + 1, None);
        }
        table[c] = Some(Arc::new(chunk));
        self.chunks.store(Arc::new(table));
    }

    /// Takes `id` out (one writer at a time).
    pub fn remove(&self, id: ReplicaId) {
        let (c, w, bit) = Self::place(id);
        let chunks = self.chunks.load();
        let Some(Some(chunk)) = chunks.get(c) else {
            return;
        };
        chunk.words[w].fetch_and(!bit, Ordering::Release);
        if chunk
            .words
            .iter()
            .any(|word| word.load(Ordering::Relaxed) != 0)
        {
            return;
        }
        let mut table = Vec::clone(&chunks);
        table[c] = None;
        while table.last().is_some_and(Option::is_none) {
            table.pop();
        }
        self.chunks.store(Arc::new(table));
    }

    /// Chunks allocated.
    #[cfg(test)]
    fn chunks(&self) -> usize {
        self.chunks.load().iter().flatten().count()
    }
}

/// One remembered resolution of a scope's four names (tenant, model,
/// scheme, adapter), valid for the catalog generation it was made at. The
/// lookup and the ingest each keep one per thread: consecutive requests and
/// reports nearly always name the same scope, and four string compares cost
/// far less than the hash probes of the names and id tuples they stand for.
pub(crate) struct ScopeMemo<T> {
    generation: u64,
    names: [String; 4],
    value: Option<T>,
}

impl<T: Copy> ScopeMemo<T> {
    pub const fn empty() -> Self {
        Self {
            generation: 0,
            names: [String::new(), String::new(), String::new(), String::new()],
            value: None,
        }
    }

    /// What `names` resolved to, if they are the remembered ones and the
    /// catalog is still at that generation.
    pub fn get(&self, generation: u64, names: [&str; 4]) -> Option<T> {
        let value = self.value?;
        let same = self.generation == generation
            && self
                .names
                .iter()
                .zip(names)
                .all(|(kept, name)| same_bytes(kept.as_bytes(), name.as_bytes()));
        same.then_some(value)
    }

    /// Remembers what `names` resolved to at `generation`.
    pub fn set(&mut self, generation: u64, names: [&str; 4], value: T) {
        // Names past this bound are resolved every time rather than copied.
        const MAX_NAME: usize = 256;
        if names.iter().any(|n| n.len() > MAX_NAME) {
            self.value = None;
            return;
        }
        for (kept, name) in self.names.iter_mut().zip(names) {
            kept.clear();
            kept.push_str(name);
        }
        self.generation = generation;
        self.value = Some(value);
    }
}

/// Whether `a` and `b` hold the same bytes, compared a word at a time in
/// line: names are short, and a `memcmp` call per name was a tenth of a
/// lookup's time (four calls, each with its length dispatch).
#[inline]
fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    let n = a.len();
    if n != b.len() {
        return false;
    }
    let word = |s: &[u8], at: usize| u64::from_ne_bytes(s[at..at + 8].try_into().expect("8 bytes"));
    let half = |s: &[u8], at: usize| u32::from_ne_bytes(s[at..at + 4].try_into().expect("4 bytes"));
    match n {
        0..4 => a.iter().zip(b).all(|(x, y)| x == y),
        4..8 => half(a, 0) == half(b, 0) && half(a, n - 4) == half(b, n - 4),
        _ => {
            // Whole words, then the last word (overlapping the one before).
            let mut at = 0;
            while at + 8 < n {
                if word(a, at) != word(b, at) {
                    return false;
                }
                at += 8;
            }
            word(a, n - 8) == word(b, n - 8)
        }
    }
}

/// Ids per chunk of an [`IdList`].
const ID_CHUNK: usize = 256;

/// Items under ids handed out in order and never reused (a stale id held
/// across a lock release can only miss, never name another item). Ids live
/// in chunks of [`ID_CHUNK`] slots; a chunk whose items were all freed is
/// dropped, so a flood of names that is cleared leaves one empty pointer per
/// 256 ids behind rather than a slot per id. A chunk owns its items
/// (`Box`), or shares them with the clones of its list (`Arc`, see
/// [`ChunkItems`]).
#[derive(Debug, Clone)]
pub(crate) struct IdList<T, C = Box<Items<T>>> {
    chunks: Vec<Option<IdChunk<C>>>,
    next: u32,
    item: std::marker::PhantomData<T>,
}

/// One chunk's item slots: a fixed array, so an item is one step from the
/// chunk, with no length to check.
pub(crate) type Items<T> = [Option<T>; ID_CHUNK];

/// How a chunk holds its items: owned, or (`Arc`) shared by the clones of
/// a list, so that a clone costs a reference per chunk and a change copies
/// only the chunk it touches, and only while another clone holds it.
pub(crate) trait ChunkItems<T>: std::ops::Deref<Target = Items<T>> {
    fn empty() -> Self;
    fn items_mut(&mut self) -> &mut Items<T>;
}

impl<T> ChunkItems<T> for Box<Items<T>> {
    fn empty() -> Self {
        (0..ID_CHUNK)
            .map(|_| None)
            .collect::<Box<[_]>>()
            .try_into()
            .unwrap_or_else(|_| unreachable!("ID_CHUNK items"))
    }

    fn items_mut(&mut self) -> &mut Items<T> {
        self
    }
}

impl<T: Clone> ChunkItems<T> for Arc<Items<T>> {
    fn empty() -> Self {
        Arc::new(std::array::from_fn(|_| None))
    }

    fn items_mut(&mut self) -> &mut Items<T> {
        Arc::make_mut(self)
    }
}

#[derive(Debug, Clone)]
struct IdChunk<C> {
    items: C,
    live: u32,
}

impl<C> IdChunk<C> {
    fn new<T>() -> Self
    where
        C: ChunkItems<T>,
    {
        Self {
            items: C::empty(),
            live: 0,
        }
    }
}

impl<T, C> Default for IdList<T, C> {
    fn default() -> Self {
        Self {
            chunks: Vec::new(),
            next: 0,
            item: std::marker::PhantomData,
        }
    }
}

impl<T, C: ChunkItems<T>> IdList<T, C> {
    pub fn get(&self, id: u32) -> Option<&T> {
        let chunk = self.chunks.get(id as usize / ID_CHUNK)?.as_ref()?;
        chunk.items[id as usize % ID_CHUNK].as_ref()
    }

    fn get_mut(&mut self, id: u32) -> Option<&mut T> {
        let chunk = self.chunks.get_mut(id as usize / ID_CHUNK)?.as_mut()?;
        chunk.items.items_mut()[id as usize % ID_CHUNK].as_mut()
    }

    /// The item under `id`, an id handed out elsewhere (another list's),
    /// made with `make` when there is none.
    pub fn get_or_insert_with(&mut self, id: u32, make: impl FnOnce() -> T) -> &mut T {
        let c = id as usize / ID_CHUNK;
        if self.chunks.len() <= c {
            self.chunks.resize_with(c + 1, || None);
        }
        let chunk = self.chunks[c].get_or_insert_with(IdChunk::new);
        let slot = &mut chunk.items.items_mut()[id as usize % ID_CHUNK];
        if slot.is_none() {
            chunk.live += 1;
        }
        slot.get_or_insert_with(make)
    }

    /// Drops the trailing chunk pointers no item is behind.
    pub fn shrink(&mut self) {
        while self.trailing_empty_chunk() {
            self.chunks.pop();
        }
        if self.spare_chunk_room() {
            self.chunks.shrink_to_fit();
        }
    }

    /// Whether [`shrink`](Self::shrink) would give back room.
    pub fn shrink_due(&self) -> bool {
        self.trailing_empty_chunk() || self.spare_chunk_room()
    }

    fn trailing_empty_chunk(&self) -> bool {
        self.chunks.len() > (self.next as usize).div_ceil(ID_CHUNK)
            && self.chunks.last().is_some_and(Option::is_none)
    }

    fn spare_chunk_room(&self) -> bool {
        self.chunks.capacity() > 2 * self.chunks.len() + 16
    }

    /// Live items with their ids, in id order.
    pub fn with_ids(&self) -> impl Iterator<Item = (u32, &T)> {
        self.chunks.iter().enumerate().flat_map(|(c, chunk)| {
            chunk.iter().flat_map(move |chunk| {
                chunk
                    .items
                    .iter()
                    .enumerate()
                    .filter_map(move |(i, item)| Some(((c * ID_CHUNK + i) as u32, item.as_ref()?)))
            })
        })
    }

    pub fn push(&mut self, item: T) -> u32 {
        let id = self.next;
        self.next = self.next.saturating_add(1);
        let c = id as usize / ID_CHUNK;
        while self.chunks.len() <= c {
            self.chunks.push(None);
        }
        let chunk = self.chunks[c].get_or_insert_with(IdChunk::new);
        let slot = &mut chunk.items.items_mut()[id as usize % ID_CHUNK];
        if slot.is_none() {
            chunk.live += 1;
        }
        *slot = Some(item);
        id
    }

    pub fn remove(&mut self, id: u32) {
        let c = id as usize / ID_CHUNK;
        let Some(Some(chunk)) = self.chunks.get_mut(c) else {
            return;
        };
        if chunk.items[id as usize % ID_CHUNK].is_some() {
            chunk.items.items_mut()[id as usize % ID_CHUNK] = None;
            chunk.live -= 1;
        }
        // A chunk ids are still handed out from stays.
        let filling =
            c == self.next as usize / ID_CHUNK && !(self.next as usize).is_multiple_of(ID_CHUNK);
        if chunk.live == 0 && !filling {
            self.chunks[c] = None;
        }
    }

    /// One past the highest id handed out.
    pub fn bound(&self) -> usize {
        self.next as usize
    }

    /// Chunks allocated.
    #[cfg(test)]
    pub fn chunks(&self) -> usize {
        self.chunks.iter().flatten().count()
    }

    /// Chunk pointers kept, allocated or not.
    #[cfg(test)]
    pub fn chunk_slots(&self) -> usize {
        self.chunks.len()
    }

    /// Item slots and chunk pointers allocated.
    #[cfg(test)]
    pub fn room(&self) -> usize {
        self.chunks.capacity() + self.chunks() * ID_CHUNK
    }
}

/// Shared items under ids that are never reused (see [`IdList`]).
#[derive(Debug)]
pub(crate) struct Slab<T> {
    items: IdList<Arc<T>>,
}

impl<T> Default for Slab<T> {
    fn default() -> Self {
        Self {
            items: IdList::default(),
        }
    }
}

impl<T> Slab<T> {
    pub fn get(&self, id: u32) -> Option<&Arc<T>> {
        self.items.get(id)
    }

    /// Live items in id order.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<T>> {
        self.items.with_ids().map(|(_, item)| item)
    }

    /// Live items with their ids.
    pub fn with_ids(&self) -> impl Iterator<Item = (u32, &Arc<T>)> {
        self.items.with_ids()
    }

    fn push(&mut self, item: T) -> u32 {
        self.items.push(Arc::new(item))
    }

    fn remove(&mut self, id: u32) {
        self.items.remove(id);
    }

    /// One past the highest id handed out.
    pub fn bound(&self) -> usize {
        self.items.bound()
    }
}

/// What [`Catalog::unused`] found nothing refers to, each with the key it
/// is filed under, for [`Catalog::free`].
#[derive(Debug, Default)]
pub(crate) struct Unused {
    partitions: Vec<([NameId; 4], PartitionId)>,
    scopes: Vec<([NameId; 3], u32)>,
    joined: Vec<[NameId; 2]>,
    names: Vec<(Arc<str>, NameId)>,
    tenant_entries: Vec<NameId>,
    replicas: Vec<(Arc<str>, ReplicaId)>,
    /// A map holds four times the room its entries need.
    shrink: bool,
}

impl Unused {
    /// Splits off up to `n` items to free first, in the order that keeps
    /// what is left consistent once they are gone: partitions, scopes and
    /// joined pairs before the names they are filed under, names before
    /// the tenants' counters and the replicas. The room to give back goes
    /// with the last part.
    pub fn take(&mut self, n: usize) -> Unused {
        // From the end of each list (their order within does not matter):
        // taking from the front moved the whole rest each time.
        fn some<T>(from: &mut Vec<T>, n: &mut usize) -> Vec<T> {
            let k = (*n).min(from.len());
            *n -= k;
            from.split_off(from.len() - k)
        }
        let mut n = n;
        let mut part = Unused {
            partitions: some(&mut self.partitions, &mut n),
            scopes: some(&mut self.scopes, &mut n),
            joined: some(&mut self.joined, &mut n),
            names: some(&mut self.names, &mut n),
            tenant_entries: some(&mut self.tenant_entries, &mut n),
            replicas: some(&mut self.replicas, &mut n),
            shrink: false,
        };
        if self.is_empty_of_items() {
            part.shrink = std::mem::take(&mut self.shrink);
        }
        part
    }

    /// Nothing to drop (there may still be room to give back).
    fn is_empty_of_items(&self) -> bool {
        self.partitions.is_empty()
            && self.scopes.is_empty()
            && self.joined.is_empty()
            && self.names.is_empty()
            && self.tenant_entries.is_empty()
            && self.replicas.is_empty()
    }

    /// Nothing to drop and no room to give back.
    pub fn is_empty(&self) -> bool {
        self.is_empty_of_items() && !self.shrink
    }
}

/// What [`Catalog::free`] dropped.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Freed {
    pub partitions: usize,
    pub scopes: usize,
    pub names: usize,
    pub replicas: usize,
}

impl std::ops::AddAssign for Freed {
    fn add_assign(&mut self, other: Self) {
        self.partitions += other.partitions;
        self.scopes += other.scopes;
        self.names += other.names;
        self.replicas += other.replicas;
    }
}

/// A replica's name and its place among the others' (see
/// [`Catalog::replica_order`]).
#[derive(Debug, Clone)]
pub(crate) struct ReplicaName {
    name: Arc<str>,
    order: u64,
}

/// The replicas' names under their ids. The catalog keeps the list behind
/// an `Arc`, and an answer that names replicas takes one reference to the
/// whole list (its scores carry ids), not one to each name it lists: eight
/// names' reference counts were 75 ns of a lookup here, and every worker
/// thread shares those counts. A change while an answer still holds the
/// list (a replica named for the first time, or freed) copies the list's
/// chunk pointers (one per 256 replicas) and the one chunk it changes, so
/// the answer keeps the names it was given and a flood of new names costs
/// each one a few thousand operations at a million names, not a copy of
/// them all.
pub(crate) type ReplicaList = IdList<ReplicaName, Arc<Items<ReplicaName>>>;

impl ReplicaList {
    /// The name behind a replica id; `None` for an id it does not hold.
    pub fn name(&self, id: ReplicaId) -> Option<&str> {
        self.get(id).map(|r| &*r.name)
    }
}

/// Interned names, partitions and scopes.
#[derive(Debug, Default)]
pub(crate) struct Catalog {
    names: PartsMap<Arc<str>, NameId>,
    name_list: IdList<Arc<str>>,
    replicas: PartsMap<Arc<str>, ReplicaId>,
    replica_list: Arc<ReplicaList>,
    /// Replica names in order, for their order keys.
    replica_order: BTreeMap<Arc<str>, ReplicaId>,
    partition_ids: PartsMap<[NameId; 4], PartitionId>,
    pub partitions: Slab<Partition>,
    /// Partitions of each `(tenant, model)`: an event naming both visits
    /// only those. A set, so freeing a flood of one pair's adapters takes
    /// each out at once (a list filtered per partition freed was quadratic:
    /// 60 ms for 20,000, all of it under the exclusive lock), in parts, as
    /// the maps that grow with names are (see the `parts_map` module).
    by_pair: HashMap<[NameId; 2], PartsMap<PartitionId, ()>>,
    scope_ids: PartsMap<[NameId; 3], u32>,
    pub scopes: Slab<Scope>,
    tenant_entries: PartsMap<NameId, Arc<AtomicI64>>,
    /// `(tenant, model)` pairs replicas joined in the fleet, kept until
    /// the fleet has no member there.
    joined: HashSet<[NameId; 2]>,
    /// What a freed id reads as.
    empty: Arc<str>,
    /// Changes whenever a name, partition or scope is added or freed; no
    /// two catalogs ever share a value (see [`Catalog::generation`]).
    generation: Generation,
}

/// A catalog's generation: taken from one process-wide counter, so a value
/// names one state of one catalog.
#[derive(Debug)]
struct Generation(u64);

static GENERATIONS: AtomicU64 = AtomicU64::new(1);

impl Generation {
    fn next() -> Self {
        Self(GENERATIONS.fetch_add(1, Ordering::Relaxed))
    }
}

impl Default for Generation {
    fn default() -> Self {
        Self::next()
    }
}

impl Catalog {
    /// A value that names this catalog's current names, partitions and
    /// scopes: what was resolved from them at one generation holds until it
    /// changes, and no other catalog ever has it.
    pub fn generation(&self) -> u64 {
        self.generation.0
    }

    /// Id of an already interned name.
    pub fn name(&self, name: &str) -> Option<NameId> {
        self.names.get(name).copied()
    }

    /// The string behind a name id (empty once freed).
    pub fn name_str(&self, id: NameId) -> &Arc<str> {
        self.name_list.get(id).unwrap_or(&self.empty)
    }

    /// Id of an already known replica.
    pub fn replica(&self, name: &str) -> Option<ReplicaId> {
        self.replicas.get(name).copied()
    }

    /// The string behind a replica id (empty once freed).
    pub fn replica_str(&self, id: ReplicaId) -> &Arc<str> {
        self.replica_list.get(id).map_or(&self.empty, |r| &r.name)
    }

    /// The replicas' names, to share with an answer (see [`ReplicaList`]).
    pub fn replica_list(&self) -> &Arc<ReplicaList> {
        &self.replica_list
    }

    /// A key that orders replicas as their names do (`a < b` exactly when
    /// `a`'s name sorts before `b`'s), so that ranking breaks ties by name
    /// without comparing strings. Keys are spread over the `u64` range; a new
    /// name takes the middle of its neighbours' gap, and all are spread again
    /// when a gap runs out. 0 only for a freed id.
    pub fn replica_order(&self, id: ReplicaId) -> u64 {
        self.replica_list.get(id).map_or(0, |r| r.order)
    }

    /// Whether a replica id is still interned.
    pub fn replica_alive(&self, id: ReplicaId) -> bool {
        self.replica_list.get(id).is_some()
    }

    /// Partition of already interned names.
    pub fn partition(
        &self,
        tenant: &str,
        model: &str,
        scheme: &str,
        adapter: &str,
    ) -> Option<PartitionId> {
        let key = [
            self.name(tenant)?,
            self.name(model)?,
            self.name(scheme)?,
            self.name(adapter)?,
        ];
        self.partition_ids.get(&key).copied()
    }

    /// Partition of interned name ids `[tenant, model, scheme, adapter]`.
    pub fn partition_of(&self, ids: [NameId; 4]) -> Option<PartitionId> {
        self.partition_ids.get(&ids).copied()
    }

    /// Id of the scope of interned name ids `[tenant, model, scheme]`.
    pub fn scope_id_of(&self, ids: [NameId; 3]) -> Option<u32> {
        self.scope_ids.get(&ids).copied()
    }

    /// Scope of already interned names.
    pub fn scope(&self, tenant: &str, model: &str, scheme: &str) -> Option<&Arc<Scope>> {
        let key = [self.name(tenant)?, self.name(model)?, self.name(scheme)?];
        self.scope_ids.get(&key).and_then(|&i| self.scopes.get(i))
    }

    pub fn intern_name(&mut self, name: &str) -> NameId {
        if let Some(&id) = self.names.get(name) {
            return id;
        }
        let shared: Arc<str> = Arc::from(name);
        let id = self.name_list.push(shared.clone());
        self.names.insert(shared, id);
        self.generation = Generation::next();
        id
    }

    pub fn intern_replica(&mut self, name: &str) -> ReplicaId {
        if let Some(&id) = self.replicas.get(name) {
            return id;
        }
        let shared: Arc<str> = Arc::from(name);
        let below = self
            .replica_order
            .range::<str, _>((Bound::Unbounded, Bound::Excluded(name)))
            .next_back()
            .map_or(0, |(_, &r)| self.replica_order(r));
        let above = self
            .replica_order
            .range::<str, _>((Bound::Excluded(name), Bound::Unbounded))
            .next()
            .map_or(u64::MAX, |(_, &r)| self.replica_order(r));
        let gap = above - below;
        let id = Arc::make_mut(&mut self.replica_list).push(ReplicaName {
            name: shared.clone(),
            order: below + gap / 2,
        });
        self.replicas.insert(shared.clone(), id);
        self.replica_order.insert(shared, id);
        if gap < 2 {
            self.spread_replica_order();
        }
        id
    }

    /// Spreads the replicas' order keys evenly over the `u64` range.
    fn spread_replica_order(&mut self) {
        let step = u64::MAX / (self.replica_order.len() as u64 + 1);
        let list = Arc::make_mut(&mut self.replica_list);
        for (i, &id) in self.replica_order.values().enumerate() {
            if let Some(r) = list.get_mut(id) {
                r.order = step * (i as u64 + 1);
            }
        }
    }

    /// Live names, replicas, partitions and scopes.
    #[cfg(test)]
    pub fn interned(&self) -> [usize; 4] {
        [
            self.names.len(),
            self.replicas.len(),
            self.partitions.iter().count(),
            self.scopes.iter().count(),
        ]
    }

    /// Entries the catalog's maps have room for.
    #[cfg(test)]
    pub fn room(&self) -> usize {
        self.names.capacity()
            + self.replicas.capacity()
            + self.partition_ids.capacity()
            + self.by_pair.capacity()
            + self.scope_ids.capacity()
            + self.tenant_entries.capacity()
            + self.joined.capacity()
    }

    /// Whether `(tenant, model)` is known to have fleet members.
    pub fn joined(&self, pair: [NameId; 2]) -> bool {
        self.joined.contains(&pair)
    }

    /// Notes that a replica joined `(tenant, model)` in the fleet.
    pub fn note_joined(&mut self, pair: [NameId; 2]) {
        self.joined.insert(pair);
    }

    /// Partition id for the names, creating names, scope and partition as needed.
    pub fn intern_partition(
        &mut self,
        tenant: &str,
        model: &str,
        scheme: &str,
        adapter: &str,
    ) -> PartitionId {
        let ids = [
            self.intern_name(tenant),
            self.intern_name(model),
            self.intern_name(scheme),
            self.intern_name(adapter),
        ];
        if let Some(&p) = self.partition_ids.get(&ids) {
            return p;
        }
        let scope_key = [ids[0], ids[1], ids[2]];
        let scope = match self.scope_ids.get(&scope_key) {
            Some(&s) => s,
            None => {
                let s = self.scopes.push(Scope::new(ids[0], ids[1]));
                self.scope_ids.insert(scope_key, s);
                s
            }
        };
        let tenant_entries = self
            .tenant_entries
            .get_or_insert_with(ids[0], Default::default)
            .clone();
        let p = self.partitions.push(Partition {
            tenant: ids[0],
            model: ids[1],
            adapter: ids[3],
            scope,
            keys: AtomicI64::new(0),
            entries: AtomicI64::new(0),
            tenant_entries,
        });
        self.partition_ids.insert(ids, p);
        self.generation = Generation::next();
        self.by_pair
            .entry([ids[0], ids[1]])
            .or_default()
            .insert(p, ());
        p
    }

    /// Partitions of `(tenant, model)`; `None` matches any. Only a pair
    /// with both names is a direct lookup; otherwise every partition is
    /// visited.
    pub fn partitions_of(
        &self,
        tenant: Option<NameId>,
        model: Option<NameId>,
    ) -> SmallVec<[PartitionId; 2]> {
        match (tenant, model) {
            (Some(t), Some(m)) => self
                .by_pair
                .get(&[t, m])
                .map(|set| set.keys().copied().collect())
                .unwrap_or_default(),
            _ => self
                .partitions
                .with_ids()
                .filter(|(_, p)| {
                    tenant.is_none_or(|t| p.tenant == t) && model.is_none_or(|m| p.model == m)
                })
                .map(|(id, _)| id)
                .collect(),
        }
    }

    /// Frees what [`unused`](Self::unused) finds.
    #[cfg(test)]
    pub fn free_unused(
        &mut self,
        busy: impl Fn(ReplicaId) -> bool,
        members: impl Fn([NameId; 2]) -> Option<Vec<NameId>>,
    ) -> Freed {
        let unused = self.unused(busy, members);
        self.free(unused)
    }

    /// What [`free`](Self::free) would drop now: partitions without
    /// entries, scopes without partitions or holders, names nothing refers
    /// to and replicas `busy` does not claim; `members(pair)` gives the
    /// hash schemes of the fleet's members of a `(tenant, model)` pair, or
    /// `None` when it has none. Read only, so a sweep finds under the
    /// shared lock whether anything is due, and takes the catalog
    /// exclusively only then. What goes with what it drops counts as unused
    /// too: a scope whose every partition is dropped, the names only those
    /// referred to.
    pub fn unused(
        &self,
        busy: impl Fn(ReplicaId) -> bool,
        members: impl Fn([NameId; 2]) -> Option<Vec<NameId>>,
    ) -> Unused {
        let mut unused = Unused::default();
        let mut used: HashSet<NameId> = HashSet::new();
        for (&key, &p) in self.partition_ids.iter() {
            let empty = self.partitions.get(p).is_none_or(|q| {
                q.entries.load(Ordering::Relaxed) <= 0 && q.keys.load(Ordering::Relaxed) <= 0
            });
            if empty {
                unused.partitions.push((key, p));
            } else {
                used.extend(key);
            }
        }
        let dropped: HashSet<PartitionId> = unused.partitions.iter().map(|&(_, p)| p).collect();
        let scope_used: HashSet<u32> = self
            .partitions
            .with_ids()
            .filter(|(id, _)| !dropped.contains(id))
            .map(|(_, p)| p.scope)
            .collect();
        for (&key, &s) in self.scope_ids.iter() {
            let keep = scope_used.contains(&s)
                || self
                    .scopes
                    .get(s)
                    .is_some_and(|scope| scope.serving_count() > 0);
            if keep {
                used.extend(key);
            } else {
                unused.scopes.push((key, s));
            }
        }
        for &pair in &self.joined {
            match members(pair) {
                Some(schemes) => {
                    used.extend(pair);
                    used.extend(schemes);
                }
                None => unused.joined.push(pair),
            }
        }
        unused.names = self
            .names
            .iter()
            .filter(|&(_, id)| !used.contains(id))
            .map(|(name, &id)| (name.clone(), id))
            .collect();
        unused.tenant_entries = self
            .tenant_entries
            .keys()
            .filter(|&t| !used.contains(t))
            .copied()
            .collect();
        unused.replicas = self
            .replicas
            .iter()
            .filter(|&(_, &id)| !busy(id))
            .map(|(name, &id)| (name.clone(), id))
            .collect();
        // The maps in parts give their room back as they empty.
        unused.shrink = shrink_due(self.by_pair.len(), self.by_pair.capacity())
            || shrink_due(self.joined.len(), self.joined.capacity());
        unused
    }

    /// Drops what [`unused`](Self::unused) found (or a part of it, see
    /// [`Unused::take`]), which the caller keeps true: nobody may have
    /// written the catalog or the fleet since it was found.
    pub fn free(&mut self, unused: Unused) -> Freed {
        let mut freed = Freed::default();
        for (key, p) in unused.partitions {
            self.partition_ids.remove(&key);
            self.partitions.remove(p);
            freed.partitions += 1;
            let pair = [key[0], key[1]];
            if let Some(set) = self.by_pair.get_mut(&pair) {
                set.remove(&p);
                if set.is_empty() {
                    self.by_pair.remove(&pair);
                }
            }
        }
        for (key, s) in unused.scopes {
            self.scope_ids.remove(&key);
            self.scopes.remove(s);
            freed.scopes += 1;
        }
        for pair in unused.joined {
            self.joined.remove(&pair);
        }
        for (name, id) in unused.names {
            self.names.remove(&name);
            self.name_list.remove(id);
            freed.names += 1;
        }
        for tenant in unused.tenant_entries {
            self.tenant_entries.remove(&tenant);
        }
        for (name, id) in unused.replicas {
            self.replicas.remove(&name);
            Arc::make_mut(&mut self.replica_list).remove(id);
            self.replica_order.remove(&name);
            freed.replicas += 1;
        }
        if freed != Freed::default() {
            self.generation = Generation::next();
        }
        shrink_map(&mut self.by_pair);
        if shrink_due(self.joined.len(), self.joined.capacity()) {
            self.joined.shrink_to_fit();
        }
        freed
    }
}

/// Maps smaller than this keep their room.
const SHRINK_FROM: usize = 256;

/// Gives back a map's room once it holds under a quarter of it: after a
/// flood of names is cleared, maps would otherwise keep their peak size.
/// Only the sweep calls it; a map that refills pays one regrowth.
pub(crate) fn shrink_map<K: Eq + std::hash::Hash, V>(map: &mut HashMap<K, V>) {
    if shrink_due(map.len(), map.capacity()) {
        map.shrink_to_fit();
    }
}

/// Whether a map or set of `len` entries in room for `capacity` gives back
/// its room: past [`SHRINK_FROM`], at under a quarter full.
pub(crate) fn shrink_due(len: usize, capacity: usize) -> bool {
    shrink_due_from(len, capacity, SHRINK_FROM)
}

/// [`shrink_due`] for a table whose room is kept from `from` on.
pub(crate) fn shrink_due_from(len: usize, capacity: usize, from: usize) -> bool {
    capacity > from && len * 4 < capacity
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_bytes_agrees_with_slice_equality_at_every_length() {
        let base: Vec<u8> = (0..40u8).map(|i| b'a' + i % 26).collect();
        for n in 0..=base.len() {
            let a = &base[..n];
            assert!(same_bytes(a, a), "{n}");
            for at in 0..n {
                let mut b = a.to_vec();
                b[at] ^= 1;
                assert!(!same_bytes(a, &b), "{n} differing at {at}");
            }
            if n > 0 {
                assert!(!same_bytes(a, &base[..n - 1]), "{n} against a prefix");
            }
        }
        let mut memo = ScopeMemo::empty();
        memo.set(3, ["team-a", "qwen3", "vllm", ""], 7u32);
        assert_eq!(memo.get(3, ["team-a", "qwen3", "vllm", ""]), Some(7));
        assert_eq!(memo.get(3, ["team-b", "qwen3", "vllm", ""]), None);
        assert_eq!(memo.get(3, ["team-a", "qwen3", "vllm", "x"]), None);
        assert_eq!(memo.get(4, ["team-a", "qwen3", "vllm", ""]), None);
    }

    #[test]
    fn a_shared_replica_list_copies_only_the_chunk_a_change_touches() {
        let name = |i: u32| ReplicaName {
            name: Arc::from(format!("r{i}")),
            order: u64::from(i) + 1,
        };
        let mut list = ReplicaList::default();
        for i in 0..1_000 {
            list.push(name(i));
        }
        let held = list.clone();
        let shared = |a: &ReplicaList, b: &ReplicaList, c: usize| match (&a.chunks[c], &b.chunks[c])
        {
            (Some(x), Some(y)) => Arc::ptr_eq(&x.items, &y.items),
            _ => false,
        };
        assert!((0..list.chunks.len()).all(|c| shared(&list, &held, c)));
        // A new name and a freed one, in two chunks: those two are copied,
        // every other chunk is still the held list's.
        let added = list.push(name(1_000));
        list.remove(5);
        assert_eq!(added as usize / ID_CHUNK, 3);
        for c in 0..list.chunks.len() {
            assert_eq!(shared(&list, &held, c), c != 0 && c != 3, "chunk {c}");
        }
        // The held list says what it said; the list itself has moved on.
        assert_eq!(held.name(5), Some("r5"));
        assert_eq!(held.name(added), None);
        assert_eq!(list.name(5), None);
        assert_eq!(list.name(added), Some("r1000"));
        assert_eq!(list.name(999), Some("r999"));
        // Unshared, a change copies nothing.
        drop(held);
        let before = list.chunks[1].as_ref().map(|c| Arc::as_ptr(&c.items));
        list.remove(300);
        let after = list.chunks[1].as_ref().map(|c| Arc::as_ptr(&c.items));
        assert_eq!(before, after);
    }

    #[test]
    fn id_lists_never_reuse_ids_and_drop_emptied_chunks() {
        let mut list: IdList<u32> = IdList::default();
        let ids: Vec<u32> = (0..1_000u32).map(|i| list.push(i * 10)).collect();
        assert_eq!(ids, (0..1_000).collect::<Vec<_>>());
        assert_eq!(list.get(999), Some(&9_990));
        assert_eq!(list.chunks(), 1_000usize.div_ceil(ID_CHUNK));
        for id in 0..1_000 {
            list.remove(id);
        }
        assert_eq!(list.get(5), None);
        assert_eq!(list.with_ids().count(), 0);
        // Only the chunk ids are still handed out from stays.
        assert_eq!(list.chunks(), 1);
        // A freed id is never handed out again.
        assert_eq!(list.push(7), 1_000);
        assert_eq!(list.get(1_000), Some(&7));
        assert_eq!(list.bound(), 1_001);
        assert_eq!(list.with_ids().collect::<Vec<_>>(), vec![(1_000, &7)]);
    }

    /// Every pair of live replicas orders by key as by name.
    fn assert_order_follows_names(catalog: &Catalog, ids: &[ReplicaId]) {
        for &a in ids {
            for &b in ids {
                let by_name = catalog.replica_str(a).cmp(catalog.replica_str(b));
                let by_key = catalog.replica_order(a).cmp(&catalog.replica_order(b));
                assert_eq!(
                    by_key,
                    by_name,
                    "{} vs {}",
                    catalog.replica_str(a),
                    catalog.replica_str(b)
                );
            }
        }
    }

    #[test]
    fn replica_order_keys_follow_name_order_through_inserts_spreads_and_frees() {
        let mut catalog = Catalog::default();
        let mut ids = Vec::new();
        // Names that always land in the same gap (each just below the
        // last) use it up within 64 inserts, forcing spreads.
        for i in 0..200u32 {
            ids.push(catalog.intern_replica(&format!("b-{:03}", 200 - i)));
        }
        // Then names all around them, and again at both ends.
        for i in 0..100u32 {
            ids.push(catalog.intern_replica(&format!("b-{:03}x", i * 2)));
            ids.push(catalog.intern_replica(&format!("a{i}")));
            ids.push(catalog.intern_replica(&format!("z{i}")));
        }
        assert_eq!(
            catalog.intern_replica("b-100"),
            ids[100],
            "known names keep their id"
        );
        assert_order_follows_names(&catalog, &ids);
        // Freed replicas leave the order; later names still fit in.
        let kept: Vec<ReplicaId> = ids.iter().copied().filter(|id| id % 3 != 0).collect();
        catalog.free_unused(|id| id % 3 != 0, |_| None);
        assert_eq!(catalog.replica_order(ids[0]), 0, "a freed id has no key");
        let mut live = kept;
        for i in 0..100u32 {
            live.push(catalog.intern_replica(&format!("b-{:03}y", i)));
        }
        assert_order_follows_names(&catalog, &live);
    }

    #[test]
    fn the_generation_moves_with_names_and_partitions_only() {
        let mut catalog = Catalog::default();
        let other = Catalog::default();
        assert_ne!(catalog.generation(), other.generation());
        let g0 = catalog.generation();
        catalog.intern_replica("replica-0");
        assert_eq!(catalog.generation(), g0, "replicas do not resolve requests");
        catalog.intern_partition("t", "m", "s", "");
        let g1 = catalog.generation();
        assert_ne!(g1, g0);
        catalog.intern_partition("t", "m", "s", "");
        assert_eq!(catalog.generation(), g1, "nothing new");
        catalog.intern_partition("t", "m", "s", "lora");
        assert_ne!(catalog.generation(), g1);
        let g2 = catalog.generation();
        catalog.free_unused(|_| true, |_| None);
        assert_ne!(catalog.generation(), g2);
    }

    #[test]
    fn a_holder_set_follows_its_writer_and_frees_emptied_chunks() {
        let set = HolderSet::default();
        let far = 5 * HOLDER_CHUNK as ReplicaId + 17;
        for id in [3, 64, 4095, 4096, far] {
            set.insert(id);
        }
        assert_eq!(set.ids().as_slice(), &[3, 64, 4095, 4096, far]);
        assert!(set.contains(4095) && set.contains(far) && !set.contains(65));
        assert_eq!(set.chunks(), 3, "one per id range in use");
        set.remove(4096);
        assert_eq!(set.chunks(), 2, "an emptied chunk goes");
        set.remove(far);
        assert_eq!(set.chunks(), 1);
        assert!(!set.contains(far) && !set.contains(4096));
        set.remove(far);
        set.remove(1_000_000);
        assert_eq!(set.ids().as_slice(), &[3, 64, 4095]);
        set.insert(4096);
        assert_eq!(set.ids().as_slice(), &[3, 64, 4095, 4096]);
    }

    #[test]
    fn unused_names_are_taken_users_first_and_room_last() {
        let name = |n: &str| -> Arc<str> { Arc::from(n) };
        let mut unused = Unused {
            partitions: vec![([1, 2, 3, 4], 0), ([1, 2, 3, 5], 1), ([1, 2, 3, 6], 2)],
            scopes: vec![([1, 2, 3], 0)],
            joined: vec![[1, 2]],
            names: vec![(name("a"), 4), (name("b"), 5)],
            tenant_entries: vec![1],
            replicas: vec![(name("r"), 0)],
            shrink: true,
        };
        let mut parts = Vec::new();
        while !unused.is_empty() {
            parts.push(unused.take(2));
        }
        let kinds = |u: &Unused| {
            [
                u.partitions.len(),
                u.scopes.len(),
                u.joined.len(),
                u.names.len(),
                u.tenant_entries.len(),
                u.replicas.len(),
            ]
        };
        assert_eq!(
            parts.iter().map(kinds).collect::<Vec<_>>(),
            [
                [2, 0, 0, 0, 0, 0],
                [1, 1, 0, 0, 0, 0],
                [0, 0, 1, 1, 0, 0],
                [0, 0, 0, 1, 1, 0],
                [0, 0, 0, 0, 0, 1],
            ]
        );
        // The room goes back once, with the last part.
        let shrinks: Vec<bool> = parts.iter().map(|u| u.shrink).collect();
        assert_eq!(shrinks, [false, false, false, false, true]);
        // Every item is taken once.
        let mut ids: Vec<PartitionId> = parts
            .iter()
            .flat_map(|u| u.partitions.iter().map(|&(_, p)| p))
            .collect();
        ids.sort_unstable();
        assert_eq!(ids, [0, 1, 2]);
        // Room alone is a part of its own.
        let mut room = Unused {
            shrink: true,
            ..Unused::default()
        };
        assert!(room.take(2).shrink && room.is_empty());
    }

    #[test]
    fn a_flood_of_holders_costs_a_bit_each() {
        // A scope that 100,000 replica ids start and stop holding in: each
        // change sets or clears one bit (a sorted list copied per change
        // would move 20 GB here).
        let scope = Scope::new(0, 0);
        let n = 100_000;
        for id in 0..n {
            scope.add(id, 1);
        }
        assert_eq!(scope.serving_count(), n);
        assert!(scope.holds(n - 1) && !scope.holds(n));
        assert_eq!(scope.holders.chunks(), (n as usize).div_ceil(HOLDER_CHUNK));
        for id in (0..n).filter(|id| id % 2 == 0) {
            scope.add(id, -1);
        }
        assert_eq!(scope.serving_count(), n / 2);
        assert!(!scope.holds(0) && scope.holds(1));
        let holders = scope.holders();
        assert_eq!(holders.len(), (n / 2) as usize);
        assert!(holders.iter().all(|id| id % 2 == 1));
        assert!(holders.windows(2).all(|w| w[0] < w[1]));
        for id in (0..n).filter(|id| id % 2 == 1) {
            scope.add(id, -1);
        }
        assert_eq!(scope.holders.chunks(), 0, "nothing held, nothing kept");
    }

    #[test]
    fn readers_of_a_holder_set_find_what_its_writer_put_in() {
        // The writer keeps ids 0 and `far` in the set and moves a third
        // through chunks that come and go; readers always find the two, and
        // only ids the writer ever put in (a listing reads each id as it was
        // at some moment of the call, as a lookup reads the store's keys).
        let scope = Scope::new(0, 0);
        let far = 3 * HOLDER_CHUNK as ReplicaId;
        scope.add(0, 1);
        scope.add(far, 1);
        let moving = |round: u32| 1 + (round % 8) * HOLDER_CHUNK as ReplicaId / 2;
        let allowed = |id: ReplicaId| id == 0 || id == far || (0..8).any(|r| moving(r) == id);
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            let readers: Vec<_> = (0..2)
                .map(|_| {
                    s.spawn(|| {
                        let mut reads = 0u64;
                        while !stop.load(Ordering::Relaxed) {
                            assert!(scope.holds(0) && scope.holds(far));
                            let ids = scope.holders();
                            assert!(ids.windows(2).all(|w| w[0] < w[1]), "{ids:?}");
                            assert!(ids.contains(&0) && ids.contains(&far), "{ids:?}");
                            assert!(ids.iter().all(|&id| allowed(id)), "{ids:?}");
                            reads += 1;
                        }
                        reads
                    })
                })
                .collect();
            for round in 0..20_000u32 {
                let id = moving(round);
                if id != far {
                    scope.add(id, 1);
                    scope.add(id, -1);
                }
            }
            stop.store(true, Ordering::Relaxed);
            for r in readers {
                assert!(r.join().expect("a reader") > 0);
            }
        });
        assert_eq!(scope.holders().as_slice(), &[0, far]);
    }
}
