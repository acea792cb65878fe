//! A hash map in [`PARTS`] parts, for the catalog's maps that a flood of
//! names grows (and a sweep empties) while lookups wait for the lock they
//! sit under.
//!
//! A `hashbrown` map grows by moving every entry to a table twice the size,
//! and gives room back the same way, all in one call: under the catalog's
//! exclusive lock, a growing map of 200,000 partitions held every lookup
//! up for as long as 10 ms. Here a key's part is
//! chosen by its hash, and each part grows, and shrinks as soon as it
//! holds under a quarter of its room, on its own: a write moves at most
//! one part, a sixty-fourth of the entries.
//!
//! A key is hashed once: its part is bits 51–56 of the hash, which a
//! part's table uses neither for the slot (the low bits) nor for the tag
//! it keeps per slot (the top seven). So those bits must not depend on
//! each other: the hash is `foldhash`'s quality variant, whose last step
//! mixes every bit into every other. With the fast variant (the maps'
//! default), in the part of 64 where 1,000 consecutive integer keys fell
//! on fewest of 256 slots, they fell on 235–239, against 242–246 with the
//! quality one (about what independent bits give).

use std::borrow::Borrow;
use std::hash::{BuildHasher, Hash};

use hashbrown::HashTable;

use crate::catalog::shrink_due_from;

/// Parts per map.
pub(crate) const PARTS: usize = 64;

/// A part with room for fewer entries than this keeps it (see
/// [`PartsMap::remove`]): a part holds a sixty-fourth of a map's entries,
/// so it keeps less room than a whole map does.
const SHRINK_FROM: usize = 16;

#[derive(Debug)]
pub(crate) struct PartsMap<K, V> {
    parts: Box<[HashTable<(K, V)>; PARTS]>,
    state: foldhash::quality::RandomState,
    len: usize,
}

impl<K, V> Default for PartsMap<K, V> {
    fn default() -> Self {
        Self {
            parts: Box::new(std::array::from_fn(|_| HashTable::new())),
            state: foldhash::quality::RandomState::default(),
            len: 0,
        }
    }
}

/// A hash's part (see the module notes).
fn part_of(hash: u64) -> usize {
    (hash >> 51) as usize % PARTS
}

impl<K: Hash + Eq, V> PartsMap<K, V> {
    fn hash<Q: Hash + ?Sized>(&self, key: &Q) -> u64 {
        self.state.hash_one(key)
    }

