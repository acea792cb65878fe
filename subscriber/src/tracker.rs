//! Engine block hashes → content fingerprints, and events → report actions.
//!
//! The engine's block hashes are seeded per process, so they mean nothing to
//! the server or to a gateway. The tracker recomputes each stored block's
//! positional content fingerprint from its `token_ids` (with
//! `inference-cache-fingerprint`, chaining from the parent block's
//! fingerprint) and remembers `engine hash → fingerprint` so later events
//! (children, removals) can be mapped. It also remembers where each block
//! lives — device memory and/or an offload tier — which decides the tier a
//! block is reported at and whether a removal evicts it or moves it to T2.
//!
//! Cache salts: a block's partition is
//! `partition_key(adapter, salt)` (`inference_cache_fingerprint`), the same
//! key the server builds for a lookup with that salt, so salted blocks match
//! only salted lookups of the same salt. The salt is the event's own
//! ([`BlockStored::cache_salt`]) or, when the event names none, the parent
//! block's: vLLM puts it on a request's first block only. Removals and
//! snapshots carry the partition the block was stored under.
//!
//! Invariants: a block is reported only when its whole prefix is known (an
//! unknown parent drops the event: a fingerprint that does not start at
//! token 0 would be a wrong key); blocks of an unmapped LoRA id are dropped.
//! The map is bounded: past capacity the least recently stored hashes are
//! forgotten (their server entries age out by TTL).
//!
//! Concurrency: none inside; one tracker per engine endpoint, used under the
//! pipeline lock. Cost: O(blocks) per event, one hash-map probe per block.

use std::collections::VecDeque;
use std::sync::Arc;

use hashbrown::HashMap;
use inference_cache_fingerprint::{partition_key, prefix_hashes_from};

use crate::event::{BlockRemoved, BlockStored, EngineHash, KvEvent, Medium};
use crate::metrics::Metrics;

/// Tier a block is reported at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tier {
    /// Engine KV cache.
    T1,
    /// External offload the engine can reload from.
    T2,
}

/// One unit of work for the reporter, in event order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Action {
    /// Blocks (fingerprints) the replica now holds at `tier` for `adapter`.
    Store {
        /// Index partition: `partition_key(adapter, salt)` ("" is the
        /// unsalted base model).
        adapter: Arc<str>,
        /// Tier of every block.
        tier: Tier,
        /// Fingerprints, in the engine's order.
        fingerprints: Vec<u64>,
    },
    /// Blocks the replica no longer holds anywhere.
    Evict {
        /// Index partition the blocks were stored under.
        adapter: Arc<str>,
        /// Fingerprints to remove.
        fingerprints: Vec<u64>,
    },
    /// The replica's cache is empty.
    Clear,
}

impl Action {
    /// Buffer weight: blocks carried, at least one.
    pub(crate) fn weight(&self) -> usize {
        match self {
            Action::Store { fingerprints, .. } | Action::Evict { fingerprints, .. } => {
                fingerprints.len().max(1)
            }
            Action::Clear => 1,
        }
    }
}

#[derive(Debug, Clone)]
struct Slot {
    fingerprint: u64,
    /// Partition key: the adapter name, salted when `salt` is set.
    adapter: Arc<str>,
    /// Cache salt the block was stored under, inherited by its children.
    salt: Option<Arc<str>>,
    on_device: bool,
    offloaded: bool,
    stamp: u64,
}

/// Options of a [`BlockTracker`].
#[derive(Debug, Clone)]
pub(crate) struct TrackerOptions {
    /// Tokens per block.
    pub block_size: u32,
    /// GPU evictions move blocks to T2 instead of removing them.
    pub offload_tier: bool,
    /// Engine LoRA id → stable adapter name.
    pub lora_names: std::collections::HashMap<i64, Arc<str>>,
    /// Most engine hashes remembered.
    pub capacity: usize,
}

/// Per-endpoint engine-hash → fingerprint map and event translator.
#[derive(Debug)]
pub(crate) struct BlockTracker {
    options: TrackerOptions,
    blocks: HashMap<EngineHash, Slot>,
    order: VecDeque<(EngineHash, u64)>,
    next_stamp: u64,
    base: Arc<str>,
    adapter_names: HashMap<Box<str>, Arc<str>>,
    salts: HashMap<Box<str>, Arc<str>>,
    partitions: HashMap<Box<str>, Arc<str>>,
}

/// Most distinct adapter names, salts and partition keys kept interned.
const INTERN_LIMIT: usize = 4096;

