//! A simulated vLLM engine: an HTTP server speaking the OpenAI
//! `/v1/completions` and `/v1/chat/completions` APIs, with a real LRU prefix
//! cache of `block_size`-token blocks, a time to first token that depends on
//! how much of the prompt is cached, vLLM's Prometheus load gauges on
//! `/metrics`, and every cache change published as vLLM KV events over ZMQ.
//!
//! The serving model is replay's ([`Replica`]): prefill is FIFO, one request
//! at a time, at `prefill_tps` tokens per second over the *uncached* tokens,
//! so a request waits for the prefills queued before it. The cache is
//! replay's [`BlockLru`](inference_cache_replay::BlockLru), keyed by the
//! engine's own chained block hashes (xxh3 of the parent hash and the block's
//! tokens); only full blocks are cached, as in vLLM. The response is sent
//! when the request's prefill ends, so the latency a client measures is its
//! time to first token; the generated text is filler (`max_tokens` words).
//!
//! A completions `prompt` may be token ids (what a gateway can fingerprint
//! without a tokenizer) or text; text and chat messages are turned into
//! tokens by a stand-in tokenizer (one token per whitespace-separated word,
//! hashed), since the simulator has no model.
//!
//! Concurrency: one mutex around the replica, held for the bookkeeping of a
//! request (O(prompt blocks)), never across the simulated prefill.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use inference_cache_replay::{Replica, Served, ServingModel};
use parking_lot::Mutex;
use serde_json::{Value, json};
use tokio::task::JoinHandle;

use crate::kv_events::{CacheChange, Publisher, encode_batch};

/// Parameters of one simulated engine.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// Blocks the prefix cache holds.
    pub cache_blocks: usize,
    /// Prefill throughput and decode speed.
    pub serving: ServingModel,
}

struct EngineState {
    name: String,
    config: EngineConfig,
    started: Instant,
    replica: Mutex<Replica>,
    queried_tokens: Mutex<(u64, u64)>,
    publisher: Publisher,
}

/// A running simulated engine; stops when dropped.
#[derive(Debug)]
pub struct Engine {
    addr: SocketAddr,
    kv_events: String,
    task: JoinHandle<()>,
}

impl Engine {
    /// Binds the HTTP server and the KV-event publisher on free loopback ports.
    pub async fn start(config: EngineConfig) -> anyhow::Result<Self> {
        let publisher = Publisher::bind().await?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let kv_events = publisher.endpoint().to_owned();
        let state = Arc::new(EngineState {
            name: addr.to_string(),
            config,
            started: Instant::now(),
            replica: Mutex::new(Replica::new(config.cache_blocks)),
            queried_tokens: Mutex::new((0, 0)),
            publisher,
        });
        let app = Router::new()
            .route("/v1/completions", post(completions))
            .route("/v1/chat/completions", post(chat_completions))
            .route("/v1/models", get(models))
            .route("/metrics", get(metrics))
            .route("/health", get(|| async { "ok" }))
            .with_state(state);
        let task = tokio::spawn(async move {
            if let Err(error) = axum::serve(listener, app).await {
                tracing::warn!(%error, "simulated engine stopped");
            }
        });
        Ok(Self {
            addr,
            kv_events,
            task,
        })
    }

    /// HTTP address; also the replica id gateways route to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// ZMQ PUB endpoint of its KV events.
    pub fn kv_events_endpoint(&self) -> &str {
        &self.kv_events
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Stand-in tokenizer of the simulator: one token per word, hashed into a
/// 50,000-entry vocabulary.
pub fn stand_in_tokens(text: &str) -> Vec<u32> {
    text.split_whitespace()
        .map(|word| (xxhash_rust::xxh3::xxh3_64(word.as_bytes()) % 50_000) as u32 + 100)
        .collect()
}

/// Chained engine hashes of the prompt's full blocks.
pub fn block_hashes(tokens: &[u32], block_size: usize) -> Vec<u64> {
    let mut parent = 0u64;
    tokens
        .chunks_exact(block_size.max(1))
        .map(|block| {
            let bytes: Vec<u8> = block.iter().flat_map(|t| t.to_le_bytes()).collect();
            parent = xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, parent);
            parent
        })
        .collect()
}

struct Admission {
    cached_tokens: u64,
    ttft: Duration,
}

impl EngineState {
    fn now_ms(&self) -> f64 {
        self.started.elapsed().as_secs_f64() * 1000.0
    }

