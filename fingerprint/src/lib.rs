//! Content fingerprint of token blocks — the routing key every component agrees on.
//!
//! A prompt's tokens are cut into full blocks of `block_size` tokens (a partial
//! trailing block is dropped: engines cache only full blocks). Each block gets a
//! *content hash* — XXH3-64 with seed [`SEED`] over the little-endian `u32`
//! encoding of its token ids — and a *prefix hash* that chains every earlier
//! block in:
//!
//! ```text
//! prefix[0] = content[0]                                  (fresh sequence)
//! prefix[0] = XXH3(le8(parent) ++ le8(content[0]))        (explicit parent)
//! prefix[i] = XXH3(le8(prefix[i-1]) ++ le8(content[i]))
//! ```
//!
//! so block `i`'s prefix hash identifies the whole prefix `0..=i`. On the wire a
//! prefix hash is the 8-byte **big-endian** form of the `u64` ([`encode`] /
//! [`decode`]).
//!
//! This crate is the only place the construction is written down; the server,
//! the KV-event subscriber and the proxy-wasm filter all call it. It is `no_std`
//! (plus `alloc`) so it builds for `wasm32-wasip1`.
//!
//! ```
//! use inference_cache_fingerprint::{prefix_hashes, request_chain};
//!
//! let tokens: Vec<u32> = (1..=16).collect();
//! assert_eq!(prefix_hashes(&tokens, 16), vec![16863443419780771464]);
//!
//! let chain = request_chain(&(0..40).collect::<Vec<u32>>(), 16);
//! assert_eq!(chain.block_token_counts, vec![16, 16]); // the 8-token tail is dropped
//! ```
#![no_std]

extern crate alloc;

use alloc::borrow::Cow;
use alloc::string::String;
use alloc::vec::Vec;
use xxhash_rust::xxh3::{Xxh3, xxh3_64_with_seed};

/// Seed of every XXH3-64 call in the construction.
pub const SEED: u64 = 1337;

/// Length in bytes of a prefix hash on the wire.
pub const WIRE_LEN: usize = 8;

/// Tokens per KV block unless configured (vLLM's default): the default of
/// `inference-cache serve --engine-block-size` and of `inference-cache
/// subscribe --block-size`, which must agree.
pub const DEFAULT_BLOCK_SIZE: u32 = 16;

/// Blocks of up to this many tokens are hashed from a stack buffer in one shot.
const STACK_TOKENS: usize = 128;

/// Content hash of one block: XXH3-64(seed 1337) over the little-endian `u32`
/// encoding of its token ids.
pub fn content_hash(tokens: &[u32]) -> u64 {
    if tokens.len() <= STACK_TOKENS {
        let mut buf = [0u8; STACK_TOKENS * 4];
        for (slot, token) in buf.chunks_exact_mut(4).zip(tokens) {
            slot.copy_from_slice(&token.to_le_bytes());
        }
        xxh3_64_with_seed(&buf[..tokens.len() * 4], SEED)
    } else {
        let mut hasher = Xxh3::with_seed(SEED);
        for token in tokens {
            hasher.update(&token.to_le_bytes());
        }
        hasher.digest()
    }
}

/// Chains a block's content hash onto the prefix hash before it:
/// XXH3-64(seed 1337) over `le8(parent) ++ le8(content)`.
pub fn chain_hash(parent: u64, content: u64) -> u64 {
    let mut buf = [0u8; 16];
    buf[..8].copy_from_slice(&parent.to_le_bytes());
    buf[8..].copy_from_slice(&content.to_le_bytes());
    xxh3_64_with_seed(&buf, SEED)
}

/// Prefix hashes of every full block of `tokens`, starting a fresh sequence.
///
/// Returns an empty vector when `block_size` is 0 or there is no full block.
pub fn prefix_hashes(tokens: &[u32], block_size: usize) -> Vec<u64> {
    prefix_hashes_from(None, tokens, block_size)
}

/// Prefix hashes of every full block of `tokens`; with `Some(parent)` block 0
/// chains from that already-known prefix hash instead of starting fresh (an
/// engine event that carries only the new suffix blocks of a longer prefix).
pub fn prefix_hashes_from(parent: Option<u64>, tokens: &[u32], block_size: usize) -> Vec<u64> {
    if block_size == 0 {
        return Vec::new();
    }
    let mut out = Vec::with_capacity(tokens.len() / block_size);
    let mut previous = parent;
    for block in tokens.chunks_exact(block_size) {
        let content = content_hash(block);
        let prefix = match previous {
            Some(parent) => chain_hash(parent, content),
            None => content,
        };
        out.push(prefix);
        previous = Some(prefix);
    }
    out
}

/// XXH3-64 (seed [`SEED`]) of arbitrary bytes, such as the stable text of a
/// rendered prompt template. Not part of the token-block chain.
pub fn text_hash(bytes: &[u8]) -> u64 {
    xxh3_64_with_seed(bytes, SEED)
}

/// Marks the salt half of an index partition key (see [`partition_key`]).
pub const SALT_SEPARATOR: &str = "\u{1f}salt:";