/// Returns the shared copy of `name`, adding it while the table has room.
fn intern(table: &mut HashMap<Box<str>, Arc<str>>, name: &str) -> Arc<str> {
    if let Some(interned) = table.get(name) {
        return interned.clone();
    }
    let interned: Arc<str> = Arc::from(name);
    if table.len() < INTERN_LIMIT {
        table.insert(name.into(), interned.clone());
    }
    interned
}

impl BlockTracker {
    pub(crate) fn new(options: TrackerOptions) -> Self {
        Self {
            options,
            blocks: HashMap::new(),
            order: VecDeque::new(),
            next_stamp: 0,
            base: Arc::from(""),
            adapter_names: HashMap::new(),
            salts: HashMap::new(),
            partitions: HashMap::new(),
        }
    }

    /// Engine hashes currently remembered.
    pub(crate) fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Forgets everything (the engine restarted or cleared its cache).
    pub(crate) fn reset(&mut self) {
        self.blocks.clear();
        self.order.clear();
    }

    /// Translates one event, appending the resulting actions to `out`.
    pub(crate) fn apply(&mut self, event: KvEvent, metrics: &Metrics, out: &mut Vec<Action>) {
        match event {
            KvEvent::Stored(stored) => {
                metrics.events_stored.inc();
                self.stored(stored, metrics, out);
            }
            KvEvent::Removed(removed) => {
                metrics.events_removed.inc();
                self.removed(removed, metrics, out);
            }
            KvEvent::AllCleared => {
                metrics.events_cleared.inc();
                self.reset();
                out.push(Action::Clear);
            }
        }
    }

    /// Every block still held, as store actions (used to rebuild the server's view).
    pub(crate) fn snapshot(&self, out: &mut Vec<Action>) {
        for slot in self.blocks.values() {
            let tier = if slot.on_device {
                Tier::T1
            } else if slot.offloaded {
                Tier::T2
            } else {
                continue;
            };
            // Group by (adapter, tier) into the most recent open action.
            let existing = out.iter_mut().rev().take(8).find(|a| {
                matches!(a, Action::Store { adapter, tier: t, .. } if *t == tier && **adapter == *slot.adapter)
            });
            match existing {
                Some(Action::Store { fingerprints, .. }) => fingerprints.push(slot.fingerprint),
                _ => out.push(Action::Store {
                    adapter: slot.adapter.clone(),
                    tier,
                    fingerprints: vec![slot.fingerprint],
                }),
            }
        }
    }

    fn adapter_for(&mut self, stored: &BlockStored) -> Option<Arc<str>> {
        if let Some(name) = stored.lora_name.as_deref().filter(|n| !n.is_empty()) {
            return Some(intern(&mut self.adapter_names, name));
        }
        match stored.lora_id {
            None => Some(self.base.clone()),
            Some(id) => self.options.lora_names.get(&id).cloned(),
        }
    }

    fn stored(&mut self, stored: BlockStored, metrics: &Metrics, out: &mut Vec<Action>) {
        let blocks = stored.block_hashes.len() as u64;
        metrics
            .config_check
            .event_block_size(stored.block_size, self.options.block_size);
        let Some(adapter) = self.adapter_for(&stored) else {
            metrics.dropped_unmapped_lora.inc_by(blocks);
            return;
        };
        if stored.block_size != self.options.block_size {
            metrics.dropped_block_size.inc_by(blocks);
            return;
        }
        let (parent, parent_salt) = match &stored.parent_block_hash {
            None => (None, None),
            Some(hash) => match self.blocks.get(hash) {
                Some(slot) => (Some(slot.fingerprint), slot.salt.clone()),
                None => {
                    metrics.dropped_unknown_parent.inc_by(blocks);
                    return;
                }
            },
        };
        let block_size = self.options.block_size as usize;
        let full_blocks = stored.token_ids.len() / block_size;
        let count = full_blocks.min(stored.block_hashes.len());
        if stored.token_ids.len() != stored.block_hashes.len() * block_size {
            metrics
                .dropped_token_mismatch
                .inc_by(blocks.saturating_sub(count as u64));
        }
        if count == 0 {
            return;
        }
        let fingerprints =
            prefix_hashes_from(parent, &stored.token_ids[..count * block_size], block_size);
        let salt = match stored.cache_salt.as_deref().filter(|s| !s.is_empty()) {
            Some(salt) => Some(intern(&mut self.salts, salt)),
            None => parent_salt,
        };
        let adapter = match &salt {
            None => adapter,
            Some(salt) => intern(&mut self.partitions, &partition_key(&adapter, salt)),
        };
        let medium = Medium::classify(stored.medium.as_deref());
        metrics.blocks_stored.inc_by(count as u64);
        for (hash, fingerprint) in stored
            .block_hashes
            .into_iter()
            .take(count)
            .zip(fingerprints)
        {
            let held_on_device = self.upsert(hash, fingerprint, &adapter, &salt, medium);
            let tier = match medium {
                Medium::Device => Tier::T1,
                // Already resident on the device: T1 stays the truth.
                Medium::Offload if held_on_device => continue,
                Medium::Offload => Tier::T2,
            };
            push_store(out, &adapter, tier, fingerprint);
        }
        self.enforce_capacity();
    }

