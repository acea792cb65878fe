//! [`CacheIndex`]: ingest, events, aggregates. Lookup and sweeping live in
//! sibling modules as further `impl CacheIndex` blocks.
//!
//! Ingest of one update resolves its partition(s) and the room left under the
//! global cap and the tenant's quota, writes its blocks under the store's
//! writer (new entries past the room are refused and counted), then applies
//! the per-partition / per-scope counter deltas once. Events that name a
//! prefix touch one key per matching partition; ALL_CLEARED visits only the
//! runs the replica has cells in. No catalog or fleet lock is held while
//! waiting for the store's writer.
//!
//! An update's scope names (tenant, model, scheme, adapter) are resolved
//! through a per-thread memo of the last ones, valid for one catalog
//! generation: consecutive updates nearly always name the same scope, and
//! four string compares cost far less than the six hash probes they stand
//! for (4–6 fewer instructions per ingested block of a 64-block report).

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, TryLockError};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use crossbeam_utils::sync::{ShardedLock, ShardedLockReadGuard, ShardedLockWriteGuard};
use hashbrown::HashMap;
use smallvec::SmallVec;

use crate::catalog::{Catalog, NameId, PartitionId, ReplicaId, ScopeMemo};
use crate::clock::{Clock, SystemClock, ms_to_secs};
use crate::cost::RequestTokenMeans;
use crate::fleet::{Fleet, ReplicaRecord};
use crate::messages::{
    BlockHashes, CacheEvent, CacheSummary, CacheUpdate, DropReason, EventKind, EventReport,
    EvictionReason, IngestReport, PROBE_TENANT, PrefixReport, ReplicaState, ReplicaStatsReport,
    ScopeState, Snapshot, TenantSnapshot, Tier,
};
use crate::policy::PolicySet;
use crate::store::{Claim, Holding, Key, NarrowChain, Removed, Store};

/// Default global cap on block-replica entries.
pub const DEFAULT_MAX_ENTRIES: u64 = 1_000_000;
/// Tries at a write lock before waiting for it (see
/// [`ReadMostly::write_between_readers`]).
const WRITE_TRIES: u32 = 4096;
/// How long a reader spins for a writer to leave before it waits as usual
/// (see [`ReadMostly`]): longer than any write, so only a writer that lost
/// its core holds a reader up for longer.
const READ_SPIN: Duration = Duration::from_millis(2);
/// How long a reader spins before it also yields its core now and then
/// (to a writer on the same core, which must run to leave): longer than
/// most writes.
const READ_YIELD_AFTER: Duration = Duration::from_micros(50);

/// A lock that lookups and ingest read and few writers write: a sharded
/// reader-writer lock (`crossbeam-utils`). A reader takes only its thread's
/// shard, so readers on different cores write no common cache line: with
/// one lock word, every lookup's lock and unlock took that line from the
/// core that had it last (an ingesting thread, another lookup). A writer
/// takes every shard. A writer that panicked leaves the data to the next
/// reader as it was (no poisoning, as before).
///
/// A reader that finds a writer in spins until it leaves, yielding its
/// core now and then, and waits as usual only after [`READ_SPIN`]: a
/// reader put to sleep at once was woken on the writer's core and waited
/// there for the writer's time slice (5–9 ms on two cores, for a write of
/// microseconds). Letting waiting readers in before the next writer was
/// tried and dropped: beside a flood of new names it cut the longest
/// lookup from 4–6 ms to 1–2 ms, but where threads outnumber cores it made
/// writes up to twice as slow when the writer spun for the readers, and
/// four times when it yielded to them.
pub(crate) struct ReadMostly<T> {
    lock: ShardedLock<T>,
    /// Write locks taken so far: a reader that saw this count can tell,
    /// under a write lock of its own, whether anyone else wrote since.
    writes: AtomicU64,
}

impl<T> ReadMostly<T> {
    fn new(value: T) -> Self {
        Self {
            lock: ShardedLock::new(value),
            writes: AtomicU64::new(0),
        }
    }

    /// Write locks taken so far (read under a lock, it is exact: a writer
    /// counts itself while it holds the lock).
    pub(crate) fn writes(&self) -> u64 {
        self.writes.load(Ordering::Relaxed)
    }

    pub(crate) fn read(&self) -> ShardedLockReadGuard<'_, T> {
        self.try_read().unwrap_or_else(|| self.read_after_writer())
    }

    fn try_read(&self) -> Option<ShardedLockReadGuard<'_, T>> {
        match self.lock.try_read() {
            Ok(guard) => Some(guard),
            Err(TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        }
    }

    /// A writer is in: spin until it leaves, yielding now and then past
    /// [`READ_YIELD_AFTER`], for [`READ_SPIN`] at most; then wait as usual.
    #[cold]
    fn read_after_writer(&self) -> ShardedLockReadGuard<'_, T> {
        let start = Instant::now();
        let mut attempt = 0u32;
        loop {
            if let Some(guard) = self.try_read() {
                return guard;
            }
            attempt = attempt.wrapping_add(1);
            if attempt.is_multiple_of(64) {
                let waited = start.elapsed();
                if waited > READ_SPIN {
                    return self.lock.read().unwrap_or_else(PoisonError::into_inner);
                }
                if waited > READ_YIELD_AFTER {
                    std::thread::yield_now();
                    continue;
                }
            }
            std::hint::spin_loop();
        }
    }

    fn try_write(&self) -> Option<ShardedLockWriteGuard<'_, T>> {
        match self.lock.try_write() {
            Ok(guard) => Some(guard),
            Err(TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        }
    }

    /// The write lock, taken in the gaps between readers: a writer that
    /// waits for the lock in the ordinary way makes every new reader of its
    /// shards queue behind it, and on a busy machine the writer may not run
    /// again for a scheduler tick after the last reader wakes it, so one
    /// rare write (a join, a leave, a new name) could hold lookups up for
    /// milliseconds. Trying first lets readers through; after a bounded
    /// number of tries it waits as usual, so a writer is never starved.
    fn write_between_readers(&self) -> ShardedLockWriteGuard<'_, T> {
        let guard = self.wait_between_readers();
        self.writes.fetch_add(1, Ordering::Relaxed);
        guard
    }

    fn wait_between_readers(&self) -> ShardedLockWriteGuard<'_, T> {
        for attempt in 0..WRITE_TRIES {
            if let Some(guard) = self.try_write() {
                return guard;
            }
            if attempt % 64 == 63 {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        self.lock.write().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A partition one update writes: its adapter, and the entries and keys
/// the update added there.
struct UpdatePart<'a> {
    adapter: &'a str,
    part: PartitionId,
    added: i64,
    new_keys: i64,
}

/// A prefix of an update that passed the checks: which of the update's
/// partitions it goes to ([`UpdatePart`] index) and its tier.
struct AcceptedPrefix<'a> {
    slot: usize,
    tier: u8,
    prefix: &'a PrefixReport,
}