    /// Looks the prompt up in the cache, admits it, queues its prefill and
    /// publishes the cache changes.
    fn admit(&self, tokens: &[u32], output_tokens: u32) -> Admission {
        let block_size = self.config.block_size;
        let hashes = block_hashes(tokens, block_size);
        let (mut stored, mut evicted) = (Vec::new(), Vec::new());
        let now = self.now_ms();
        let (hits, ttft_ms) = {
            let mut replica = self.replica.lock();
            replica.advance(now);
            let hits = replica.cache.admit(&hashes, &mut stored, &mut evicted);
            let cached = (hits * block_size) as u64;
            let prompt = tokens.len() as u64;
            let served = Served {
                prompt_tokens: prompt,
                uncached_tokens: prompt.saturating_sub(cached),
                output_tokens,
                blocks: hashes.len() as u64,
            };
            (hits, replica.serve(now, served, &self.config.serving))
        };
        let cached_tokens = (hits * block_size) as u64;
        {
            let mut queried = self.queried_tokens.lock();
            queried.0 += tokens.len() as u64;
            queried.1 += cached_tokens;
        }
        let mut changes = Vec::new();
        if !evicted.is_empty() {
            changes.push(CacheChange::Removed(evicted));
        }
        let stored: HashSet<u64> = stored.into_iter().collect();
        for (i, hash) in hashes.iter().enumerate() {
            if stored.contains(hash) {
                changes.push(CacheChange::Stored {
                    hash: *hash,
                    parent: i.checked_sub(1).map(|p| hashes[p]),
                    tokens: tokens[i * block_size..(i + 1) * block_size].to_vec(),
                });
            }
        }
        if !changes.is_empty() {
            let ts = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs_f64())
                .unwrap_or_default();
            self.publisher.send(encode_batch(ts, &changes, block_size));
        }
        Admission {
            cached_tokens,
            ttft: Duration::from_secs_f64(ttft_ms.max(0.0) / 1000.0),
        }
    }

    async fn serve(&self, tokens: Vec<u32>, body: &Value, chat: bool) -> Response {
        if tokens.is_empty() {
            return error(StatusCode::BAD_REQUEST, "empty prompt");
        }
        let max_tokens = body
            .get("max_tokens")
            .or_else(|| body.get("max_completion_tokens"))
            .and_then(Value::as_u64)
            .unwrap_or(16)
            .clamp(1, 4096) as u32;
        let admission = self.admit(&tokens, max_tokens);
        tokio::time::sleep(admission.ttft).await;
        let model = body
            .get("model")
            .and_then(Value::as_str)
            .unwrap_or("demo-model");
        let text = vec!["tok"; max_tokens.min(64) as usize].join(" ");
        let choice = if chat {
            json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"})
        } else {
            json!({"index": 0, "text": text, "finish_reason": "length"})
        };
        let prompt_tokens = tokens.len() as u64;
        let response = json!({
            "id": format!("{}-{}", if chat { "chatcmpl" } else { "cmpl" }, self.now_ms() as u64),
            "object": if chat { "chat.completion" } else { "text_completion" },
            "model": model,
            "choices": [choice],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": max_tokens,
                "total_tokens": prompt_tokens + u64::from(max_tokens),
                "prompt_tokens_details": {"cached_tokens": admission.cached_tokens},
            },
        });
        (
            [
                ("content-type", "application/json"),
                ("x-served-by", self.name.as_str()),
            ],
            response.to_string(),
        )
            .into_response()
    }
}

