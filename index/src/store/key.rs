//! Keys: how the store names a block.
//!
//! A block is a `(partition, hash)` pair. An 8-byte hash is its own 64-bit
//! *word* (what a run stores and compares); a hash of any other width is
//! kept through a 64-bit digest and compared in full after the digest
//! matches. The key-table probe mixes the word with the partition, so the
//! same hash under two adapters never shares a slot. A location packs a run
//! id and a position as `run << 6 | position`. [`Blocks`] is a report as
//! ingest reads it, with a fast path for the common chain of 8-byte hashes
//! ([`NarrowChain`]): its words are compared with a run's side by side.

use std::sync::atomic::Ordering;

use super::POS_BITS;
use super::body::Body;
use crate::catalog::PartitionId;
use crate::table::Probe;

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

    /// The 64-bit word a run stores: the hash itself, or a digest of a wide one.
    pub fn word(self) -> u64 {
        match self {
            Self::Narrow(h) => h,
            Self::Wide(bytes) => {
                let mut acc = 0xcbf2_9ce4_8422_2325u64 ^ bytes.len() as u64;
                for chunk in bytes.chunks(8) {
                    let mut word = [0u8; 8];
                    word[..chunk.len()].copy_from_slice(chunk);
                    acc = mix(acc ^ u64::from_le_bytes(word), 0);
                }
                acc
            }
        }
    }

    pub fn is_wide(self) -> bool {
        matches!(self, Self::Wide(_))
    }
}

/// A key resolved for the store: its word and table probe.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Key<'a> {
    pub hash: HashRef<'a>,
    pub word: u64,
    pub(super) probe: Probe,
}

impl<'a> Key<'a> {
    pub fn new(part: PartitionId, hash: HashRef<'a>) -> Self {
        let word = hash.word();
        Self {
            hash,
            word,
            probe: Probe::of(mix(word, part)),
        }
    }

    pub fn of_bytes(part: PartitionId, bytes: &'a [u8]) -> Self {
        Self::new(part, HashRef::from_bytes(bytes))
    }
}

/// The blocks of one report, in order, as [`Writing::hold`](super::Writing::hold) reads them:
/// each block's hash and token count, its key built only where it is
/// needed (a block found at the next position of a run needs its word
/// alone, not its table probe).
pub(crate) trait Blocks {
    /// Number of blocks.
    fn len(&self) -> usize;
    /// Block `i`'s hash.
    fn hash(&self, i: usize) -> HashRef<'_>;
    /// Block `i`'s token count.
    fn count(&self, i: usize) -> u32;
    /// Block `i`'s word (what a run stores).
    fn word(&self, i: usize) -> u64 {
        self.hash(i).word()
    }
    /// Block `i`'s key in `part`.
    fn key(&self, part: PartitionId, i: usize) -> Key<'_> {
        Key::new(part, self.hash(i))
    }

    /// How many blocks from `i` on `body` holds one after the other at its
    /// positions from `pos` on, below `len`.
    fn held_from(&self, i: usize, body: &Body, pos: usize, len: usize) -> usize {
        (i..self.len())
            .zip(pos..len)
            .take_while(|&(i, p)| {
                let hash = self.hash(i);
                body.holds(p, hash, hash.word())
            })
            .count()
    }
}

/// Keys resolved up front (any width), with their token counts.
impl Blocks for [(Key<'_>, u32)] {
    fn len(&self) -> usize {
        <[_]>::len(self)
    }

    fn hash(&self, i: usize) -> HashRef<'_> {
        self[i].0.hash
    }

    fn count(&self, i: usize) -> u32 {
        self[i].1
    }

    fn word(&self, i: usize) -> u64 {
        self[i].0.word
    }

    fn key(&self, _: PartitionId, i: usize) -> Key<'_> {
        self[i].0
    }
}

/// A chain of 8-byte hashes (big-endian, as on the wire) and its token
/// counts: a block's word is its hash, so a key costs one mix.
pub(crate) struct NarrowChain<'a> {
    pub hashes: &'a [[u8; 8]],
    pub counts: &'a [u32],
}

impl Blocks for NarrowChain<'_> {
    fn len(&self) -> usize {
        self.counts.len().min(self.hashes.len())
    }

    fn hash(&self, i: usize) -> HashRef<'_> {
        HashRef::Narrow(u64::from_be_bytes(self.hashes[i]))
    }

    fn count(&self, i: usize) -> u32 {
        self.counts[i]
    }

    /// The chain's words against the run's, side by side.
    fn held_from(&self, i: usize, body: &Body, pos: usize, len: usize) -> usize {
        if body.is_wide() || pos >= len {
            return 0;
        }
        let stored = body.data.hashes(pos, len);
        let asked = self.hashes.get(i..).unwrap_or_default();
        stored
            .iter()
            .zip(asked)
            .take_while(|(s, w)| s.load(Ordering::Relaxed) == u64::from_be_bytes(**w))
            .count()
    }
}

pub(super) fn mix(hash: u64, part: PartitionId) -> u64 {
    let x = hash ^ u64::from(part).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let m = u128::from(x) * 0xA076_1D64_78BD_642F;
    (m as u64) ^ ((m >> 64) as u64)
}

pub(super) fn loc(run: u32, pos: usize) -> u32 {
    (run << POS_BITS) | pos as u32
}

pub(super) fn split(loc: u32) -> (u32, usize) {
    (loc >> POS_BITS, (loc & ((1 << POS_BITS) - 1)) as usize)
}
