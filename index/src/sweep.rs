//! Bounded memory: TTL expiry, per-tenant quotas and the global entry cap.
//!
//! A sweep runs in three passes: (1) drop every holder older than its
//! tenant's `evictionTTL` (and end the memberships of replicas whose
//! heartbeats stopped for `replicaTimeout`); (2) for each tenant over `quota.maxIndexEntries`,
//! evict its excess; (3) if the index is still over the global cap, evict the
//! excess spread over tenants in proportion to their entries (ingest refuses
//! new entries at the cap; after a refusal the sweep makes extra room). Victims within a
//! tenant are chosen in the tenant's order: LRU (oldest `last_seen` first) or
//! LFU (fewest accesses first, oldest first on ties).
//!
//! Cost: pass 1 write-locks one shard at a time; passes 2–3 scan shards under
//! read locks to collect candidates, select victims with `select_nth_unstable`
//! and remove them shard by shard. Lookups on other shards are never blocked.

use std::sync::atomic::Ordering;

use hashbrown::HashMap;

use crate::catalog::{NameId, PartitionId, ReplicaId};
use crate::clock::ms_to_secs;
use crate::index::{CacheIndex, Deltas};
use crate::model::{EvictionReason, SweepReport};
use crate::policy::Eviction;
use crate::store::{KeyId, Store};

struct Victim {
    order: u64,
    part: PartitionId,
    key: KeyId,
    replica: ReplicaId,
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
            let tenant_of: Vec<NameId> = catalog.partitions.iter().map(|p| p.tenant).collect();
            let mut per_tenant: HashMap<NameId, i64> = HashMap::new();
            let mut names: HashMap<NameId, String> = HashMap::new();
            for p in &catalog.partitions {
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
        report
    }

    /// Ends the memberships of replicas whose heartbeats stopped.
    fn expire_members(&self) -> usize {
        let policies = self.policies.load();
        let now_ms = self.now_ms();
        let catalog = self.catalog.read();
        self.fleet.write().expire(now_ms, |tenant| {
            let timeout = policies
                .for_tenant(catalog.name_str(tenant))
                .replica_timeout;
            u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX)
        })
    }

    fn expire(&self) -> u64 {
        let now = ms_to_secs(self.now_ms());
        let policies = self.policies.load();
        let cutoff: Vec<u32> = {
            let catalog = self.catalog.read();
            catalog
                .partitions
                .iter()
                .map(|p| {
                    let ttl = policies
                        .for_tenant(catalog.name_str(p.tenant))
                        .eviction_ttl
                        .as_secs();
                    now.saturating_sub(u32::try_from(ttl).unwrap_or(u32::MAX))
                })
                .collect()
        };
        let mut deltas = Deltas::default();
        for shard in self.store.shards() {
            shard.write().retain(
                |part, h| cutoff.get(part as usize).is_none_or(|&c| h.last_seen >= c),
                |part, r| match r {
                    Some(r) => deltas.entry(part, r, -1),
                    None => deltas.key(part, -1),
                },
            );
        }
        let removed = -deltas.total_entries();
        self.apply(&deltas);
        removed.max(0) as u64
    }

    /// Evicts `plan[tenant]` entries of each tenant in its victim order.
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
        let mut by_tenant: HashMap<NameId, Vec<Victim>> = HashMap::new();
        for shard in self.store.shards() {
            shard.read().for_each(|part, key, h| {
                let Some(&tenant) = tenant_of.get(part as usize) else {
                    return;
                };
                let Some(&is_lfu) = lfu.get(&tenant) else {
                    return;
                };
                let order = if is_lfu {
                    (u64::from(h.access) << 32) | u64::from(h.last_seen)
                } else {
                    u64::from(h.last_seen)
                };
                by_tenant.entry(tenant).or_default().push(Victim {
                    order,
                    part,
                    key,
                    replica: h.replica,
                });
            });
        }
        let mut deltas = Deltas::default();
        for (tenant, mut victims) in by_tenant {
            let n = plan
                .get(&tenant)
                .copied()
                .unwrap_or(0)
                .min(victims.len() as u64) as usize;
            if n == 0 {
                continue;
            }
            if n < victims.len() {
                victims.select_nth_unstable_by_key(n - 1, |v| v.order);
                victims.truncate(n);
            }
            for v in victims {
                let hash = v.key.as_ref();
                let slot = Store::slot(v.part, hash);
                let (entry, key) = self
                    .store
                    .shard(slot.shard)
                    .write()
                    .remove(v.part, hash, slot.mixed, v.replica);
                if entry {
                    deltas.entry(v.part, v.replica, -1);
                }
                if key {
                    deltas.key(v.part, -1);
                }
            }
        }
        let removed = -deltas.total_entries();
        self.apply(&deltas);
        removed.max(0) as u64
    }
}