/// The index partition of blocks stored for `adapter_id` under `cache_salt`.
///
/// The index keeps every adapter (LoRA) in its own partition; a cache salt
/// (vLLM's and SGLang's `cache_salt` request field) makes the engine key a
/// prompt's blocks apart, so salted blocks get their own partition too. An
/// empty salt is the adapter id itself, so unsalted traffic is unchanged;
/// otherwise the key is `adapter_id + "\u{1f}salt:" + 16 hex digits of
/// XXH3-64 (seed [`SEED`]) of the salt` — the salt itself never lands in the
/// index, its snapshot or its metrics. The server builds the key for a
/// lookup, the subscriber for the blocks it reports; both call this function.
///
/// ```
/// use inference_cache_fingerprint::partition_key;
///
/// assert_eq!(partition_key("sql-lora", ""), "sql-lora");
/// assert_eq!(partition_key("", "tenant-a-secret"), partition_key("", "tenant-a-secret"));
/// assert_ne!(partition_key("", "tenant-a-secret"), partition_key("", "tenant-b-secret"));
/// assert!(partition_key("sql-lora", "s").starts_with("sql-lora\u{1f}salt:"));
/// ```
pub fn partition_key<'a>(adapter_id: &'a str, cache_salt: &str) -> Cow<'a, str> {
    if cache_salt.is_empty() {
        return Cow::Borrowed(adapter_id);
    }
    let digest = text_hash(cache_salt.as_bytes());
    let mut key = String::with_capacity(adapter_id.len() + SALT_SEPARATOR.len() + 16);
    key.push_str(adapter_id);
    key.push_str(SALT_SEPARATOR);
    for shift in (0..16).rev() {
        let nibble = ((digest >> (shift * 4)) & 0xf) as u32;
        key.push(char::from_digit(nibble, 16).unwrap_or('0'));
    }
    Cow::Owned(key)
}

/// Wire form of a prefix hash: 8 bytes, big-endian.
pub fn encode(hash: u64) -> [u8; WIRE_LEN] {
    hash.to_be_bytes()
}

/// Reads a wire-form prefix hash; `None` unless `bytes` is exactly 8 long.
pub fn decode(bytes: &[u8]) -> Option<u64> {
    let array: [u8; WIRE_LEN] = bytes.try_into().ok()?;
    Some(u64::from_be_bytes(array))
}

/// A request's block chain in the shape `LookupRouteRequest` carries it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RequestChain {
    /// Wire-form prefix hash of each full block, in order.
    pub block_hashes: Vec<[u8; WIRE_LEN]>,
    /// Tokens in each block (every entry equals the block size).
    pub block_token_counts: Vec<i32>,
}

impl RequestChain {
    /// Number of blocks in the chain.
    pub fn len(&self) -> usize {
        self.block_hashes.len()
    }

    /// True when the tokens did not fill a single block.
    pub fn is_empty(&self) -> bool {
        self.block_hashes.is_empty()
    }
}

/// Fingerprints a request's tokens into `block_hashes` + `block_token_counts`.
pub fn request_chain(tokens: &[u32], block_size: usize) -> RequestChain {
    let hashes = prefix_hashes(tokens, block_size);
    let count = i32::try_from(block_size).unwrap_or(i32::MAX);
    RequestChain {
        block_token_counts: alloc::vec![count; hashes.len()],
        block_hashes: hashes.into_iter().map(encode).collect(),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn partition_key_is_pinned() {
        assert_eq!(super::partition_key("", ""), "");
        assert_eq!(super::partition_key("a", ""), "a");
        let key = super::partition_key("a", "salt-1");
        assert_eq!(key.len(), 1 + super::SALT_SEPARATOR.len() + 16);
        assert_eq!(
            key,
            alloc::format!("a\u{1f}salt:{:016x}", super::text_hash(b"salt-1"))
        );
    }

    use super::*;
    use alloc::vec;

    #[test]
    fn design_vectors() {
        let tokens: Vec<u32> = (1..=16).collect();
        assert_eq!(prefix_hashes(&tokens, 16), vec![16863443419780771464]);
        let tokens: Vec<u32> = (0..=63).collect();
        assert_eq!(
            prefix_hashes(&tokens, 16),
            vec![
                15310707395893867146,
                13769157705258532664,
                11879827756109914528,
                3888788807566526800
            ]
        );
    }

    #[test]
    fn large_blocks_hash_like_small_ones() {
        // The streaming path (blocks over STACK_TOKENS) must equal the one-shot path.
        let tokens: Vec<u32> = (0..300).map(|t| t * 7919).collect();
        let mut bytes = Vec::new();
        for t in &tokens {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        assert_eq!(content_hash(&tokens), xxh3_64_with_seed(&bytes, SEED));
    }

    #[test]
    fn parent_chain_continues_a_sequence() {
        let tokens: Vec<u32> = (0..64).collect();
        let whole = prefix_hashes(&tokens, 16);
        let suffix = prefix_hashes_from(Some(whole[1]), &tokens[32..], 16);
        assert_eq!(suffix, whole[2..]);
    }

    #[test]
    fn partial_tail_and_zero_block_size() {
        assert!(prefix_hashes(&[1, 2, 3], 16).is_empty());
        assert!(prefix_hashes(&[1, 2, 3], 0).is_empty());
        assert_eq!(prefix_hashes(&(0..40).collect::<Vec<_>>(), 16).len(), 2);
    }

    #[test]
    fn wire_round_trip() {
        let hash = 0x0102_0304_0506_0708;
        assert_eq!(encode(hash), [1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(decode(&encode(hash)), Some(hash));
        assert_eq!(decode(&[1, 2, 3]), None);
    }

    #[test]
    fn text_hash_is_seeded_xxh3_of_the_bytes() {
        assert_eq!(text_hash(b"hello"), xxh3_64_with_seed(b"hello", 1337));
        assert_ne!(text_hash(b"hello"), text_hash(b"hello "));
        assert_eq!(text_hash(b""), xxh3_64_with_seed(b"", SEED));
    }

    #[test]
    fn request_chain_shape() {
        let chain = request_chain(&(0..50).collect::<Vec<_>>(), 16);
        assert_eq!(chain.len(), 3);
        assert_eq!(chain.block_token_counts, vec![16, 16, 16]);
        assert_eq!(
            chain.block_hashes[0],
            encode(prefix_hashes(&(0..16).collect::<Vec<_>>(), 16)[0])
        );
    }
}