/// An update's accepted prefixes and the partitions they go to.
struct Accepted<'u> {
    /// One per adapter the update names; on the stack for the usual few.
    parts: SmallVec<[UpdatePart<'u>; 2]>,
    prefixes: SmallVec<[AcceptedPrefix<'u>; 4]>,
}

/// What writing an update did.
struct Written {
    /// The sender's id (looked up again if a sweep freed the first one).
    replica: ReplicaId,
    /// Prefixes written.
    prefixes: u64,
    /// Holders that made room under the holders-per-key bound.
    displaced: usize,
    holding: Holding,
}

/// What an update names, resolved without interning (see
/// [`CacheIndex::known_names`]).
struct KnownNames {
    replica: ReplicaId,
    /// `[tenant, model, scheme]` when the update names all three.
    join: Option<[NameId; 3]>,
    /// Partition of the update's own adapter, when it exists.
    part: Option<PartitionId>,
}

thread_local! {
    /// The scope names of the last update ingested on this thread and what
    /// they resolved to (see [`ScopeMemo`]): a replica's reports, and most
    /// replicas' reports, name one `(tenant, model, scheme, adapter)`
    /// (about 300 of an update's instructions net). Only a joined pair is
    /// kept (a pair is unjoined only where the generation changes).
    static LAST_SCOPE: std::cell::RefCell<ScopeMemo<([NameId; 3], Option<PartitionId>)>> =
        const { std::cell::RefCell::new(ScopeMemo::empty()) };
}

/// Default bound on the replicas one key keeps.
pub const DEFAULT_MAX_HOLDERS_PER_KEY: usize = 256;

/// The in-memory KV-cache index and ranker.
///
/// Cheap to share (`Arc<CacheIndex>`); every method takes `&self`.
pub struct CacheIndex {
    pub(crate) catalog: ReadMostly<Catalog>,
    pub(crate) store: Store,
    pub(crate) fleet: ReadMostly<Fleet>,
    /// Running means of the uncached prefill tokens of hinted requests.
    pub(crate) mean_request_tokens: RequestTokenMeans,
    /// Shared with the lookup threads' caches (see [`CacheIndex::with_policies`]).
    pub(crate) policies: Arc<ArcSwap<PolicySet>>,
    pub(crate) clock: Arc<dyn Clock>,
    max_entries: AtomicU64,
    max_holders: AtomicU64,
    /// New entries refused at the cap (total, and since the last sweep).
    refused: AtomicU64,
    pub(crate) refused_since_sweep: AtomicU64,
    pub(crate) entries: AtomicI64,
    pub(crate) keys: AtomicI64,
    evictions: [AtomicU64; 5],
}

impl std::fmt::Debug for CacheIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CacheIndex")
            .field("entries", &self.entry_count())
            .field("prefixes", &self.prefix_count())
            .field("max_entries", &self.max_entries())
            .finish_non_exhaustive()
    }
}

impl Default for CacheIndex {
    fn default() -> Self {
        Self::new(Arc::new(SystemClock), DEFAULT_MAX_ENTRIES)
    }
}

/// Entry/key deltas of one partition, accumulated over a batch. An update
/// touches one or two (partition, replica) pairs: those stay in a short list
/// searched in place, and only a batch with many (a sweep) builds maps.
#[derive(Debug, Default)]
pub(crate) struct Deltas {
    entries: Tally<(PartitionId, ReplicaId)>,
    keys: Tally<PartitionId>,
}

/// Sums per key: a short list, and a map once there are many keys.
#[derive(Debug)]
struct Tally<K> {
    few: SmallVec<[(K, i64); 4]>,
    many: HashMap<K, i64>,
}

impl<K> Default for Tally<K> {
    fn default() -> Self {
        Self {
            few: SmallVec::new(),
            many: HashMap::new(),
        }
    }
}

/// Keys a [`Tally`] keeps in its list before it builds a map.
const FEW: usize = 16;

impl<K: Copy + Eq + std::hash::Hash> Tally<K> {
    fn add(&mut self, key: K, delta: i64) {
        if self.many.is_empty() {
            if let Some((_, d)) = self.few.iter_mut().find(|(k, _)| *k == key) {
                *d += delta;
                return;
            }
            if self.few.len() < FEW {
                self.few.push((key, delta));
                return;
            }
            self.many.extend(self.few.drain(..));
        }
        *self.many.entry(key).or_insert(0) += delta;
    }

