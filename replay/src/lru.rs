//! A fixed-capacity LRU set of block hashes: one replica's KV-cache prefix blocks.
//!
//! Shape: a hash map from block hash to a slot in a node arena, and an
//! intrusive doubly linked list through the arena from most to least recently
//! used. `touch`, `insert` and eviction are O(1); no allocation once the arena
//! has reached capacity. Single-threaded: each simulated replica owns one.
//!
//! Admission follows vLLM's prefix cache ([`BlockLru::admit`]): the blocks a
//! request hits are in use while it runs, so they are never the victims of
//! its own new blocks; when it finishes its blocks are freed from the last to
//! the first, so the head of a prompt is the most recently used of its blocks
//! and the tail is evicted first (a head evicted before its tail would leave
//! the tail unreachable, since a hit is a leading run).

use hashbrown::HashMap;

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Node {
    hash: u64,
    prev: u32,
    next: u32,
}

/// LRU set of at most `capacity` block hashes.
#[derive(Debug, Clone)]
pub struct BlockLru {
    capacity: usize,
    slots: HashMap<u64, u32>,
    nodes: Vec<Node>,
    free: Vec<u32>,
    /// Most recently used.
    head: u32,
    /// Least recently used.
    tail: u32,
    /// Scratch: each block of the prompt being admitted, and whether it was held before.
    prompt: HashMap<u64, bool>,
}

