//! The demo's workload: a trace from replay's synthetic generator (shared
//! system prompts, multi-turn chats, agent loops with parallel tool calls,
//! arriving in bursts) turned into OpenAI completions requests with token-id
//! prompts.
//!
//! A trace block id stands for its whole prefix, so the tokens of trace block
//! `j` are drawn from its id alone: two requests that share trace blocks
//! `0..=j` share those tokens exactly, and the engines' own 16-token blocks
//! (and the gateway's fingerprints) share the same prefixes. Arrival times are
//! scaled so the trace lasts the requested duration. Token-id prompts need no
//! tokenizer on the policy server: the filter fingerprints them itself.

use std::time::Duration;

use inference_cache_replay::{SyntheticConfig, Trace, generate};

/// Tokens per trace block: long enough for the generator's context cap to
/// allow conversations of up to ~25,000 tokens.
pub const TRACE_BLOCK_TOKENS: u32 = 128;

/// One request of the demo workload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DemoRequest {
    /// When to send it, from the start of the run.
    pub at: Duration,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// `max_tokens`.
    pub max_tokens: u32,
}

impl DemoRequest {
    /// The OpenAI completions body.
    pub fn body(&self) -> String {
        serde_json::json!({
            "model": crate::MODEL,
            "prompt": self.prompt,
            "max_tokens": self.max_tokens,
        })
        .to_string()
    }
}

/// Parameters of the workload.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WorkloadConfig {
    /// Requests.
    pub requests: usize,
    /// Sessions (chats and agent loops).
    pub sessions: usize,
    /// Shared system prompts.
    pub system_prompts: usize,
    /// Share of sessions that are agent loops.
    pub agent_share: f64,
    /// How long the arrivals are spread over.
    pub duration: Duration,
    /// Seed of the generator.
    pub seed: u64,
}

/// Generates the workload; the same config always gives the same requests.
pub fn build(config: &WorkloadConfig) -> Vec<DemoRequest> {
    let trace = generate(&SyntheticConfig {
        requests: config.requests,
        sessions: config.sessions,
        system_prompts: config.system_prompts,
        agent_share: config.agent_share,
        block_size: TRACE_BLOCK_TOKENS,
        seed: config.seed,
        ..SyntheticConfig::default()
    });
    requests_of(&trace, config.duration)
}

fn requests_of(trace: &Trace, duration: Duration) -> Vec<DemoRequest> {
    let span_ms = trace.requests.last().map_or(1, |r| r.arrival_ms).max(1) as f64;
    let scale = duration.as_secs_f64() * 1000.0 / span_ms;
    trace
        .requests
        .iter()
        .map(|r| DemoRequest {
            at: Duration::from_secs_f64(r.arrival_ms as f64 * scale / 1000.0),
            prompt: prompt_tokens(&r.blocks, r.input_tokens, trace.block_size),
            max_tokens: r.output_tokens.clamp(1, 4096),
        })
        .collect()
}

/// Tokens of a prompt of `input_tokens` whose trace blocks are `blocks`.
fn prompt_tokens(blocks: &[u64], input_tokens: u32, block_size: u32) -> Vec<u32> {
    let mut tokens = Vec::with_capacity(input_tokens as usize);
    for &id in blocks {
        let left = input_tokens as usize - tokens.len();
        let take = left.min(block_size as usize);
        tokens.extend((0..take as u64).map(|i| {
            (xxhash_rust::xxh3::xxh3_64_with_seed(&i.to_le_bytes(), id) % 50_000) as u32 + 100
        }));
    }
    tokens
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> WorkloadConfig {
        WorkloadConfig {
            requests: 60,
            sessions: 8,
            system_prompts: 2,
            agent_share: 0.3,
            duration: Duration::from_secs(5),
            seed: 3,
        }
    }

    #[test]
    fn shared_trace_blocks_give_shared_tokens_and_arrivals_fit_the_duration() {
        let requests = build(&config());
        assert_eq!(requests.len(), 60);
        assert!(requests.windows(2).all(|w| w[0].at <= w[1].at));
        let last = requests.last().map(|r| r.at).unwrap_or_default();
        assert!(last <= Duration::from_secs(5) && last >= Duration::from_millis(4900));
        // Two requests with the same system prompt share at least one full trace block.
        let shared = requests.iter().enumerate().any(|(i, a)| {
            requests[i + 1..]
                .iter()
                .any(|b| a.prompt[..128] == b.prompt[..128])
        });
        assert!(shared, "some requests share a prefix");
        assert!(requests.iter().all(|r| r.prompt.len() >= 1000));
        assert_eq!(build(&config()), requests, "deterministic");
    }

    #[test]
    fn partial_last_block_is_cut() {
        let tokens = prompt_tokens(&[1, 2], 130, 128);
        assert_eq!(tokens.len(), 130);
        assert_eq!(prompt_tokens(&[1], 128, 128), tokens[..128].to_vec());
    }
}
