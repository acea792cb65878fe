//! An open-addressing hash table (Robin Hood linear probing, backward-shift
//! deletion) whose probe for a hash starts at a slot the caller can compute.
//!
//! That is what the chain lookup needs and a general-purpose map does not
//! offer: before probing a window of blocks it touches each block's home slot
//! ([`ProbeTable::touch`]), a few independent loads that the CPU overlaps, so
//! the window's cache and TLB misses are paid together instead of one after
//! another. Slots are 32-byte aligned so an entry of up to 32 bytes never
//! straddles two cache lines. Robin Hood ordering keeps probe runs short at a
//! 7/8 load factor and lets a miss stop early.

use std::hint::black_box;

/// An entry that can recompute the hash it was inserted under.
pub(crate) trait Rehash {
    fn rehash(&self) -> u64;
}

/// One slot, aligned so that a 32-byte entry sits in one cache line.
#[derive(Debug)]
#[repr(align(32))]
struct Slot<E>(Option<E>);

/// Smallest non-empty table.
const MIN_SLOTS: usize = 16;

fn home(hash: u64, mask: usize) -> usize {
    // Fold the high half in: upstream, shard selection consumes other bits.
    ((hash >> 32) ^ hash) as usize & mask
}

fn distance(hash: u64, at: usize, mask: usize) -> usize {
    at.wrapping_sub(home(hash, mask)) & mask
}

/// The table.
#[derive(Debug)]
pub(crate) struct ProbeTable<E> {
    slots: Box<[Slot<E>]>,
    len: usize,
}

impl<E> Default for ProbeTable<E> {
    fn default() -> Self {
        Self {
            slots: Box::new([]),
            len: 0,
        }
    }
}

impl<E: Rehash> ProbeTable<E> {
    fn mask(&self) -> usize {
        self.slots.len().wrapping_sub(1)
    }

    fn home(&self, hash: u64) -> usize {
        home(hash, self.mask())
    }

    fn distance(&self, hash: u64, at: usize) -> usize {
        distance(hash, at, self.mask())
    }

    /// Loads the first word of `hash`'s home slot so a later probe finds it
    /// in cache; returns a value to fold into [`black_box`].
    pub fn touch(&self, hash: u64) -> usize {
        if self.slots.is_empty() {
            return 0;
        }
        usize::from(self.slots[self.home(hash)].0.is_some())
    }

