//! Bounded memory: TTL expiry, per-tenant quotas and the global entry cap.
//!
//! A sweep runs in four passes: (1) drop every holder older than its
//! tenant's `evictionTTL` (and end the memberships of replicas whose
//! heartbeats stopped for `replicaTimeout`); (2) for each tenant over
//! `quota.maxIndexEntries`, evict its excess; (3) if the index is still over
//! the global cap, evict the excess spread over tenants in proportion to
//! their entries (ingest refuses new entries at the cap; after a refusal the
//! sweep makes extra room); (4) free the partitions, scopes, names and
//! replica ids nothing refers to any more. Victims within a tenant are
//! chosen in the tenant's order: LRU (oldest `last_seen` first) or LFU
//! (fewest accesses first, oldest first on ties).
//!
//! Cost: each pass over the store holds its writer for [`SWEEP_CHUNK`]
//! runs at a time, so ingest waits for one chunk at most, and lookups, which
//! read the store without locks, never wait. Eviction counts a tenant's
//! cells per order key in one pass (one counter per distinct key, never a
//! record per entry) and clears the victims in a second. The catalog and the
//! fleet are read under their shared locks, beside lookups, and taken
//! exclusively only when a read-only pass found a membership to end or
//! something nothing refers to any more: in the steady state a sweep never
//! holds a lookup up. What is due is then freed [`FREE_CHUNK`] items per
//! hold of the exclusive locks, so after a flood of names a lookup waits
//! for one chunk (tens of microseconds), not for the whole flood (64–72 ms
//! for 20,000 adapters, when they were freed in one hold).

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

use hashbrown::HashMap;

use crate::catalog::{Catalog, Freed, NameId, ReplicaId, Unused};
use crate::clock::ms_to_secs;
use crate::fleet::Fleet;
use crate::index::{CacheIndex, Deltas};
use crate::messages::{EvictionReason, SweepReport};
use crate::policy::Eviction;
use crate::store::{Cell, Writing};

/// Runs a sweep visits per hold of the writer.
const SWEEP_CHUNK: u32 = 1024;
/// Partitions, scopes, names and replicas freed per hold of the catalog's
/// and the fleet's exclusive locks (a few tens of microseconds).
pub(crate) const FREE_CHUNK: usize = 32;
/// Times what is due is found again, when somebody wrote between the
/// chunks, before it is freed in one hold.
const FREE_RESCANS: usize = 8;

/// What a sweep found due for freeing under the shared locks.
struct Due {
    /// Fleet records under freed replica ids (see [`dead_records`]).
    dead: Vec<ReplicaId>,
    shrink_fleet: bool,
    unused: Unused,
}

impl Due {
    /// What is due now (the sweep holds the store's writer, `w`).
    fn find(catalog: &Catalog, fleet: &Fleet, w: &Writing<'_>) -> Self {
        Self {
            dead: dead_records(catalog, fleet),
            shrink_fleet: fleet.shrink_due(),
            unused: unused_names(catalog, fleet, w),
        }
    }

    fn is_empty(&self) -> bool {
        self.dead.is_empty() && !self.shrink_fleet && self.unused.is_empty()
    }
}

