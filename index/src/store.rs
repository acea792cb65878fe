//! The sharded block store: prefix key → compact holder list.
//!
//! Key: `(partition, prefix_hash)`. An 8-byte hash (every engine today) is kept
//! as a `u64` in a 32-byte table entry — hash, holder pointer, partition and
//! token count — so a lookup probe touches one cache line of the table plus
//! the holder list. Other widths live in a side table keyed by the raw bytes.
//! Each key's holders are an exact-size boxed slice of 11-byte [`Holder`]s
//! (replica id, last-seen seconds, tier, access count) sorted by replica id,
//! so a chain walk intersects candidates and holders in one merge pass;
//! adding a replica to a key reallocates it, refreshing one is in place. A
//! key keeps at most [`Admit::max_holders`] holders (the stalest makes room).
//!
//! Concurrency: the key space is split over [`SHARDS`] shards, each a pair of
//! [`ProbeTable`]s behind a `parking_lot::RwLock`, picked by a hash of the
//! key independent of the in-table hash. A chain lookup read-locks each shard
//! it needs once, up front for a window of blocks, touches every block's home
//! slot, then probes the window with no atomic in between, so the cache misses
//! of consecutive blocks overlap; ingest takes one write lock per block.
//! Nothing on the lookup path allocates.

use parking_lot::RwLock;

use crate::catalog::{PartitionId, ReplicaId};
use crate::table::{ProbeTable, Rehash};

/// Number of shards (a power of two).
pub(crate) const SHARDS: usize = 64;

/// One replica's claim on a key: 11 bytes, packed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C, packed)]
pub(crate) struct Holder {
    pub replica: ReplicaId,
    pub last_seen: u32,
    pub tier: u8,
    pub access: u16,
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

    fn mixed(self, part: PartitionId) -> u64 {
        match self {
            Self::Narrow(h) => mix(h, part),
            Self::Wide(bytes) => {
                let mut acc = 0xcbf2_9ce4_8422_2325u64 ^ bytes.len() as u64;
                for chunk in bytes.chunks(8) {
                    let mut word = [0u8; 8];
                    word[..chunk.len()].copy_from_slice(chunk);
                    acc = mix(acc ^ u64::from_le_bytes(word), 0);
                }
                mix(acc, part)
            }
        }
    }
}

fn mix(hash: u64, part: PartitionId) -> u64 {
    let x = hash ^ u64::from(part).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let m = u128::from(x) * 0xA076_1D64_78BD_642F;
    (m as u64) ^ ((m >> 64) as u64)
}

#[derive(Debug)]
struct NarrowEntry {
    hash: u64,
    holders: Box<[Holder]>,
    part: PartitionId,
    token_count: u32,
}

impl Rehash for NarrowEntry {
    fn rehash(&self) -> u64 {
        mix(self.hash, self.part)
    }
}

#[derive(Debug)]
struct WideEntry {
    bytes: Box<[u8]>,
    holders: Box<[Holder]>,
    part: PartitionId,
    token_count: u32,
}

impl Rehash for WideEntry {
    fn rehash(&self) -> u64 {
        HashRef::Wide(&self.bytes).mixed(self.part)
    }
}

/// One shard: narrow and wide tables.
#[derive(Debug, Default)]
pub(crate) struct Shard {
    narrow: ProbeTable<NarrowEntry>,
    wide: ProbeTable<WideEntry>,
}

/// What an upsert may do besides refreshing an existing hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Admit {
    /// A new holder (entry) may be added (false at the entry cap).
    pub new_entries: bool,
    /// Most holders a key keeps; past it the stalest holder makes room.
    pub max_holders: usize,
}

/// What an upsert changed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Upserted {
    pub new_key: bool,
    pub new_entry: bool,
    /// The new entry was refused (entry cap).
    pub refused: bool,
    /// The holder that made room for the new one (holders-per-key cap).
    pub displaced: Option<ReplicaId>,
}

/// A key's holders as seen by a reader.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Held<'s> {
    pub token_count: u32,
    pub holders: &'s [Holder],
}

impl Shard {
    /// Starts loading the home slot of a key (see [`ProbeTable::touch`]).
    pub fn touch(&self, hash: HashRef<'_>, mixed: u64) -> usize {
        match hash {
            HashRef::Narrow(_) => self.narrow.touch(mixed),
            HashRef::Wide(_) => self.wide.touch(mixed),
        }
    }

