//! Shared workload for the index benchmarks: 8 replicas, 64-block chains of
//! 16-token blocks, fingerprinted with the project's content fingerprint.
//!
//! Chains are built in groups: every group shares a 16-block "system prompt"
//! head and each chain adds 48 blocks of its own; each chain is held by
//! `holders` replicas (rotating), so a lookup walks a realistic mix of shared
//! and private blocks.

#![allow(dead_code)]

use inference_cache_fingerprint::{content_hash, encode, prefix_hashes};
use inference_cache_index::{BlockChain, CacheUpdate, ChainInput, LookupRequest, PrefixReport};

/// Replicas in the workload.
pub const REPLICAS: usize = 8;
/// Blocks per chain.
pub const CHAIN_BLOCKS: usize = 64;
/// Tokens per block.
pub const BLOCK: usize = 16;
/// Blocks of the head each group of chains shares.
pub const HEAD_BLOCKS: usize = 16;
/// Chains per group.
pub const GROUP: usize = 32;

/// The replicas holding chain `c` when each chain has `holders` (rotating).
fn rotation(c: usize, holders: usize) -> impl Iterator<Item = usize> {
    (0..holders).map(move |k| (c + k) % REPLICAS)
}

/// Chains needed for at least `entries` distinct block-replica entries: a
/// shared head block counts once per replica holding it.
fn chains_for(entries: usize, holders: usize) -> usize {
    let mut chains = 0;
    let mut distinct = 0;
    let mut head_holders = [false; REPLICAS];
    while distinct < entries {
        if chains % GROUP == 0 {
            head_holders = [false; REPLICAS];
        }
        for r in rotation(chains, holders) {
            if !std::mem::replace(&mut head_holders[r], true) {
                distinct += HEAD_BLOCKS;
            }
        }
        distinct += (CHAIN_BLOCKS - HEAD_BLOCKS) * holders;
        chains += 1;
    }
    chains
}

/// One chain: wire hashes and counts.
pub struct Workload {
    /// Wire hashes of each chain.
    pub chains: Vec<Vec<Vec<u8>>>,
    /// Each chain as the server hands it to the index.
    pub block_chains: Vec<BlockChain>,
    /// Prefix hashes of each chain as `u64`.
    pub prefixes: Vec<Vec<u64>>,
    /// Per-block content hashes of each chain.
    pub contents: Vec<Vec<u64>>,
    /// Replicas holding each chain.
    pub holders: usize,
}

impl Workload {
    /// Enough chains for at least `entries` distinct block-replica entries.
    pub fn new(entries: usize, holders: usize) -> Self {
        let n = chains_for(entries, holders);
        let mut chains: Vec<Vec<Vec<u8>>> = Vec::with_capacity(n);
        let mut prefixes = Vec::with_capacity(n);
        let mut contents = Vec::with_capacity(n);
        for c in 0..n {
            let group = (c / GROUP) as u32;
            let mut tokens: Vec<u32> = (0..(HEAD_BLOCKS * BLOCK) as u32)
                .map(|t| group.wrapping_mul(7919) ^ t)
                .collect();
            tokens.extend(
                (0..((CHAIN_BLOCKS - HEAD_BLOCKS) * BLOCK) as u32)
                    .map(|t| (c as u32).wrapping_mul(104_729).wrapping_add(t) | 0x8000_0000),
            );
            let hashes = prefix_hashes(&tokens, BLOCK);
            chains.push(hashes.iter().map(|&h| encode(h).to_vec()).collect());
            prefixes.push(hashes);
            contents.push(tokens.chunks_exact(BLOCK).map(content_hash).collect());
        }
        let block_chains = chains
            .iter()
            .map(|c: &Vec<Vec<u8>>| block_chain(c))
            .collect();
        Self {
            chains,
            block_chains,
            prefixes,
            contents,
            holders,
        }
    }

    /// A lookup of chain `c`, as the server hands it to the index.
    pub fn request(&self, c: usize) -> LookupRequest<'_> {
        let mut r = LookupRequest::new("tenant", "model", "vllm");
        r.chain = ChainInput::Wire(&self.block_chains[c]);
        r
    }

    /// The replicas holding chain `c`.
    pub fn holders_of(&self, c: usize) -> impl Iterator<Item = usize> + '_ {
        rotation(c, self.holders)
    }

    /// One update per (chain, holder).
    pub fn updates(&self) -> Vec<CacheUpdate> {
        let mut out = Vec::new();
        for (c, chain) in self.chains.iter().enumerate() {
            for r in self.holders_of(c) {
                out.push(update(r, chain));
            }
        }
        out
    }
}

/// A chain of wire hashes with [`BLOCK`] tokens in each block.
pub fn block_chain(chain: &[Vec<u8>]) -> BlockChain {
    BlockChain::new(chain, vec![BLOCK as u32; chain.len()]).expect("a valid chain")
}

/// The update of replica `r` holding `chain`.
pub fn update(r: usize, chain: &[Vec<u8>]) -> CacheUpdate {
    CacheUpdate {
        replica_id: format!("replica-{r}"),
        tenant_id: "tenant".into(),
        model_id: "model".into(),
        hash_scheme: "vllm".into(),
        prefixes: vec![PrefixReport {
            chain: block_chain(chain),
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// The `q` quantile of `sorted` (ascending) samples.
pub fn percentile(sorted: &[u64], q: f64) -> u64 {
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// The number the environment variable `name` holds, or `default` when it
/// is unset. A value that is not a number stops the run with a message
/// naming it, rather than running with the default unnoticed.
pub fn env_number<T: std::str::FromStr>(name: &str, default: T) -> T {
    match std::env::var(name) {
        Ok(v) => v
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a number")),
        Err(std::env::VarError::NotPresent) => default,
        Err(e) => panic!("{name}: {e}"),
    }
}

/// The comma-separated numbers the environment variable `name` holds, or
/// those of `default` when it is unset; as loud as [`env_number`].
pub fn env_numbers<T: std::str::FromStr>(name: &str, default: &str) -> Vec<T> {
    let list = std::env::var(name).unwrap_or_else(|_| default.into());
    list.split(',')
        .map(|n| {
            n.trim()
                .parse()
                .unwrap_or_else(|_| panic!("{name}: {n:?} is not a number"))
        })
        .collect()
}