impl CacheIndex {
    /// Runs TTL expiry, quota and cap eviction once.
    pub fn sweep(&self) -> SweepReport {
        let mut report = SweepReport {
            ttl: self.expire(),
            ..SweepReport::default()
        };
        self.count_evictions(EvictionReason::Ttl, report.ttl);
        report.members_expired = self.expire_members() as u64;

        let policies = self.policies.load();
        let (tenant_of, names, mut per_tenant) = {
            let catalog = self.catalog.read();
            let mut tenant_of: Vec<NameId> = vec![NameId::MAX; catalog.partitions.bound()];
            for (id, p) in catalog.partitions.with_ids() {
                tenant_of[id as usize] = p.tenant;
            }
            let mut per_tenant: HashMap<NameId, i64> = HashMap::new();
            let mut names: HashMap<NameId, String> = HashMap::new();
            for p in catalog.partitions.iter() {
                *per_tenant.entry(p.tenant).or_insert(0) += p.entries.load(Ordering::Relaxed);
                names
                    .entry(p.tenant)
                    .or_insert_with(|| catalog.name_str(p.tenant).to_string());
            }
            (tenant_of, names, per_tenant)
        };
        let mode = |t: NameId| {
            policies
                .for_tenant(names.get(&t).map_or("", String::as_str))
                .eviction
        };

        let mut quota_plan: HashMap<NameId, u64> = HashMap::new();
        for (&tenant, &entries) in &per_tenant {
            let Some(max) = policies
                .for_tenant(names.get(&tenant).map_or("", String::as_str))
                .max_index_entries
            else {
                continue;
            };
            if entries > 0 && entries as u64 > max {
                quota_plan.insert(tenant, entries as u64 - max);
            }
        }
        if !quota_plan.is_empty() {
            report.quota = self.evict(&tenant_of, &quota_plan, &mode);
            self.count_evictions(EvictionReason::Quota, report.quota);
            for (t, n) in &quota_plan {
                if let Some(e) = per_tenant.get_mut(t) {
                    *e -= *n as i64;
                }
            }
        }

        // Ingest refuses new entries at the cap; when it had to, evict an
        // extra twentieth of the cap so fresh blocks find room before the
        // next sweep.
        let total = self.entry_count().max(0) as u64;
        let cap = self.max_entries();
        let refused = self.refused_since_sweep.swap(0, Ordering::Relaxed);
        let target = if refused > 0 {
            cap.saturating_sub((cap / 20).max(1))
        } else {
            cap
        };
        if total > target {
            let excess = total - target;
            let mut plan: HashMap<NameId, u64> = HashMap::new();
            for (&tenant, &entries) in per_tenant.iter().filter(|(_, e)| **e > 0) {
                let share = (excess as u128 * entries as u128).div_ceil(total as u128);
                plan.insert(tenant, share as u64);
            }
            report.capacity = self.evict(&tenant_of, &plan, &mode);
            self.count_evictions(EvictionReason::Capacity, report.capacity);
        }
        let freed = self.free_unused();
        report.names_freed = (freed.names + freed.replicas) as u64;
        report.partitions_freed = freed.partitions as u64;
        report
    }