    /// The holders of a key, if any.
    pub fn get(&self, part: PartitionId, hash: HashRef<'_>, mixed: u64) -> Option<Held<'_>> {
        match hash {
            HashRef::Narrow(h) => self
                .narrow
                .find(mixed, |e| e.hash == h && e.part == part)
                .map(|e| Held {
                    token_count: e.token_count,
                    holders: &e.holders,
                }),
            HashRef::Wide(b) => self
                .wide
                .find(mixed, |e| e.part == part && *e.bytes == *b)
                .map(|e| Held {
                    token_count: e.token_count,
                    holders: &e.holders,
                }),
        }
    }

    fn holders_mut(
        &mut self,
        part: PartitionId,
        hash: HashRef<'_>,
        mixed: u64,
    ) -> Option<(&mut u32, &mut Box<[Holder]>)> {
        match hash {
            HashRef::Narrow(h) => self
                .narrow
                .find_mut(mixed, |e| e.hash == h && e.part == part)
                .map(|e| (&mut e.token_count, &mut e.holders)),
            HashRef::Wide(b) => self
                .wide
                .find_mut(mixed, |e| e.part == part && *e.bytes == *b)
                .map(|e| (&mut e.token_count, &mut e.holders)),
        }
    }

    /// Inserts or refreshes `replica`'s hold on a key (tier: last write wins).
    pub fn upsert(
        &mut self,
        part: PartitionId,
        hash: HashRef<'_>,
        mixed: u64,
        token_count: u32,
        holder: Holder,
        admit: Admit,
    ) -> Upserted {
        if let Some((count, holders)) = self.holders_mut(part, hash, mixed) {
            *count = token_count;
            let replica = holder.replica;
            let at = holders.binary_search_by_key(&replica, |h| h.replica);
            let at = match at {
                Ok(i) => {
                    holders[i].last_seen = holder.last_seen;
                    holders[i].tier = holder.tier;
                    return Upserted::default();
                }
                Err(i) => i,
            };
            if !admit.new_entries {
                return Upserted {
                    refused: true,
                    ..Upserted::default()
                };
            }
            let mut grown = Vec::with_capacity(holders.len() + 1);
            grown.extend_from_slice(&holders[..at]);
            grown.push(holder);
            grown.extend_from_slice(&holders[at..]);
            let mut displaced = None;
            if grown.len() > admit.max_holders.max(1) {
                // The stalest other holder makes room (ties: lowest replica id).
                let victim = grown
                    .iter()
                    .enumerate()
                    .filter(|(_, h)| h.replica != holder.replica)
                    .min_by_key(|(_, h)| h.last_seen)
                    .map(|(i, h)| (i, h.replica));
                if let Some((i, replica)) = victim {
                    grown.remove(i);
                    displaced = Some(replica);
                }
            }
            *holders = grown.into_boxed_slice();
            return Upserted {
                new_key: false,
                new_entry: true,
                refused: false,
                displaced,
            };
        }
        if !admit.new_entries {
            return Upserted {
                refused: true,
                ..Upserted::default()
            };
        }
        let holders: Box<[Holder]> = Box::new([holder]);
        match hash {
            HashRef::Narrow(h) => {
                self.narrow.insert_unique(
                    mixed,
                    NarrowEntry {
                        hash: h,
                        holders,
                        part,
                        token_count,
                    },
                );
            }
            HashRef::Wide(b) => {
                self.wide.insert_unique(
                    mixed,
                    WideEntry {
                        bytes: b.into(),
                        holders,
                        part,
                        token_count,
                    },
                );
            }
        }
        Upserted {
            new_key: true,
            new_entry: true,
            refused: false,
            displaced: None,
        }
    }

    /// Removes `replica` from a key; returns (entry removed, key removed).
    pub fn remove(
        &mut self,
        part: PartitionId,
        hash: HashRef<'_>,
        mixed: u64,
        replica: ReplicaId,
    ) -> (bool, bool) {
        let Some((_, holders)) = self.holders_mut(part, hash, mixed) else {
            return (false, false);
        };
        if !holders.iter().any(|h| h.replica == replica) {
            return (false, false);
        }
        if holders.len() > 1 {
            let kept: Vec<Holder> = holders
                .iter()
                .copied()
                .filter(|h| h.replica != replica)
                .collect();
            *holders = kept.into_boxed_slice();
            return (true, false);
        }
        match hash {
            HashRef::Narrow(h) => {
                self.narrow.remove(mixed, |e| e.hash == h && e.part == part);
            }
            HashRef::Wide(b) => {
                self.wide
                    .remove(mixed, |e| e.part == part && *e.bytes == *b);
            }
        }
        (true, true)
    }

    /// Adds one to `replica`'s access counter on a key (saturating).
    pub fn credit(&mut self, part: PartitionId, hash: HashRef<'_>, mixed: u64, replica: ReplicaId) {
        if let Some((_, holders)) = self.holders_mut(part, hash, mixed)
            && let Some(h) = holders.iter_mut().find(|h| h.replica == replica)
        {
            h.access = h.access.saturating_add(1);
        }
    }

    /// Visits every holder; `keep` returns false to drop it. `removed(part, Some(replica))`
    /// is told about every dropped holder and `removed(part, None)` about every dropped key.
    pub fn retain(
        &mut self,
        mut keep: impl FnMut(PartitionId, &Holder) -> bool,
        mut removed: impl FnMut(PartitionId, Option<ReplicaId>),
    ) {
        let mut filter = |part: PartitionId, holders: &mut Box<[Holder]>| -> bool {
            if holders.iter().all(|h| keep(part, h)) {
                return true;
            }
            let kept: Vec<Holder> = holders.iter().copied().filter(|h| keep(part, h)).collect();
            let gone = kept.is_empty();
            for h in holders
                .iter()
                .filter(|h| !kept.iter().any(|k| k.replica == h.replica))
            {
                removed(part, Some(h.replica));
            }
            *holders = kept.into_boxed_slice();
            !gone
        };
        let mut emptied = Vec::new();
        self.narrow.retain(|e| {
            let alive = filter(e.part, &mut e.holders);
            if !alive {
                emptied.push(e.part);
            }
            alive
        });
        self.wide.retain(|e| {
            let alive = filter(e.part, &mut e.holders);
            if !alive {
                emptied.push(e.part);
            }
            alive
        });
        for part in emptied {
            removed(part, None);
        }
    }

    /// Visits every (partition, key id, holder) for victim selection.
    pub fn for_each(&self, mut visit: impl FnMut(PartitionId, KeyId, &Holder)) {
        for e in self.narrow.iter() {
            for h in e.holders.iter() {
                visit(e.part, KeyId::Narrow(e.hash), h);
            }
        }
        for e in self.wide.iter() {
            for h in e.holders.iter() {
                visit(e.part, KeyId::Wide(e.bytes.clone()), h);
            }
        }
    }
}

/// An owned key, for deferred removal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum KeyId {
    Narrow(u64),
    Wide(Box<[u8]>),
}