fn error(status: StatusCode, message: &str) -> Response {
    (
        status,
        [("content-type", "application/json")],
        json!({"error": {"message": message, "type": "invalid_request_error"}}).to_string(),
    )
        .into_response()
}

fn parse(body: &[u8]) -> Result<Value, Box<Response>> {
    serde_json::from_slice(body)
        .map_err(|e| Box::new(error(StatusCode::BAD_REQUEST, &e.to_string())))
}

async fn completions(State(state): State<Arc<EngineState>>, body: bytes::Bytes) -> Response {
    let body = match parse(&body) {
        Ok(body) => body,
        Err(response) => return *response,
    };
    let tokens = match body.get("prompt") {
        Some(Value::String(text)) => stand_in_tokens(text),
        Some(Value::Array(items)) => {
            let ids: Option<Vec<u32>> = items
                .iter()
                .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                .collect();
            match ids {
                Some(ids) => ids,
                None => return error(StatusCode::BAD_REQUEST, "prompt: token ids or a string"),
            }
        }
        _ => return error(StatusCode::BAD_REQUEST, "prompt: token ids or a string"),
    };
    state.serve(tokens, &body, false).await
}

async fn chat_completions(State(state): State<Arc<EngineState>>, body: bytes::Bytes) -> Response {
    let body = match parse(&body) {
        Ok(body) => body,
        Err(response) => return *response,
    };
    let Some(messages) = body.get("messages").and_then(Value::as_array) else {
        return error(StatusCode::BAD_REQUEST, "messages: an array");
    };
    let mut tokens = Vec::new();
    for message in messages {
        let role = message
            .get("role")
            .and_then(Value::as_str)
            .unwrap_or("user");
        tokens.extend(stand_in_tokens(&format!("<|{role}|>")));
        match message.get("content") {
            Some(Value::String(text)) => tokens.extend(stand_in_tokens(text)),
            Some(Value::Array(parts)) => {
                for part in parts {
                    if let Some(text) = part.get("text").and_then(Value::as_str) {
                        tokens.extend(stand_in_tokens(text));
                    }
                }
            }
            _ => {}
        }
    }
    tokens.extend(stand_in_tokens("<|assistant|>"));
    state.serve(tokens, &body, true).await
}

async fn models() -> impl IntoResponse {
    axum::Json(json!({"object": "list", "data": [{"id": crate::MODEL, "object": "model"}]}))
}

/// vLLM's load gauges and prefix-cache counters, in its metric names.
async fn metrics(State(state): State<Arc<EngineState>>) -> impl IntoResponse {
    let load = {
        let mut replica = state.replica.lock();
        replica.advance(state.now_ms());
        replica.load()
    };
    let (queries, hits) = *state.queried_tokens.lock();
    let labels = format!("model_name=\"{}\"", crate::MODEL);
    let text = format!(
        "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{{labels}}} {}\n\
         # TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{{labels}}} {}\n\
         # TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{{{labels}}} {}\n\
         # TYPE vllm:prefix_cache_queries counter\nvllm:prefix_cache_queries_total{{{labels}}} {queries}\n\
         # TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total{{{labels}}} {hits}\n\
         # TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{block_size=\"{}\",enable_prefix_caching=\"True\"}} 1\n",
        load.waiting, load.running, load.kv_usage, state.config.block_size
    );
    ([("content-type", "text/plain; version=0.0.4")], text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_hashes_chain_and_skip_the_partial_block() {
        let tokens: Vec<u32> = (0..40).collect();
        let hashes = block_hashes(&tokens, 16);
        assert_eq!(hashes.len(), 2);
        let mut other = tokens.clone();
        other[0] = 999;
        let changed = block_hashes(&other, 16);
        assert_ne!(hashes[0], changed[0]);
        assert_ne!(
            hashes[1], changed[1],
            "a change in block 0 changes every later hash"
        );
        assert_eq!(block_hashes(&tokens[..32], 16), hashes);
    }
}