    /// Records a stored block; returns whether it is (now) on the device.
    fn upsert(
        &mut self,
        hash: EngineHash,
        fingerprint: u64,
        adapter: &Arc<str>,
        salt: &Option<Arc<str>>,
        medium: Medium,
    ) -> bool {
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        self.order.push_back((hash.clone(), stamp));
        let slot = self.blocks.entry(hash).or_insert_with(|| Slot {
            fingerprint,
            adapter: adapter.clone(),
            salt: salt.clone(),
            on_device: false,
            offloaded: false,
            stamp,
        });
        slot.fingerprint = fingerprint;
        slot.stamp = stamp;
        if *slot.adapter != **adapter {
            slot.adapter = adapter.clone();
        }
        if slot.salt != *salt {
            slot.salt = salt.clone();
        }
        match medium {
            Medium::Device => slot.on_device = true,
            Medium::Offload => slot.offloaded = true,
        }
        slot.on_device
    }

    fn removed(&mut self, removed: BlockRemoved, metrics: &Metrics, out: &mut Vec<Action>) {
        let medium = Medium::classify(removed.medium.as_deref());
        for hash in removed.block_hashes {
            let Some(slot) = self.blocks.get_mut(&hash) else {
                metrics.removals_unknown.inc();
                continue;
            };
            metrics.blocks_removed.inc();
            match medium {
                Medium::Device => {
                    slot.on_device = false;
                    if slot.offloaded || self.options.offload_tier {
                        slot.offloaded = true;
                        metrics.tier2_rereports.inc();
                        push_store(out, &slot.adapter.clone(), Tier::T2, slot.fingerprint);
                        continue;
                    }
                }
                Medium::Offload => {
                    slot.offloaded = false;
                    if slot.on_device {
                        continue;
                    }
                }
            }
            let (fingerprint, adapter) = (slot.fingerprint, slot.adapter.clone());
            self.blocks.remove(&hash);
            push_evict(out, &adapter, fingerprint);
        }
    }

    fn enforce_capacity(&mut self) {
        while self.blocks.len() > self.options.capacity {
            let Some((hash, stamp)) = self.order.pop_front() else {
                break;
            };
            if self
                .blocks
                .get(&hash)
                .is_some_and(|slot| slot.stamp == stamp)
            {
                self.blocks.remove(&hash);
            }
        }
        if self.order.len() > 2 * self.options.capacity + 1024 {
            let blocks = &self.blocks;
            self.order
                .retain(|(hash, stamp)| blocks.get(hash).is_some_and(|slot| slot.stamp == *stamp));
        }
    }
}

fn push_store(out: &mut Vec<Action>, adapter: &Arc<str>, tier: Tier, fingerprint: u64) {
    if let Some(Action::Store {
        adapter: last_adapter,
        tier: last_tier,
        fingerprints,
    }) = out.last_mut()
        && *last_tier == tier
        && **last_adapter == **adapter
    {
        fingerprints.push(fingerprint);
        return;
    }
    out.push(Action::Store {
        adapter: adapter.clone(),
        tier,
        fingerprints: vec![fingerprint],
    });
}

fn push_evict(out: &mut Vec<Action>, adapter: &Arc<str>, fingerprint: u64) {
    if let Some(Action::Evict {
        adapter: last_adapter,
        fingerprints,
    }) = out.last_mut()
        && **last_adapter == **adapter
    {
        fingerprints.push(fingerprint);
        return;
    }
    out.push(Action::Evict {
        adapter: adapter.clone(),
        fingerprints: vec![fingerprint],
    });
}

#[cfg(test)]
mod tests;