impl KeyId {
    pub fn as_ref(&self) -> HashRef<'_> {
        match self {
            Self::Narrow(h) => HashRef::Narrow(*h),
            Self::Wide(b) => HashRef::Wide(b),
        }
    }
}

/// All shards.
#[derive(Debug)]
pub(crate) struct Store {
    shards: Box<[RwLock<Shard>]>,
}

impl Default for Store {
    fn default() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| RwLock::new(Shard::default())).collect(),
        }
    }
}

/// Where a key lives: its shard and its in-table hash.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Slot {
    pub shard: usize,
    pub mixed: u64,
}

impl Store {
    pub fn slot(part: PartitionId, hash: HashRef<'_>) -> Slot {
        let mixed = hash.mixed(part);
        let shard = (mixed.wrapping_mul(0xD6E8_FEB8_6659_FD93) >> 58) as usize & (SHARDS - 1);
        Slot { shard, mixed }
    }

    pub fn shard(&self, index: usize) -> &RwLock<Shard> {
        &self.shards[index]
    }

    pub fn shards(&self) -> &[RwLock<Shard>] {
        &self.shards
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_compact() {
        assert_eq!(std::mem::size_of::<Holder>(), 11);
        assert_eq!(std::mem::size_of::<NarrowEntry>(), 32);
        assert_eq!(std::mem::size_of::<Option<NarrowEntry>>(), 32);
    }

    const OPEN: Admit = Admit {
        new_entries: true,
        max_holders: usize::MAX,
    };

    #[test]
    fn upsert_refresh_and_remove() {
        let mut shard = Shard::default();
        let h = HashRef::Narrow(42);
        let s = Store::slot(1, h);
        let holder = |replica, last_seen, tier| Holder {
            replica,
            last_seen,
            tier,
            access: 0,
        };
        assert_eq!(
            shard.upsert(1, h, s.mixed, 16, holder(0, 10, 1), OPEN),
            Upserted {
                new_key: true,
                new_entry: true,
                ..Upserted::default()
            }
        );
        assert_eq!(
            shard.upsert(1, h, s.mixed, 16, holder(1, 11, 1), OPEN),
            Upserted {
                new_key: false,
                new_entry: true,
                ..Upserted::default()
            }
        );
        assert_eq!(
            shard.upsert(1, h, s.mixed, 16, holder(0, 12, 2), OPEN),
            Upserted::default()
        );
        let held = shard.get(1, h, s.mixed).expect("present");
        assert_eq!(held.holders.len(), 2);
        let first = held.holders[0];
        assert_eq!({ first.last_seen }, 12);
        assert_eq!({ first.tier }, 2);
        assert!(shard.get(2, h, Store::slot(2, h).mixed).is_none());
        assert_eq!(shard.remove(1, h, s.mixed, 0), (true, false));
        assert_eq!(shard.remove(1, h, s.mixed, 0), (false, false));
        assert_eq!(shard.remove(1, h, s.mixed, 1), (true, true));
        assert!(shard.get(1, h, s.mixed).is_none());
    }

    #[test]
    fn holders_stay_sorted_capped_and_refusable() {
        let mut shard = Shard::default();
        let h = HashRef::Narrow(7);
        let s = Store::slot(0, h);
        let admit = Admit {
            new_entries: true,
            max_holders: 3,
        };
        let hold = |replica, last_seen| Holder {
            replica,
            last_seen,
            tier: 1,
            access: 0,
        };
        for (r, seen) in [(5, 10), (2, 11), (9, 12)] {
            assert!(
                shard
                    .upsert(0, h, s.mixed, 16, hold(r, seen), admit)
                    .new_entry
            );
        }
        let order = |shard: &Shard| -> Vec<u32> {
            shard
                .get(0, h, s.mixed)
                .map(|held| held.holders.iter().map(|x| x.replica).collect())
                .unwrap_or_default()
        };
        assert_eq!(order(&shard), vec![2, 5, 9]);
        // A fourth holder displaces the stalest (replica 5, seen at 10).
        let up = shard.upsert(0, h, s.mixed, 16, hold(1, 13), admit);
        assert_eq!((up.new_entry, up.displaced), (true, Some(5)));
        assert_eq!(order(&shard), vec![1, 2, 9]);
        // At the entry cap a new holder is refused, a refresh is not.
        let closed = Admit {
            new_entries: false,
            ..admit
        };
        assert!(shard.upsert(0, h, s.mixed, 16, hold(4, 14), closed).refused);
        assert_eq!(
            shard.upsert(0, h, s.mixed, 16, hold(9, 14), closed),
            Upserted::default()
        );
        let other = HashRef::Narrow(8);
        let up = shard.upsert(
            0,
            other,
            Store::slot(0, other).mixed,
            16,
            hold(4, 14),
            closed,
        );
        assert!(up.refused && !up.new_key);
        assert_eq!(order(&shard), vec![1, 2, 9]);
    }

    #[test]
    fn wide_keys_work() {
        let mut shard = Shard::default();
        let bytes = [7u8; 16];
        let h = HashRef::from_bytes(&bytes);
        assert!(matches!(h, HashRef::Wide(_)));
        let s = Store::slot(0, h);
        shard.upsert(
            0,
            h,
            s.mixed,
            32,
            Holder {
                replica: 3,
                last_seen: 1,
                tier: 1,
                access: 0,
            },
            OPEN,
        );
        assert_eq!(shard.get(0, h, s.mixed).map(|x| x.token_count), Some(32));
        assert_eq!(HashRef::from_bytes(&5u64.to_be_bytes()), HashRef::Narrow(5));
    }
}
