//! Plain engine KV-event types, independent of the wire layout they came in.
//!
//! One [`EventBatch`] is one ZMQ message's payload. Block hashes are the
//! engine's own ([`EngineHash`]): opaque, per-process seeded, and used only
//! to link events to each other (parents, removals) — never sent to the
//! server, which is given content fingerprints instead.

/// An engine block hash: the low 64 bits as an integer (signed and unsigned
/// forms of the same bits are the same hash), or raw bytes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum EngineHash {
    /// Integer form; a negative wire value is stored as its two's-complement bits.
    Int(u64),
    /// Bytes form (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`).
    Bytes(Box<[u8]>),
}

/// Blocks newly cached by the engine.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BlockStored {
    /// Hash of each stored block, in sequence order.
    pub block_hashes: Vec<EngineHash>,
    /// Hash of the block before the first one, when the blocks extend a prefix.
    pub parent_block_hash: Option<EngineHash>,
    /// Token ids of every stored block, concatenated.
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: u32,
    /// Engine LoRA id (a load-order integer), when a LoRA adapter produced the blocks.
    pub lora_id: Option<i64>,
    /// Where the blocks live (`GPU`, `CPU`, disk, ...); absent means GPU.
    pub medium: Option<String>,
    /// Adapter name, in engines that report it.
    pub lora_name: Option<String>,
    /// Cache salt the blocks were stored under, when the event names one
    /// (vLLM: in the first block's `extra_keys`; SGLang: `cache_salt`).
    /// `None` means the event names no salt: blocks that extend a parent
    /// inherit the parent's salt, a chain start is unsalted.
    pub cache_salt: Option<String>,
}

/// Blocks the engine dropped from one medium.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BlockRemoved {
    /// Hashes of the removed blocks.
    pub block_hashes: Vec<EngineHash>,
    /// Medium they were removed from; absent means GPU.
    pub medium: Option<String>,
}

/// One engine KV-cache event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// `BlockStored`.
    Stored(BlockStored),
    /// `BlockRemoved`.
    Removed(BlockRemoved),
    /// `AllBlocksCleared`: the engine's prefix cache was reset.
    AllCleared,
}

/// One published batch (`KVEventBatch`).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EventBatch {
    /// Publisher timestamp, seconds since the epoch.
    pub ts: f64,
    /// Events in publication order.
    pub events: Vec<KvEvent>,
    /// Data-parallel rank of the publishing engine, when set.
    pub data_parallel_rank: Option<i64>,
    /// Events of the batch that could not be read and were skipped.
    pub skipped_events: usize,
}

/// Tier a medium name denotes: the engine's device memory or an offload tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Medium {
    /// Device (GPU/accelerator) memory: tier T1.
    Device,
    /// CPU memory, local disk or another offload store: tier T2.
    Offload,
}

impl Medium {
    /// Classifies an event's medium; an absent medium is the device.
    pub fn classify(medium: Option<&str>) -> Self {
        let Some(name) = medium else {
            return Medium::Device;
        };
        let name = name.trim().as_bytes();
        // Case-insensitive substring test without a lowercased copy: this
        // runs once per event.
        let mentions = |word: &str| {
            name.windows(word.len())
                .any(|window| window.eq_ignore_ascii_case(word.as_bytes()))
        };
        let device = name.is_empty()
            || ["gpu", "cuda", "hbm", "device", "xpu", "npu", "tpu", "hpu"]
                .iter()
                .any(|d| mentions(d));
        if device {
            Medium::Device
        } else {
            Medium::Offload
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medium_classification() {
        assert_eq!(Medium::classify(None), Medium::Device);
        assert_eq!(Medium::classify(Some("GPU")), Medium::Device);
        assert_eq!(Medium::classify(Some("cuda:0")), Medium::Device);
        assert_eq!(Medium::classify(Some("CPU")), Medium::Offload);
        assert_eq!(Medium::classify(Some("disk")), Medium::Offload);
        assert_eq!(Medium::classify(Some("LocalDisk")), Medium::Offload);
        assert_eq!(Medium::classify(Some(" Device ")), Medium::Device);
        assert_eq!(Medium::classify(Some("")), Medium::Device);
        assert_eq!(Medium::classify(Some("G")), Medium::Offload);
    }
}