    fn is_empty(&self) -> bool {
        self.few.is_empty() && self.many.is_empty()
    }

    fn iter(&self) -> impl Iterator<Item = (K, i64)> + '_ {
        self.few
            .iter()
            .copied()
            .chain(self.many.iter().map(|(&k, &d)| (k, d)))
    }
}

impl Deltas {
    pub fn entry(&mut self, part: PartitionId, replica: ReplicaId, delta: i64) {
        self.entries.add((part, replica), delta);
    }

    pub fn key(&mut self, part: PartitionId, delta: i64) {
        self.keys.add(part, delta);
    }

    pub fn total_entries(&self) -> i64 {
        self.entries.iter().map(|(_, d)| d).sum()
    }
}

impl Removed for Deltas {
    fn entry(&mut self, part: PartitionId, replica: ReplicaId) {
        Deltas::entry(self, part, replica, -1);
    }

    fn key(&mut self, part: PartitionId) {
        Deltas::key(self, part, -1);
    }
}

impl CacheIndex {
    /// An empty index reading time from `clock`, capped at `max_entries` block-replica entries.
    pub fn new(clock: Arc<dyn Clock>, max_entries: u64) -> Self {
        Self {
            catalog: ReadMostly::new(Catalog::default()),
            store: Store::default(),
            fleet: ReadMostly::new(Fleet::default()),
            mean_request_tokens: RequestTokenMeans::default(),
            policies: Arc::new(ArcSwap::from_pointee(PolicySet::default())),
            clock,
            max_entries: AtomicU64::new(max_entries),
            max_holders: AtomicU64::new(DEFAULT_MAX_HOLDERS_PER_KEY as u64),
            refused: AtomicU64::new(0),
            refused_since_sweep: AtomicU64::new(0),
            entries: AtomicI64::new(0),
            keys: AtomicI64::new(0),
            evictions: Default::default(),
        }
    }

    /// Replaces the policy set (atomically; lookups in flight keep the old one).
    pub fn set_policies(&self, policies: PolicySet) {
        self.policies.store(Arc::new(policies));
    }

    /// The policy set in force.
    pub fn policies(&self) -> Arc<PolicySet> {
        self.policies.load_full()
    }

    /// Runs `f` with the policy set in force, read through this thread's
    /// cache of it: one plain load of the current pointer while the policy
    /// set is unchanged, where an `ArcSwap` load and its guard's release are
    /// two locked instructions (each a full barrier on x86, about 2% of a
    /// lookup apiece). The cache keeps one reference to the last policy set
    /// this thread read, until the thread's next lookup of another index.
    pub(crate) fn with_policies<R>(&self, f: impl FnOnce(&PolicySet) -> R) -> R {
        type Cached = arc_swap::Cache<Arc<ArcSwap<PolicySet>>, Arc<PolicySet>>;
        thread_local! {
            static POLICIES: std::cell::RefCell<Option<Cached>> =
                const { std::cell::RefCell::new(None) };
        }
        POLICIES.with(|slot| {
            // A nested read (none on the lookup path) takes the plain load.
            let Ok(mut slot) = slot.try_borrow_mut() else {
                return f(&self.policies.load());
            };
            let cache = match &mut *slot {
                Some(cache) if std::ptr::eq(cache.arc_swap(), &*self.policies) => cache,
                other => other.insert(arc_swap::Cache::new(Arc::clone(&self.policies))),
            };
            f(cache.load())
        })
    }

    /// Block-replica entries in the index.
    pub fn entry_count(&self) -> i64 {
        self.entries.load(Ordering::Relaxed)
    }

    /// Distinct prefix keys in the index.
    pub fn prefix_count(&self) -> i64 {
        self.keys.load(Ordering::Relaxed)
    }

    /// Global entry cap.
    pub fn max_entries(&self) -> u64 {
        self.max_entries.load(Ordering::Relaxed)
    }

    /// Changes the global entry cap (new entries past it are refused at
    /// ingest; the next sweep evicts down to it).
    pub fn set_max_entries(&self, max: u64) {
        self.max_entries.store(max, Ordering::Relaxed);
    }

    /// Entries removed so far for `reason`.
    pub fn evictions(&self, reason: EvictionReason) -> u64 {
        self.evictions[reason as usize].load(Ordering::Relaxed)
    }

