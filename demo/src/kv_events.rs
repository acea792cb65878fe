//! vLLM KV events as a simulated engine publishes them: msgpack
//! `KVEventBatch = [ts, events, data_parallel_rank]` with tagged-array events
//! (`["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium,
//! lora_name]`, `["BlockRemoved", hashes, medium]`), sent on a ZMQ PUB socket
//! as `[topic, seq (8-byte big-endian), payload]` — the format up to vLLM
//! 0.23, which the subscriber decodes.
//!
//! Concurrency: the engine hands batches to one publisher task through an
//! unbounded channel, so serving a request never waits on the socket; the task
//! numbers them from 0 in the order they arrive. Cost: one msgpack encoding
//! per batch.

use bytes::Bytes;
use rmpv::Value;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};
use zeromq::{PubSocket, Socket as _, SocketSend as _, ZmqMessage};

/// ZMQ topic of every batch (vLLM's default publisher sends an empty topic
/// unless configured; any topic works with an empty subscription).
pub const TOPIC: &str = "kv-events";

/// One cache change of a simulated engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheChange {
    /// Full blocks newly cached, in prompt order: each with its engine hash,
    /// the hash of the block before it in the prompt, and its tokens.
    Stored {
        /// Engine hash of the block.
        hash: u64,
        /// Engine hash of the previous block of the prompt, if any.
        parent: Option<u64>,
        /// The block's tokens.
        tokens: Vec<u32>,
    },
    /// Blocks evicted.
    Removed(Vec<u64>),
}

/// Encodes one batch as vLLM's msgpack `KVEventBatch`.
pub fn encode_batch(ts_seconds: f64, changes: &[CacheChange], block_size: usize) -> Vec<u8> {
    let events = changes
        .iter()
        .map(|change| match change {
            CacheChange::Stored {
                hash,
                parent,
                tokens,
            } => Value::Array(vec![
                Value::from("BlockStored"),
                Value::Array(vec![Value::from(*hash)]),
                parent.map_or(Value::Nil, Value::from),
                Value::Array(tokens.iter().map(|t| Value::from(*t)).collect()),
                Value::from(block_size as u64),
                Value::Nil,
                Value::from("GPU"),
                Value::Nil,
            ]),
            CacheChange::Removed(hashes) => Value::Array(vec![
                Value::from("BlockRemoved"),
                Value::Array(hashes.iter().map(|h| Value::from(*h)).collect()),
                Value::from("GPU"),
            ]),
        })
        .collect();
    let batch = Value::Array(vec![
        Value::from(ts_seconds),
        Value::Array(events),
        Value::Nil,
    ]);
    let mut out = Vec::new();
    // Writing into a Vec cannot fail.
    let _ = rmpv::encode::write_value(&mut out, &batch);
    out
}

/// A bound ZMQ PUB socket fed by a channel of encoded batches.
#[derive(Debug, Clone)]
pub struct Publisher {
    endpoint: String,
    batches: UnboundedSender<Vec<u8>>,
}

impl Publisher {
    /// Binds a PUB socket on a free loopback port and starts its task.
    pub async fn bind() -> anyhow::Result<Self> {
        let mut socket = PubSocket::new();
        let endpoint = socket.bind("tcp://127.0.0.1:0").await?.to_string();
        let (batches, rx) = unbounded_channel();
        tokio::spawn(publish(socket, rx));
        Ok(Self { endpoint, batches })
    }

    /// `tcp://127.0.0.1:<port>`, for the subscriber's `--endpoint`.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Queues an encoded batch; dropped silently once the task has stopped.
    pub fn send(&self, payload: Vec<u8>) {
        let _ = self.batches.send(payload);
    }
}

async fn publish(mut socket: PubSocket, mut batches: UnboundedReceiver<Vec<u8>>) {
    let mut seq: u64 = 0;
    while let Some(payload) = batches.recv().await {
        let frames = vec![
            Bytes::from_static(TOPIC.as_bytes()),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            Bytes::from(payload),
        ];
        let Ok(message) = ZmqMessage::try_from(frames) else {
            continue;
        };
        if let Err(error) = socket.send(message).await {
            tracing::debug!(%error, "KV-event publish failed");
        }
        seq += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use inference_cache_subscriber::{KvEvent, decode_batch};

    #[test]
    fn batches_decode_with_the_subscribers_decoder() {
        let changes = vec![
            CacheChange::Stored {
                hash: 11,
                parent: None,
                tokens: (0..16).collect(),
            },
            CacheChange::Stored {
                hash: u64::MAX - 3,
                parent: Some(11),
                tokens: (16..32).collect(),
            },
            CacheChange::Removed(vec![7, 8]),
        ];
        let batch = decode_batch(&encode_batch(1.5, &changes, 16)).expect("decodes");
        assert_eq!(batch.events.len(), 3);
        match &batch.events[0] {
            KvEvent::Stored(stored) => {
                assert_eq!(stored.block_size, 16);
                assert_eq!(stored.token_ids, (0..16).collect::<Vec<u32>>());
                assert!(stored.parent_block_hash.is_none());
            }
            other => panic!("expected BlockStored, got {other:?}"),
        }
        match &batch.events[1] {
            KvEvent::Stored(stored) => assert!(stored.parent_block_hash.is_some()),
            other => panic!("expected BlockStored, got {other:?}"),
        }
        match &batch.events[2] {
            KvEvent::Removed(removed) => assert_eq!(removed.block_hashes.len(), 2),
            other => panic!("expected BlockRemoved, got {other:?}"),
        }
    }
}