    pub fn get<Q>(&self, key: &Q) -> Option<&V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let hash = self.hash(key);
        self.parts[part_of(hash)]
            .find(hash, |(k, _)| k.borrow() == key)
            .map(|(_, v)| v)
    }

    pub fn insert(&mut self, key: K, value: V) -> Option<V> {
        let hash = self.hash(&key);
        let Self { parts, state, len } = self;
        match parts[part_of(hash)].find_entry(hash, |(k, _)| *k == key) {
            Ok(mut entry) => Some(std::mem::replace(&mut entry.get_mut().1, value)),
            Err(absent) => {
                absent
                    .into_table()
                    .insert_unique(hash, (key, value), |(k, _)| state.hash_one(k));
                *len += 1;
                None
            }
        }
    }

    /// The value under `key`, put there by `make` if there was none.
    pub fn get_or_insert_with(&mut self, key: K, make: impl FnOnce() -> V) -> &mut V {
        let hash = self.hash(&key);
        let Self { parts, state, len } = self;
        match parts[part_of(hash)].find_entry(hash, |(k, _)| *k == key) {
            Ok(entry) => &mut entry.into_mut().1,
            Err(absent) => {
                *len += 1;
                let entry = absent
                    .into_table()
                    .insert_unique(hash, (key, make()), |(k, _)| state.hash_one(k));
                &mut entry.into_mut().1
            }
        }
    }

    /// Removes `key`'s entry; its part gives its room back once it holds
    /// under a quarter of it.
    pub fn remove<Q>(&mut self, key: &Q) -> Option<V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let hash = self.hash(key);
        let Self { parts, state, len } = self;
        let entry = parts[part_of(hash)]
            .find_entry(hash, |(k, _)| k.borrow() == key)
            .ok()?;
        let ((_, value), vacant) = entry.remove();
        *len -= 1;
        let table = vacant.into_table();
        if shrink_due_from(table.len(), table.capacity(), SHRINK_FROM) {
            table.shrink_to_fit(|(k, _)| state.hash_one(k));
        }
        Some(value)
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Entries the parts have room for.
    #[cfg(test)]
    pub fn capacity(&self) -> usize {
        self.parts.iter().map(HashTable::capacity).sum()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.parts
            .iter()
            .flat_map(|t| t.iter().map(|(k, v)| (k, v)))
    }

    pub fn keys(&self) -> impl Iterator<Item = &K> {
        self.iter().map(|(k, _)| k)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_parts_map_keeps_what_a_map_keeps_and_gives_room_back_a_part_at_a_time() {
        let mut map: PartsMap<String, u32> = PartsMap::default();
        let mut model: std::collections::HashMap<String, u32> = Default::default();
        for i in 0..20_000u32 {
            let k = format!("name-{i}");
            assert_eq!(map.insert(k.clone(), i), model.insert(k, i));
        }
        assert_eq!(map.insert("name-7".into(), 70), Some(7));
        model.insert("name-7".into(), 70);
        *map.get_or_insert_with("name-8".into(), || 0) += 1;
        *model.entry("name-8".into()).or_insert(0) += 1;
        assert_eq!(*map.get_or_insert_with("new".into(), || 5), 5);
        model.insert("new".into(), 5);
        assert_eq!(map.len(), model.len());
        let mut seen: Vec<(String, u32)> = map.iter().map(|(k, &v)| (k.clone(), v)).collect();
        let mut expected: Vec<(String, u32)> = model.clone().into_iter().collect();
        seen.sort();
        expected.sort();
        assert_eq!(seen, expected);
        // Every part holds some: the keys spread.
        assert!(map.parts.iter().all(|p| p.len() > 100));
        let peak = map.capacity();
        for i in 0..19_900u32 {
            let k = format!("name-{i}");
            assert_eq!(map.remove(k.as_str()), model.remove(&k));
        }
        assert_eq!(map.remove("absent"), None);
        assert_eq!(map.len(), model.len());
        for (k, v) in &model {
            assert_eq!(map.get(k.as_str()), Some(v));
        }
        // The room went back as the parts emptied, with no call to shrink.
        assert!(
            map.capacity() * 8 < peak,
            "room {} of {peak} at the peak",
            map.capacity()
        );
    }

    #[test]
    fn integer_keys_spread_over_the_parts_and_within_them() {
        let mut map: PartsMap<u32, ()> = PartsMap::default();
        for i in 0..64_000u32 {
            map.insert(i, ());
        }
        // About 1,000 a part.
        assert!(map.parts.iter().all(|p| (800..1200).contains(&p.len())));
        // Within a part the keys' hashes still differ in the bits its table
        // uses: the low ones pick a slot, the top seven are its tag (about
        // 250 of 256 slots for 1,000 keys; a part picked by low bits would
        // leave its keys four).
        for part in map.parts.iter() {
            let hashes: Vec<u64> = part.iter().map(|(k, _)| map.hash(k)).collect();
            let slots: std::collections::HashSet<u64> = hashes.iter().map(|h| h & 255).collect();
            let tags: std::collections::HashSet<u64> = hashes.iter().map(|h| h >> 57).collect();
            assert!(slots.len() > 200, "{} of 256 slots", slots.len());
            assert!(tags.len() > 100, "{} of 128 tags", tags.len());
        }
        for i in 0..60_000u32 {
            assert_eq!(map.remove(&i), Some(()));
        }
        assert!((60_000..64_000u32).all(|i| map.get(&i).is_some()));
        assert_eq!(map.len(), 4_000);
    }
}