    /// Ends the memberships of replicas whose heartbeats stopped. The
    /// fleet is taken exclusively only when one is due.
    fn expire_members(&self) -> usize {
        let policies = self.policies.load();
        let now_ms = self.now_ms();
        let catalog = self.catalog.read();
        let timeout_ms = |tenant| {
            let timeout = policies
                .for_tenant(catalog.name_str(tenant))
                .replica_timeout;
            u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX)
        };
        if !self.fleet.read().any_expired(now_ms, timeout_ms) {
            return 0;
        }
        self.fleet_write().expire(now_ms, timeout_ms)
    }

    fn expire(&self) -> u64 {
        let now = ms_to_secs(self.now_ms());
        let policies = self.policies.load();
        // Cells of a freed partition go too; partitions newer than this
        // list are left alone.
        let cutoff: Vec<u32> = {
            let catalog = self.catalog.read();
            let mut cutoff = vec![u32::MAX; catalog.partitions.bound()];
            for (id, p) in catalog.partitions.with_ids() {
                let ttl = policies
                    .for_tenant(catalog.name_str(p.tenant))
                    .eviction_ttl
                    .as_secs();
                cutoff[id as usize] = now.saturating_sub(u32::try_from(ttl).unwrap_or(u32::MAX));
            }
            cutoff
        };
        let mut removed = 0;
        self.each_run_chunk(
            |w, run, deltas| {
                w.retain(
                    run,
                    |part, _, cell| {
                        cutoff
                            .get(part as usize)
                            .is_none_or(|&c| cell.last_seen() >= c)
                    },
                    deltas,
                );
            },
            &mut removed,
        );
        self.store.write().compact_table();
        removed
    }

    /// Calls `visit` for every run id, taking the writer for [`SWEEP_CHUNK`]
    /// runs at a time so ingest is never held up for a whole pass; the
    /// counter changes of each chunk are applied before the writer is let
    /// go, and the entries removed are added to `removed`.
    fn each_run_chunk(
        &self,
        mut visit: impl FnMut(&mut Writing<'_>, u32, &mut Deltas),
        removed: &mut u64,
    ) {
        let mut start = 0;
        loop {
            let mut w = self.store.write();
            let bound = w.run_bound();
            if start >= bound {
                return;
            }
            let end = (start + SWEEP_CHUNK).min(bound);
            let mut deltas = Deltas::default();
            for run in start..end {
                visit(&mut w, run, &mut deltas);
            }
            self.apply(&deltas);
            *removed += (-deltas.total_entries()).max(0) as u64;
            start = end;
        }
    }

    /// Frees partitions, scopes, names and replica ids nothing refers to any
    /// more, so a flood of names costs nothing once it is cleared. What is
    /// due is found under the shared locks, beside lookups, and freed
    /// [`FREE_CHUNK`] items at a time under the exclusive ones, so a lookup
    /// waits for one chunk at most (in the steady state, with nothing due,
    /// a sweep never holds a lookup up). The store's writer, held
    /// throughout, keeps every count of entries as it was found; a chunk is
    /// freed only if nobody else took the catalog or the fleet exclusively
    /// since (a new name, partition, record or membership could make a name
    /// found unused used again), and otherwise what is due is found again.
    fn free_unused(&self) -> Freed {
        self.free_unused_between(|| {})
    }

    /// [`free_unused`](Self::free_unused), calling `between` each time it
    /// lets the exclusive locks go with more to free (where lookups, and
    /// writers of new names, get in).
    pub(crate) fn free_unused_between(&self, mut between: impl FnMut()) -> Freed {
        // Lock order: store writer, catalog, fleet (lookups take catalog
        // then fleet, and nothing waits for the writer holding either).
        let mut w = self.store.write();
        w.shrink();
        let mut freed = Freed::default();
        for _ in 0..FREE_RESCANS {
            let (mut due, mut writes) = {
                let catalog = self.catalog.read();
                let fleet = self.fleet.read();
                let due = Due::find(&catalog, &fleet, &w);
                (due, (self.catalog.writes(), self.fleet.writes()))
            };
            if due.is_empty() {
                return freed;
            }
            let mut first = true;
            loop {
                let chunk = due.unused.take(FREE_CHUNK);
                let mut catalog = self.catalog_write();
                let mut fleet = self.fleet_write();
                if (self.catalog.writes(), self.fleet.writes()) != (writes.0 + 1, writes.1 + 1) {
                    // Somebody wrote between the chunks: find it all again.
                    break;
                }
                writes = (writes.0 + 1, writes.1 + 1);
                if first {
                    settle_fleet(&mut fleet, &due.dead, due.shrink_fleet);
                    first = false;
                }
                freed += catalog.free(chunk);
                if due.unused.is_empty() {
                    return freed;
                }
                drop((catalog, fleet));
                between();
            }
        }
        // Names kept being written between the chunks: free what is due
        // in one hold of the exclusive locks, found again under them.
        let mut catalog = self.catalog_write();
        let mut fleet = self.fleet_write();
        let dead = dead_records(&catalog, &fleet);
        settle_fleet(&mut fleet, &dead, true);
        let unused = unused_names(&catalog, &fleet, &w);
        freed += catalog.free(unused);
        freed
    }

    /// Evicts `plan[tenant]` entries of each tenant in its victim order:
    /// one pass counts the tenant's cells per order key, which fixes the
    /// cut-off key; a second pass clears the cells below it (and as many
    /// at it as are still due). Memory: one counter per distinct key.
    fn evict(
        &self,
        tenant_of: &[NameId],
        plan: &HashMap<NameId, u64>,
        mode: &dyn Fn(NameId) -> Eviction,
    ) -> u64 {
        let lfu: HashMap<NameId, bool> = plan
            .keys()
            .map(|&t| (t, mode(t) == Eviction::Lfu))
            .collect();
        let order = |tenant: NameId, cell: Cell| -> Option<u64> {
            let is_lfu = *lfu.get(&tenant)?;
            Some(if is_lfu {
                (u64::from(cell.access()) << 32) | u64::from(cell.last_seen())
            } else {
                u64::from(cell.last_seen())
            })
        };
        let mut counts: HashMap<NameId, BTreeMap<u64, u64>> = HashMap::new();
        let mut nothing = 0;
        self.each_run_chunk(
            |w, run, _| {
                w.for_each(run, |part, _, cell| {
                    if let Some(&tenant) = tenant_of.get(part as usize)
                        && let Some(key) = order(tenant, cell)
                    {
                        *counts.entry(tenant).or_default().entry(key).or_insert(0) += 1;
                    }
                });
            },
            &mut nothing,
        );
        // Per tenant: evict every key below `cut`, and `at_cut` cells at it.
        let mut cuts: HashMap<NameId, (u64, u64)> = HashMap::new();
        for (tenant, keys) in &counts {
            let due = plan.get(tenant).copied().unwrap_or(0);
            if due == 0 {
                continue;
            }
            let mut below = 0u64;
            let mut cut = (u64::MAX, 0);
            for (&key, &n) in keys {
                if below + n >= due {
                    cut = (key, due - below);
                    break;
                }
                below += n;
            }
            if cut.0 == u64::MAX {
                // Fewer cells than due: all of them.
                cut = (u64::MAX, u64::MAX);
            }
            cuts.insert(*tenant, cut);
        }
        let mut removed = 0;
        self.each_run_chunk(
            |w, run, deltas| {
                w.retain(
                    run,
                    |part, _, cell| {
                        let Some(&tenant) = tenant_of.get(part as usize) else {
                            return true;
                        };
                        let (Some(key), Some(cut)) = (order(tenant, cell), cuts.get_mut(&tenant))
                        else {
                            return true;
                        };
                        if key < cut.0 {
                            return false;
                        }
                        if key == cut.0 && cut.1 > 0 {
                            cut.1 -= 1;
                            return false;
                        }
                        true
                    },
                    deltas,
                );
            },
            &mut removed,
        );
        self.store.write().compact_table();
        removed
    }
}