impl BlockLru {
    /// An empty cache holding at most `capacity` blocks.
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            slots: HashMap::with_capacity(capacity.min(1 << 20)),
            nodes: Vec::new(),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
            prompt: HashMap::new(),
        }
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// True when nothing is held.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// The held blocks, most recently used first.
    pub fn blocks(&self) -> impl Iterator<Item = u64> + '_ {
        let mut at = self.head;
        std::iter::from_fn(move || {
            let node = self.nodes.get(at as usize)?;
            at = node.next;
            Some(node.hash)
        })
    }

    /// Whether `hash` is held.
    pub fn contains(&self, hash: u64) -> bool {
        self.slots.contains_key(&hash)
    }

    /// How many leading blocks of `blocks` are held.
    pub fn leading_hits(&self, blocks: &[u64]) -> usize {
        blocks.iter().take_while(|h| self.contains(**h)).count()
    }

    /// Serves a prompt, as an engine's prefix cache does: counts its leading
    /// hits and pins them (most recently used), stores the blocks it lacks in
    /// prompt order (evicting the least recently used), then refreshes the
    /// whole prompt from its last block to its first, so its head ends most
    /// recently used. Appends the net changes: `stored` gets the prompt's
    /// blocks held now and not before this call (prompt order), `evicted` the
    /// blocks held before and not now (any order) — disjoint, so they can be
    /// reported in either order.
    pub fn admit(
        &mut self,
        blocks: &[u64],
        stored: &mut Vec<u64>,
        evicted: &mut Vec<u64>,
    ) -> usize {
        let hits = self.leading_hits(blocks);
        let (first_stored, first_evicted) = (stored.len(), evicted.len());
        self.prompt.clear();
        for &hash in blocks {
            let held = self.contains(hash);
            self.prompt.insert(hash, held);
        }
        for &hash in &blocks[..hits] {
            self.touch(hash);
        }
        for &hash in &blocks[hits..] {
            if !self.touch(hash) && self.insert(hash, evicted) {
                stored.push(hash);
            }
        }
        for &hash in blocks.iter().rev() {
            self.touch(hash);
        }
        // Net effect against what was held before the call.
        let mut i = first_stored;
        while i < stored.len() {
            if self.contains(stored[i]) && self.prompt.get(&stored[i]) == Some(&false) {
                i += 1;
            } else {
                stored.remove(i);
            }
        }
        let mut dropped: Vec<u64> = evicted.drain(first_evicted..).collect();
        dropped.retain(|h| {
            // Only the prompt's own blocks can have been stored by this call.
            !self.contains(*h) && self.prompt.get(h).copied().unwrap_or(true)
        });
        dropped.sort_unstable();
        dropped.dedup();
        evicted.extend(dropped);
        hits
    }

    /// Marks `hash` most recently used; false when it is not held.
    pub fn touch(&mut self, hash: u64) -> bool {
        let Some(&slot) = self.slots.get(&hash) else {
            return false;
        };
        self.unlink(slot);
        self.push_front(slot);
        true
    }

    /// Inserts `hash` as most recently used, evicting the least recently used
    /// block when full (appended to `evicted`). False when the capacity is zero.
    pub fn insert(&mut self, hash: u64, evicted: &mut Vec<u64>) -> bool {
        if self.capacity == 0 {
            return false;
        }
        if self.touch(hash) {
            return true;
        }
        if self.slots.len() >= self.capacity {
            let victim = self.tail;
            self.unlink(victim);
            let old = self.nodes[victim as usize].hash;
            self.slots.remove(&old);
            self.free.push(victim);
            evicted.push(old);
        }
        let slot = match self.free.pop() {
            Some(slot) => {
                self.nodes[slot as usize].hash = hash;
                slot
            }
            None => {
                self.nodes.push(Node {
                    hash,
                    prev: NIL,
                    next: NIL,
                });
                (self.nodes.len() - 1) as u32
            }
        };
        self.slots.insert(hash, slot);
        self.push_front(slot);
        true
    }

    fn unlink(&mut self, slot: u32) {
        let Node { prev, next, .. } = self.nodes[slot as usize];
        if prev == NIL {
            self.head = next;
        } else {
            self.nodes[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.nodes[next as usize].prev = prev;
        }
    }

    fn push_front(&mut self, slot: u32) {
        let old_head = self.head;
        {
            let node = &mut self.nodes[slot as usize];
            node.prev = NIL;
            node.next = old_head;
        }
        if old_head == NIL {
            self.tail = slot;
        } else {
            self.nodes[old_head as usize].prev = slot;
        }
        self.head = slot;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_least_recently_used() {
        let mut lru = BlockLru::new(2);
        let mut evicted = Vec::new();
        assert!(lru.insert(1, &mut evicted));
        assert!(lru.insert(2, &mut evicted));
        assert!(lru.touch(1));
        assert!(lru.insert(3, &mut evicted));
        assert_eq!(evicted, [2]);
        assert!(lru.contains(1) && lru.contains(3) && !lru.contains(2));
        assert_eq!(lru.len(), 2);
    }

    #[test]
    fn admit_counts_leading_hits_and_evicts_tails_first() {
        let mut lru = BlockLru::new(4);
        let (mut stored, mut evicted) = (Vec::new(), Vec::new());
        assert_eq!(lru.admit(&[1, 2, 3], &mut stored, &mut evicted), 0);
        assert_eq!(stored, [1, 2, 3]);
        stored.clear();
        // 1 and 2 are held, 9 is not, so 3 does not count.
        assert_eq!(lru.admit(&[1, 2, 9, 3], &mut stored, &mut evicted), 2);
        assert_eq!(stored, [9]);
        assert!(evicted.is_empty());
        stored.clear();
        // Full: the new head 5 evicts the least recent block, the old tail 3.
        assert_eq!(lru.admit(&[5], &mut stored, &mut evicted), 0);
        assert_eq!(evicted, [3]);
        assert_eq!(lru.leading_hits(&[1, 2, 9]), 3);
    }

    #[test]
    fn admit_never_evicts_its_own_hits() {
        let mut lru = BlockLru::new(4);
        let (mut stored, mut evicted) = (Vec::new(), Vec::new());
        lru.admit(&[1, 2], &mut stored, &mut evicted);
        lru.admit(&[7, 8], &mut stored, &mut evicted);
        // 1, 2 are the least recently used; a request hitting them and adding
        // two blocks evicts 7 and 8 instead.
        stored.clear();
        assert_eq!(lru.admit(&[1, 2, 3, 4], &mut stored, &mut evicted), 2);
        assert_eq!(stored, [3, 4]);
        evicted.sort_unstable();
        assert_eq!(evicted, [7, 8]);
    }

    #[test]
    fn admit_reports_net_changes_for_prompts_larger_than_the_cache() {
        let mut lru = BlockLru::new(3);
        let (mut stored, mut evicted) = (Vec::new(), Vec::new());
        lru.admit(&[9], &mut stored, &mut evicted);
        stored.clear();
        assert_eq!(lru.admit(&[1, 2, 3, 4, 5], &mut stored, &mut evicted), 0);
        // Only the last three fit; 1 and 2 were stored and evicted again.
        assert_eq!(stored, [3, 4, 5]);
        assert_eq!(evicted, [9]);
        for h in &stored {
            assert!(lru.contains(*h));
        }
    }

    #[test]
    fn zero_capacity_holds_nothing() {
        let mut lru = BlockLru::new(0);
        let (mut stored, mut evicted) = (Vec::new(), Vec::new());
        assert_eq!(lru.admit(&[1, 2], &mut stored, &mut evicted), 0);
        assert!(lru.is_empty() && stored.is_empty() && evicted.is_empty());
    }

    #[test]
    fn matches_a_naive_model() {
        let mut lru = BlockLru::new(5);
        let mut model: Vec<u64> = Vec::new(); // most recent last
        let mut evicted = Vec::new();
        let mut state = 7u64;
        for _ in 0..5000 {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let hash = (state >> 33) % 12;
            evicted.clear();
            if state & 1 == 0 {
                let held = lru.touch(hash);
                assert_eq!(held, model.contains(&hash));
                if let Some(i) = model.iter().position(|h| *h == hash) {
                    let h = model.remove(i);
                    model.push(h);
                }
            } else {
                lru.insert(hash, &mut evicted);
                if let Some(i) = model.iter().position(|h| *h == hash) {
                    model.remove(i);
                } else if model.len() == 5 {
                    assert_eq!(evicted, [model.remove(0)]);
                }
                model.push(hash);
            }
            assert_eq!(lru.len(), model.len());
            for h in &model {
                assert!(lru.contains(*h));
            }
        }
    }
}