    fn position(&self, hash: u64, mut eq: impl FnMut(&E) -> bool) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        let mask = self.mask();
        let mut at = self.home(hash);
        let mut probed = 0;
        loop {
            let entry = self.slots[at].0.as_ref()?;
            let theirs = entry.rehash();
            if theirs == hash && eq(entry) {
                return Some(at);
            }
            if self.distance(theirs, at) < probed {
                return None;
            }
            at = (at + 1) & mask;
            probed += 1;
        }
    }

    /// The entry under `hash` for which `eq` holds.
    pub fn find(&self, hash: u64, eq: impl FnMut(&E) -> bool) -> Option<&E> {
        let at = self.position(hash, eq)?;
        self.slots[at].0.as_ref()
    }

    /// Mutable [`ProbeTable::find`].
    pub fn find_mut(&mut self, hash: u64, eq: impl FnMut(&E) -> bool) -> Option<&mut E> {
        let at = self.position(hash, eq)?;
        self.slots[at].0.as_mut()
    }

    /// Inserts an entry known not to be present.
    pub fn insert_unique(&mut self, hash: u64, entry: E) {
        if (self.len + 1) * 8 > self.slots.len() * 7 {
            self.grow();
        }
        self.place(hash, entry);
        self.len += 1;
    }

    fn place(&mut self, mut hash: u64, mut entry: E) {
        let mask = self.mask();
        let mut at = self.home(hash);
        let mut probed = 0;
        loop {
            let ours = distance(hash, at, mask);
            debug_assert_eq!(ours, probed);
            match &mut self.slots[at].0 {
                slot @ None => {
                    *slot = Some(entry);
                    return;
                }
                Some(resident) => {
                    let theirs_hash = resident.rehash();
                    let theirs = distance(theirs_hash, at, mask);
                    if theirs < ours {
                        // Robin Hood: the richer resident moves on instead.
                        std::mem::swap(resident, &mut entry);
                        hash = theirs_hash;
                        probed = theirs;
                    }
                }
            }
            at = (at + 1) & mask;
            probed += 1;
        }
    }

    fn grow(&mut self) {
        let size = (self.slots.len() * 2).max(MIN_SLOTS);
        let old = std::mem::replace(
            &mut self.slots,
            std::iter::repeat_with(|| Slot(None)).take(size).collect(),
        );
        for entry in old.into_vec().into_iter().filter_map(|slot| slot.0) {
            self.place(entry.rehash(), entry);
        }
    }

    /// Removes the entry under `hash` for which `eq` holds.
    pub fn remove(&mut self, hash: u64, eq: impl FnMut(&E) -> bool) -> Option<E> {
        let at = self.position(hash, eq)?;
        Some(self.take(at))
    }

    /// Empties slot `at`, shifting the run after it back by one.
    fn take(&mut self, at: usize) -> E {
        let mask = self.mask();
        let Some(removed) = self.slots[at].0.take() else {
            unreachable!("take is only called on an occupied slot");
        };
        self.len -= 1;
        let mut hole = at;
        loop {
            let next = (hole + 1) & mask;
            let displaced = self.slots[next]
                .0
                .as_ref()
                .is_some_and(|e| self.distance(e.rehash(), next) > 0);
            if !displaced {
                return removed;
            }
            self.slots[hole].0 = self.slots[next].0.take();
            hole = next;
        }
    }

    /// Keeps the entries for which `keep` returns true; each entry is visited once.
    pub fn retain(&mut self, mut keep: impl FnMut(&mut E) -> bool) {
        // A slot empty before any removal: no probe run crosses it, so the
        // backward shifts below never need to move an entry across it.
        let Some(empty) = self.slots.iter().position(|slot| slot.0.is_none()) else {
            return;
        };
        let before = self.len;
        for slot in self.slots.iter_mut() {
            if slot.0.as_mut().is_some_and(|entry| !keep(entry)) {
                slot.0 = None;
                self.len -= 1;
            }
        }
        if self.len != before {
            self.settle(empty);
        }
    }

    /// Closes the holes [`ProbeTable::retain`] left: one lap from a slot that
    /// was already empty, moving each displaced entry back over the empty
    /// slots before it (a batched backward shift).
    fn settle(&mut self, empty: usize) {
        let mask = self.mask();
        for step in 1..=self.slots.len() {
            let at = (empty + step) & mask;
            let Some(entry) = self.slots[at].0.as_ref() else {
                continue;
            };
            let mut distance = self.distance(entry.rehash(), at);
            let mut to = at;
            while distance > 0 && self.slots[to.wrapping_sub(1) & mask].0.is_none() {
                to = to.wrapping_sub(1) & mask;
                distance -= 1;
            }
            if to != at {
                self.slots[to].0 = self.slots[at].0.take();
            }
        }
    }

    /// Every entry, in slot order.
    pub fn iter(&self) -> impl Iterator<Item = &E> {
        self.slots.iter().filter_map(|slot| slot.0.as_ref())
    }

    /// Number of entries.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.len
    }
}

/// Folds touch results so the loads that produced them are kept.
pub(crate) fn keep_loads(acc: usize) {
    black_box(acc);
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    #[derive(Debug, Clone, PartialEq)]
    struct E(u64, u32);

    impl Rehash for E {
        fn rehash(&self) -> u64 {
            // Few distinct hashes so runs collide and wrap.
            self.0 % 37
        }
    }

    #[test]
    fn entries_are_one_cache_line() {
        // A boxed field gives `Option` a niche, as the store's entries have.
        type Entry = (u64, Box<[u8]>, u64);
        assert_eq!(std::mem::align_of::<Slot<Entry>>(), 32);
        assert_eq!(std::mem::size_of::<Slot<Entry>>(), 32);
    }

    proptest! {
        #[test]
        fn behaves_like_a_map(ops in prop::collection::vec((0u8..4, 0u64..200, any::<u32>()), 0..400)) {
            let mut table = ProbeTable::<E>::default();
            let mut model: HashMap<u64, u32> = HashMap::new();
            for (op, key, value) in ops {
                let hash = key % 37;
                match op {
                    0 | 1 => {
                        if let Some(e) = table.find_mut(hash, |e| e.0 == key) {
                            e.1 = value;
                        } else {
                            table.insert_unique(hash, E(key, value));
                        }
                        model.insert(key, value);
                    }
                    2 => {
                        prop_assert_eq!(table.remove(hash, |e| e.0 == key).map(|e| e.1), model.remove(&key));
                    }
                    _ => {
                        let mut seen = Vec::new();
                        table.retain(|e| {
                            seen.push(e.0);
                            e.1 % 3 != 0
                        });
                        seen.sort_unstable();
                        let mut expected: Vec<u64> = model.keys().copied().collect();
                        expected.sort_unstable();
                        prop_assert_eq!(seen, expected, "retain visits every entry once");
                        model.retain(|_, v| *v % 3 != 0);
                    }
                }
                prop_assert_eq!(table.len(), model.len());
                for (k, v) in &model {
                    prop_assert_eq!(table.find(k % 37, |e| e.0 == *k).map(|e| e.1), Some(*v));
                }
                prop_assert_eq!(table.iter().count(), model.len());
            }
        }
    }
}