/// Fleet records under replica ids a sweep freed: records an update that
/// raced that sweep wrote. They go, with their memberships.
fn dead_records(catalog: &Catalog, fleet: &Fleet) -> Vec<ReplicaId> {
    (fleet.records.ids())
        .filter(|&r| !catalog.replica_alive(r))
        .collect()
}

/// Ends the memberships of `dead` records (see [`dead_records`]) and, with
/// `shrink`, gives the fleet's spare room back.
fn settle_fleet(fleet: &mut Fleet, dead: &[ReplicaId], shrink: bool) {
    for &r in dead {
        fleet.leave(r, None, None);
    }
    if shrink {
        fleet.shrink();
    }
}

/// What of the catalog nothing refers to (see [`Catalog::unused`]): a
/// replica is busy while it has cells in the store or a fleet record, and a
/// joined `(tenant, model)` pair keeps its names, and its members' hash
/// schemes, while the fleet has members there.
fn unused_names(catalog: &Catalog, fleet: &Fleet, w: &Writing<'_>) -> Unused {
    catalog.unused(
        |replica| w.holds_any(replica) || fleet.records.contains(replica),
        |[tenant, model]| {
            let members = fleet.members(tenant, model);
            (!members.is_empty()).then(|| {
                members
                    .iter()
                    .flat_map(|m| m.schemes.iter().copied())
                    .collect()
            })
        },
    )
}