    pub(crate) fn count_evictions(&self, reason: EvictionReason, n: u64) {
        self.evictions[reason as usize].fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn now_ms(&self) -> u64 {
        self.clock.now_ms()
    }

    fn replica_id(&self, name: &str) -> ReplicaId {
        if let Some(id) = self.catalog.read().replica(name) {
            return id;
        }
        self.catalog_write().intern_replica(name)
    }

    /// Interned ids of `names`, interning the ones never seen.
    pub(crate) fn name_ids<const N: usize>(&self, names: [&str; N]) -> [NameId; N] {
        {
            let catalog = self.catalog.read();
            let known = names.map(|n| catalog.name(n));
            if known.iter().all(Option::is_some) {
                return known.map(|id| id.unwrap_or_default());
            }
        }
        let mut catalog = self.catalog_write();
        names.map(|n| catalog.intern_name(n))
    }

    fn partition_id(&self, tenant: &str, model: &str, scheme: &str, adapter: &str) -> PartitionId {
        if let Some(id) = self
            .catalog
            .read()
            .partition(tenant, model, scheme, adapter)
        {
            return id;
        }
        self.catalog_write()
            .intern_partition(tenant, model, scheme, adapter)
    }

    /// The replica, the joined `(tenant, model, scheme)` (when the update
    /// names them) and the partition of the update's adapter, when all of
    /// them are known already (and the pair noted as joined): one read
    /// lock. `None` when something has to be interned first.
    fn known_names(&self, update: &CacheUpdate, wants_join: bool) -> Option<KnownNames> {
        let catalog = self.catalog.read();
        let replica = catalog.replica(&update.replica_id)?;
        if !wants_join {
            return Some(KnownNames {
                replica,
                join: None,
                part: None,
            });
        }
        let generation = catalog.generation();
        let scope_names = [
            update.tenant_id.as_str(),
            &update.model_id,
            &update.hash_scheme,
            &update.adapter_id,
        ];
        let (ids, part) = LAST_SCOPE.with_borrow_mut(|memo| {
            if let Some(hit) = memo.get(generation, scope_names) {
                return Some(hit);
            }
            let ids = [
                catalog.name(&update.tenant_id)?,
                catalog.name(&update.model_id)?,
                catalog.name(&update.hash_scheme)?,
            ];
            if !catalog.joined([ids[0], ids[1]]) {
                return None;
            }
            let part = catalog
                .name(&update.adapter_id)
                .and_then(|a| catalog.partition_of([ids[0], ids[1], ids[2], a]));
            memo.set(generation, scope_names, (ids, part));
            Some((ids, part))
        })?;
        Some(KnownNames {
            replica,
            join: Some(ids),
            part,
        })
    }

    /// Applies one additive update from a replica.
    pub fn ingest(&self, update: &CacheUpdate) -> IngestReport {
        let mut report = IngestReport::default();
        let prefix_total = (update.prefixes.len() + update.rejected.len()) as u64;
        if update.tenant_id == PROBE_TENANT {
            report.drop(DropReason::ProbeTenant, prefix_total);
            return report;
        }
        if update.replica_id.is_empty() {
            report.drop(DropReason::EmptyReplica, prefix_total);
            return report;
        }
        let now_ms = self.now_ms();
        let sender = self.announce(update, now_ms);
        report.stats_recorded = update.stats.is_some();
        if update.hash_scheme.is_empty() {
            report.drop(DropReason::EmptyHashScheme, prefix_total);
            return report;
        }
        let mut accepted = self.accept(update, sender.part, &mut report);
        self.touch_first_blocks(&accepted);
        let quota_room = self.quota_room(update, &accepted.parts);
        let written = self.write(update, sender.replica, &mut accepted, quota_room, now_ms);
        report.accepted_prefixes = written.prefixes;
        report.entries_written = written.holding.written;
        report.entries_added = written.holding.added.max(0) as u64;
        report.entries_refused = written.holding.refused;
        if report.entries_added > 0
            && let Some(record) = self.fleet.read().records.get(written.replica)
        {
            record.note_churn(now_ms, report.entries_added, 0);
        }
        report.holders_displaced = written.displaced as u64;
        self.count_evictions(EvictionReason::HoldersPerKey, report.holders_displaced);
        if report.entries_refused > 0 {
            self.refused
                .fetch_add(report.entries_refused, Ordering::Relaxed);
            self.refused_since_sweep
                .fetch_add(report.entries_refused, Ordering::Relaxed);
        }
        report
    }

    /// The sender of an update: its replica id (interned on first contact),
    /// heard from now, its stats recorded and, when the update names tenant,
    /// model and scheme, joined to that serving set; and the partition of
    /// the update's own adapter when it is known already.
    fn announce(&self, update: &CacheUpdate, now_ms: u64) -> KnownNames {
        let wants_join = !update.hash_scheme.is_empty()
            && !update.tenant_id.is_empty()
            && !update.model_id.is_empty();
        // The steady stream of reports names a known replica in a known,
        // joined scope: resolve all of it under one read lock. Anything new
        // goes the way that interns it.
        let sender = self.known_names(update, wants_join).unwrap_or_else(|| {
            let replica = self.replica_id(&update.replica_id);
            let join = wants_join.then(|| {
                let ids = self.name_ids([&update.tenant_id, &update.model_id, &update.hash_scheme]);
                self.note_joined([ids[0], ids[1]]);
                ids
            });
            KnownNames {
                replica,
                join,
                part: None,
            }
        });
        self.record_stats(sender.replica, update.stats.as_ref(), now_ms, sender.join);
        sender
    }

    /// The update's prefixes that pass the checks (the others are counted
    /// as dropped in `report`), and the partitions they go to.
    fn accept<'u>(
        &self,
        update: &'u CacheUpdate,
        known_part: Option<PartitionId>,
        report: &mut IngestReport,
    ) -> Accepted<'u> {
        let mut accepted = Accepted {
            parts: SmallVec::new(),
            prefixes: SmallVec::new(),
        };
        // Chains are valid by construction; what the sender refused is
        // counted here, after the checks of the whole update.
        for &reason in &update.rejected {
            report.drop(reason, 1);
        }
        for prefix in &update.prefixes {
            if prefix.chain.is_empty() && prefix.prefix_hash.is_empty() {
                report.drop(DropReason::EmptyHash, 1);
                continue;
            }
            let adapter = if prefix.adapter_id.is_empty() {
                update.adapter_id.as_str()
            } else {
                prefix.adapter_id.as_str()
            };
            let parts = &mut accepted.parts;
            let slot = match parts.iter().position(|p| p.adapter == adapter) {
                Some(i) => i,
                None => {
                    let part = match known_part {
                        Some(p) if adapter == update.adapter_id => p,
                        _ => self.partition_id(
                            &update.tenant_id,
                            &update.model_id,
                            &update.hash_scheme,
                            adapter,
                        ),
                    };
                    parts.push(UpdatePart {
                        adapter,
                        part,
                        added: 0,
                        new_keys: 0,
                    });
                    parts.len() - 1
                }
            };
            let tier = if prefix.tier == Tier::Unspecified {
                Tier::T1
            } else {
                prefix.tier
            };
            accepted.prefixes.push(AcceptedPrefix {
                slot,
                tier: tier as u8,
                prefix,
            });
        }
        accepted
    }

    /// Starts loading the key-table slot of each accepted chain's first
    /// block, so that its miss overlaps the quota check and taking the
    /// writer: the store's walk of a chain needs that slot first, and the
    /// blocks after it are prefetched by the walk itself.
    fn touch_first_blocks(&self, accepted: &Accepted<'_>) {
        let reader = self.store.reader();
        for p in accepted.prefixes.iter().take(4) {
            if let Some(hash) = (!p.prefix.chain.is_empty()).then(|| p.prefix.chain.hashes.hash(0))
            {
                reader.touch(&Key::new(accepted.parts[p.slot].part, hash));
            }
        }
    }

    /// New entries the tenant's quota still allows (enforced here as well
    /// as by the sweep).
    fn quota_room(&self, update: &CacheUpdate, parts: &[UpdatePart<'_>]) -> i64 {
        let policies = self.policies.load();
        let quota = policies.for_tenant(&update.tenant_id).max_index_entries;
        match (quota, parts.first()) {
            (Some(max), Some(&UpdatePart { part, .. })) => {
                let catalog = self.catalog.read();
                let held = catalog
                    .partitions
                    .get(part)
                    .map_or(0, |p| p.tenant_entries.load(Ordering::Relaxed));
                i64::try_from(max).unwrap_or(i64::MAX) - held
            }
            _ => i64::MAX,
        }
    }

    /// Writes the accepted prefixes' blocks under the store's writer and
    /// applies the counter deltas before letting it go.
    fn write(
        &self,
        update: &CacheUpdate,
        replica: ReplicaId,
        accepted: &mut Accepted<'_>,
        quota_room: i64,
        now_ms: u64,
    ) -> Written {
        let parts = &mut accepted.parts;
        let mut displaced: Vec<(PartitionId, ReplicaId)> = Vec::new();
        let mut keys: SmallVec<[(Key<'_>, u32); 64]> = SmallVec::new();
        let mut replica = replica;
        let mut w = self.store.write();
        // A sweep may have freed an id resolved above (nothing held under
        // it then); sweeps free under the writer, so checking here is
        // enough. Ids are never reused, so a stale one cannot name another
        // replica or partition.
        let stale = {
            let catalog = self.catalog.read();
            !catalog.replica_alive(replica)
                || parts
                    .iter()
                    .any(|p| catalog.partitions.get(p.part).is_none())
        };
        if stale {
            replica = self.replica_id(&update.replica_id);
            for p in parts.iter_mut() {
                p.part = self.partition_id(
                    &update.tenant_id,
                    &update.model_id,
                    &update.hash_scheme,
                    p.adapter,
                );
            }
        }
        // New entries this update may still add under the global cap.
        let cap = i64::try_from(self.max_entries()).unwrap_or(i64::MAX);
        let global_room = cap.saturating_sub(i64::try_from(w.entries()).unwrap_or(i64::MAX));
        let mut holding = Holding {
            room: global_room.min(quota_room),
            max_holders: self.max_holders_per_key(),
            ..Holding::default()
        };
        let claim_at = |tier| Claim {
            replica,
            last_seen: ms_to_secs(now_ms),
            tier,
        };
        for &AcceptedPrefix { slot, tier, prefix } in &accepted.prefixes {
            let part = parts[slot].part;
            let claim = claim_at(tier);
            let before = (holding.added, holding.new_keys, holding.displaced.len());
            let chain = &prefix.chain;
            match &chain.hashes {
                // 8-byte hashes: keys are built from the words as needed.
                BlockHashes::Narrow(hashes) => {
                    let blocks = NarrowChain {
                        hashes,
                        counts: &chain.token_counts,
                    };
                    w.hold(part, &blocks, claim, &mut holding);
                }
                BlockHashes::Wide { .. } => {
                    keys.clear();
                    keys.extend(
                        (chain.hashes.refs())
                            .zip(&chain.token_counts)
                            .map(|(hash, &count)| (Key::new(part, hash), count)),
                    );
                    w.hold(part, &keys[..], claim, &mut holding);
                }
            }
            if !prefix.prefix_hash.is_empty() {
                let key = Key::of_bytes(part, &prefix.prefix_hash);
                w.hold(part, &[(key, prefix.token_count)][..], claim, &mut holding);
            }
            parts[slot].added += holding.added - before.0;
            parts[slot].new_keys += holding.new_keys - before.1;
            displaced.extend(holding.displaced[before.2..].iter().map(|&v| (part, v)));
        }
        // Counters move with the store, under the writer, so a sweep never
        // sees cells its counters do not show.
        let mut deltas = Deltas::default();
        for p in parts.iter() {
            deltas.entry(p.part, replica, p.added);
            deltas.key(p.part, p.new_keys);
        }
        for &(part, victim) in &displaced {
            deltas.entry(part, victim, -1);
        }
        self.apply(&deltas);
        drop(w);
        Written {
            replica,
            prefixes: accepted.prefixes.len() as u64,
            displaced: displaced.len(),
            holding,
        }
    }

    /// New entries refused at the global entry cap so far.
    pub fn entries_refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Most replicas one key keeps (the stalest makes room for a new one).
    pub fn max_holders_per_key(&self) -> usize {
        self.max_holders.load(Ordering::Relaxed) as usize
    }

    /// Changes the holders-per-key bound (applies to later ingests).
    pub fn set_max_holders_per_key(&self, max: usize) {
        self.max_holders.store(max.max(1) as u64, Ordering::Relaxed);
    }

    /// Marks the replica heard, records its stats and joins it to the
    /// `(tenant, model)` serving set under `scheme` (`join`). For a known
    /// member (and a known replica the stats describe) all of it happens
    /// under the fleet's shared lock; otherwise in one hold of its write
    /// lock.
    fn record_stats(
        &self,
        replica: ReplicaId,
        stats: Option<&ReplicaStatsReport>,
        now_ms: u64,
        join: Option<[NameId; 3]>,
    ) {
        let target = match stats {
            Some(s) if !s.replica_id.is_empty() => self.replica_id(&s.replica_id),
            _ => replica,
        };
        let stats = stats.map(|s| {
            let mut s = s.clone();
            if s.replica_id.is_empty() {
                s.replica_id = self.catalog.read().replica_str(replica).to_string();
            }
            s
        });
        {
            let fleet = self.fleet.read();
            // The record the stats go to (none to find for an update
            // without stats: block reports and heartbeats).
            let record = stats.as_ref().and_then(|_| fleet.records.get(target));
            if (stats.is_none() || record.is_some()) && fleet.touch(replica, now_ms, join) {
                if let (Some(stats), Some(record)) = (stats, record) {
                    record.set_stats(stats, now_ms);
                }
                return;
            }
        }
        let mut fleet = self.fleet_write();
        fleet.heard(replica, now_ms);
        if let Some(stats) = stats {
            fleet.record_stats(target, stats, now_ms);
        }
        if let Some([tenant, model, scheme]) = join {
            fleet.join(replica, tenant, model, Some(scheme));
        }
    }

    /// The fleet's write lock, taken in the gaps between lookups (see
    /// [`ReadMostly::write_between_readers`]).
    pub(crate) fn fleet_write(&self) -> ShardedLockWriteGuard<'_, Fleet> {
        self.fleet.write_between_readers()
    }

    /// The catalog's write lock, taken in the gaps between lookups.
    pub(crate) fn catalog_write(&self) -> ShardedLockWriteGuard<'_, Catalog> {
        self.catalog.write_between_readers()
    }

    /// Remembers that the fleet has members in `(tenant, model)`, so the
    /// names stay interned while it does.
    fn note_joined(&self, pair: [NameId; 2]) {
        if !self.catalog.read().joined(pair) {
            self.catalog_write().note_joined(pair);
        }
    }

    /// Applies counter deltas to partitions, scopes and totals.
    pub(crate) fn apply(&self, deltas: &Deltas) {
        if deltas.entries.is_empty() && deltas.keys.is_empty() {
            return;
        }
        let catalog = self.catalog.read();
        let mut total = 0;
        for ((part, replica), d) in deltas.entries.iter() {
            if let Some(partition) = catalog.partitions.get(part) {
                partition.entries.fetch_add(d, Ordering::Relaxed);
                partition.tenant_entries.fetch_add(d, Ordering::Relaxed);
                if let Some(scope) = catalog.scopes.get(partition.scope) {
                    scope.add(replica, d);
                }
            }
            total += d;
        }
        let mut keys = 0;
        for (part, d) in deltas.keys.iter() {
            if let Some(partition) = catalog.partitions.get(part) {
                partition.keys.fetch_add(d, Ordering::Relaxed);
            }
            keys += d;
        }
        self.entries.fetch_add(total, Ordering::Relaxed);
        self.keys.fetch_add(keys, Ordering::Relaxed);
    }

    /// Applies a producer event.
    pub fn publish(&self, event: &CacheEvent) -> EventReport {
        if event.tenant_id == PROBE_TENANT {
            return EventReport::default();
        }
        let now_ms = self.now_ms();
        let mut report = EventReport {
            applied: true,
            entries_removed: 0,
        };
        match event.kind {
            EventKind::PrefixAdded => {}
            EventKind::ReplicaUpdated => self.heartbeat(event, now_ms),
            EventKind::PrefixEvicted => {
                report.entries_removed = self.evict_prefix(event);
            }
            EventKind::AllCleared => {
                report.entries_removed = self.clear_replica(event);
                self.leave(event);
            }
        }
        self.count_evictions(EvictionReason::Event, report.entries_removed);
        report
    }

    /// REPLICA_UPDATED: liveness; naming tenant and model it also joins that
    /// serving set and holds the replica to `replicaTimeout` from now on.
    fn heartbeat(&self, event: &CacheEvent, now_ms: u64) {
        if event.replica_id.is_empty() {
            return;
        }
        let replica = self.replica_id(&event.replica_id);
        let pair = (!event.tenant_id.is_empty() && !event.model_id.is_empty())
            .then(|| self.name_ids([&event.tenant_id, &event.model_id]));
        if let Some(pair) = pair {
            self.note_joined(pair);
        }
        {
            // A known heartbeating member only moves its last-heard time.
            let fleet = self.fleet.read();
            if let Some(record) = fleet.records.get(replica)
                && pair.is_none_or(|[tenant, model]| {
                    record.heartbeats()
                        && fleet
                            .members(tenant, model)
                            .iter()
                            .any(|m| m.replica == replica)
                })
            {
                record.heard(now_ms);
                return;
            }
        }
        let mut fleet = self.fleet_write();
        let record = fleet.heard(replica, now_ms);
        if let Some([tenant, model]) = pair {
            record.set_heartbeats();
            fleet.join(replica, tenant, model, None);
        }
    }

    /// ALL_CLEARED: the replica leaves the serving sets the event names.
    fn leave(&self, event: &CacheEvent) {
        let (replica, tenant, model) = {
            let catalog = self.catalog.read();
            let Some(replica) = catalog.replica(&event.replica_id) else {
                return;
            };
            let name = |n: &str| -> Result<Option<NameId>, ()> {
                if n.is_empty() {
                    Ok(None)
                } else {
                    catalog.name(n).map(Some).ok_or(())
                }
            };
            let (Ok(tenant), Ok(model)) = (name(&event.tenant_id), name(&event.model_id)) else {
                return;
            };
            (replica, tenant, model)
        };
        self.fleet_write().leave(replica, tenant, model);
    }

    /// Partitions an event addresses: empty tenant/model match all; adapter only if `narrow`.
    fn event_partitions(&self, event: &CacheEvent, narrow_adapter: bool) -> Vec<PartitionId> {
        let catalog = self.catalog.read();
        let want = |name: &str| -> Option<Option<u32>> {
            if name.is_empty() {
                Some(None)
            } else {
                catalog.name(name).map(Some)
            }
        };
        let (Some(tenant), Some(model)) = (want(&event.tenant_id), want(&event.model_id)) else {
            return Vec::new();
        };
        let adapter = if narrow_adapter && !event.adapter_id.is_empty() {
            match catalog.name(&event.adapter_id) {
                Some(a) => Some(a),
                None => return Vec::new(),
            }
        } else {
            None
        };
        catalog
            .partitions_of(tenant, model)
            .into_iter()
            .filter(|&id| {
                catalog
                    .partitions
                    .get(id)
                    .is_some_and(|p| adapter.is_none_or(|a| p.adapter == a))
            })
            .collect()
    }

    fn evict_prefix(&self, event: &CacheEvent) -> u64 {
        if event.prefix_hash.is_empty() || event.replica_id.is_empty() {
            return 0;
        }
        let Some(replica) = self.catalog.read().replica(&event.replica_id) else {
            return 0;
        };
        let parts = self.event_partitions(event, true);
        let mut deltas = Deltas::default();
        let mut w = self.store.write();
        for part in parts {
            let key = Key::of_bytes(part, &event.prefix_hash);
            let (entry, key) = w.release(part, &key, replica);
            if entry {
                deltas.entry(part, replica, -1);
            }
            if key {
                deltas.key(part, -1);
            }
        }
        self.apply(&deltas);
        drop(w);
        let removed = -deltas.total_entries() as u64;
        if removed > 0
            && let Some(record) = self.fleet.read().records.get(replica)
        {
            record.note_churn(self.now_ms(), 0, removed);
        }
        removed
    }

    fn clear_replica(&self, event: &CacheEvent) -> u64 {
        if event.replica_id.is_empty() {
            return 0;
        }
        let Some(replica) = self.catalog.read().replica(&event.replica_id) else {
            return 0;
        };
        let name = |catalog: &Catalog, n: &str| -> Result<Option<NameId>, ()> {
            if n.is_empty() {
                Ok(None)
            } else {
                catalog.name(n).map(Some).ok_or(())
            }
        };
        let mut deltas = Deltas::default();
        // Only the runs the replica has cells in are visited, each checked
        // against the event's tenant and model: the cost follows what the
        // replica held, not the size of the index or the number of names.
        // Lock order: store writer, then catalog.
        let mut w = self.store.write();
        {
            let catalog = self.catalog.read();
            let (Ok(tenant), Ok(model)) = (
                name(&catalog, &event.tenant_id),
                name(&catalog, &event.model_id),
            ) else {
                return 0;
            };
            w.clear(
                replica,
                |part| {
                    catalog.partitions.get(part).is_some_and(|p| {
                        tenant.is_none_or(|t| p.tenant == t) && model.is_none_or(|m| p.model == m)
                    })
                },
                &mut deltas,
            );
        }
        self.apply(&deltas);
        drop(w);
        -deltas.total_entries() as u64
    }

    /// The `(tenant, model)` aggregate behind GetCacheState.
    pub fn cache_state(&self, tenant_id: &str, model_id: &str) -> ScopeState {
        if tenant_id == PROBE_TENANT {
            return ScopeState::default();
        }
        let catalog = self.catalog.read();
        let (Some(tenant), Some(model)) = (catalog.name(tenant_id), catalog.name(model_id)) else {
            return ScopeState::default();
        };
        let mut summary = CacheSummary::default();
        for p in catalog
            .partitions
            .iter()
            .filter(|p| p.tenant == tenant && p.model == model)
        {
            summary.prefix_count += p.keys.load(Ordering::Relaxed);
            summary.entry_count += p.entries.load(Ordering::Relaxed);
        }
        let mut held: HashMap<ReplicaId, i64> = HashMap::new();
        for s in catalog
            .scopes
            .iter()
            .filter(|s| s.tenant == tenant && s.model == model)
        {
            for (r, n) in s.serving() {
                *held.entry(r).or_insert(0) += n;
            }
        }
        let replicas = self.replica_states(&catalog, &held);
        summary.replica_count = replicas.len() as i32;
        let with_stats: Vec<&ReplicaStatsReport> =
            replicas.iter().filter_map(|r| r.stats.as_ref()).collect();
        if !with_stats.is_empty() {
            let n = with_stats.len() as f32;
            summary.mean_hit_rate = with_stats.iter().map(|s| s.hit_rate).sum::<f32>() / n;
            summary.mean_pressure = with_stats.iter().map(|s| s.pressure).sum::<f32>() / n;
            summary.cache_memory_bytes = with_stats.iter().map(|s| s.cache_memory_bytes).sum();
        }
        ScopeState { replicas, summary }
    }

    fn replica_states(
        &self,
        catalog: &Catalog,
        held: &HashMap<ReplicaId, i64>,
    ) -> Vec<ReplicaState> {
        let fleet = self.fleet.read();
        let now_ms = self.now_ms();
        let mut out: Vec<ReplicaState> = held
            .iter()
            .map(|(&r, &entries)| {
                let record = fleet.records.get(r);
                let stats = record.and_then(|x| x.stats.report());
                ReplicaState {
                    replica_id: catalog.replica_str(r).to_string(),
                    stats_received_ms: stats.as_ref().map(|&(_, at_ms)| at_ms),
                    stats: stats.map(|(report, _)| report),
                    last_heard_ms: record.map(ReplicaRecord::last_heard_ms),
                    entries,
                    heartbeats: record.is_some_and(ReplicaRecord::heartbeats),
                    pending_tokens: record.map_or(0, |x| x.pending()),
                    cache_full: record.map_or(0.0, |x| x.churn(now_ms)),
                    member_of: fleet
                        .memberships_of(r)
                        .into_iter()
                        .map(|[t, m]| format!("{}/{}", catalog.name_str(t), catalog.name_str(m)))
                        .collect(),
                }
            })
            .collect();
        out.sort_by(|a, b| a.replica_id.cmp(&b.replica_id));
        out
    }

    /// The cluster aggregate served at `/snapshot`; the probe tenant is excluded.
    pub fn snapshot(&self) -> Snapshot {
        let catalog = self.catalog.read();
        let probe = catalog.name(PROBE_TENANT);
        let mut held: HashMap<ReplicaId, i64> = HashMap::new();
        let mut tenants: HashMap<u32, (TenantSnapshot, hashbrown::HashSet<ReplicaId>)> =
            HashMap::new();
        for s in catalog.scopes.iter().filter(|s| Some(s.tenant) != probe) {
            let serving = s.serving();
            let row = tenants.entry(s.tenant).or_insert_with(|| {
                (
                    TenantSnapshot {
                        tenant_id: catalog.name_str(s.tenant).to_string(),
                        models: Vec::new(),
                        replica_count: 0,
                        prefix_count: 0,
                        entry_count: 0,
                    },
                    hashbrown::HashSet::new(),
                )
            });
            if !serving.is_empty() {
                let model = catalog.name_str(s.model).to_string();
                if !row.0.models.contains(&model) {
                    row.0.models.push(model);
                }
            }
            for (r, n) in serving {
                *held.entry(r).or_insert(0) += n;
                row.1.insert(r);
            }
        }
        for p in catalog
            .partitions
            .iter()
            .filter(|p| Some(p.tenant) != probe)
        {
            if let Some(row) = tenants.get_mut(&p.tenant) {
                row.0.prefix_count += p.keys.load(Ordering::Relaxed);
                row.0.entry_count += p.entries.load(Ordering::Relaxed);
            }
        }
        for r in self
            .fleet
            .read()
            .records
            .ids()
            .filter(|&r| catalog.replica_alive(r))
        {
            held.entry(r).or_insert(0);
        }
        let replicas = self.replica_states(&catalog, &held);
        let mut tenants: Vec<TenantSnapshot> = tenants
            .into_values()
            .filter(|(t, _)| t.entry_count > 0)
            .map(|(mut t, set)| {
                t.replica_count = set.len();
                t.models.sort();
                t
            })
            .collect();
        tenants.sort_by(|a, b| a.tenant_id.cmp(&b.tenant_id));
        Snapshot {
            taken_at_ms: self.now_ms(),
            entry_count: self.entry_count(),
            prefix_count: self.prefix_count(),
            max_entries: self.max_entries(),
            replicas,
            tenants,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ReadMostly;

    #[test]
    fn read_mostly_readers_see_whole_writes_and_outlive_a_panicking_writer() {
        let lock = ReadMostly::new((0u64, 0u64));
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..20_000 {
                        let pair = lock.read();
                        assert_eq!(pair.0, pair.1, "a reader saw half a write");
                    }
                });
            }
            s.spawn(|| {
                for i in 1..=2_000u64 {
                    let mut pair = lock.write_between_readers();
                    pair.0 = i;
                    pair.1 = i;
                }
            });
        });
        assert_eq!(*lock.read(), (2_000, 2_000));
        // A writer that panics leaves what it wrote to those after it.
        let failed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut pair = lock.write_between_readers();
            pair.0 = 7;
            panic!("the writer fails half-way");
        }));
        assert!(failed.is_err());
        assert_eq!(*lock.read(), (7, 2_000));
        lock.write_between_readers().1 = 7;
        assert_eq!(*lock.read(), (7, 7));
    }

    #[test]
    fn a_reader_that_meets_a_writer_reads_what_it_wrote() {
        use std::time::Duration;
        let lock = ReadMostly::new(0u32);
        // Writers that leave while the reader spins, while it also yields,
        // and after it has gone to wait as usual.
        for (i, hold) in [10, 500, 10_000].into_iter().enumerate() {
            let mut held = lock.write_between_readers();
            std::thread::scope(|s| {
                let reader = s.spawn(|| *lock.read());
                std::thread::sleep(Duration::from_micros(hold));
                *held += 1;
                drop(held);
                assert_eq!(reader.join().expect("reader"), i as u32 + 1);
            });
        }
        assert_eq!(lock.writes(), 3);
    }
}
