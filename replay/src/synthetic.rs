//! A seedable synthetic trace with the shapes that decide cache routing:
//! shared system prompts, multi-turn chat sessions whose later turns extend
//! earlier ones, and agent loops that resend a long tool preamble, arriving in
//! bursts.
//!
//! Model (all draws from one [`Rng`] stream, so a seed fixes the trace):
//! - `system_prompts` system prompts of 1,000–4,000 tokens, picked with
//!   Zipf-like popularity (prompt k with weight 1/(k+1));
//! - `max(1, system_prompts / 4)` agent templates: a system prompt plus a
//!   tool preamble, 8,000–20,000 tokens in all;
//! - `sessions` sessions, an `agent_share` of them agent loops; requests are
//!   divided among them in proportion to exponential weights (agent loops
//!   twice as long on average), each session getting at least one;
//! - session starts are spread uniformly over `requests / rate` seconds, in
//!   bursts of 1–4 sessions with one timestamp;
//! - a chat turn appends a 100–3,000-token user message to the conversation
//!   so far (previous prompts and answers of 50–600 tokens); the next turn
//!   follows after an exponential think time of mean 20 s. An agent step
//!   appends a 100–1,500-token tool result; the next step follows after a
//!   mean of 1.5 s, and one step in five fans out into 2–3 parallel calls with
//!   the same timestamp and context;
//! - a conversation past 200 blocks starts over from its system prompt.
//!
//! Block ids follow the trace convention: the id of block j stands for the
//! whole prefix up to j (a chain hash of the block contents), numbered in
//! order of first appearance. Only full blocks are reused by a later turn:
//! the partial last block of a prompt changes when the conversation grows.
//! Cost: O(total blocks) time and memory.

use hashbrown::HashMap;

use crate::rng::{Rng, mix64};
use crate::trace::{Request, Trace};

/// Default synthetic request count.
pub const DEFAULT_REQUESTS: usize = 4000;
/// Default synthetic session count.
pub const DEFAULT_SESSIONS: usize = 400;
/// Default number of shared system prompts.
pub const DEFAULT_SYSTEM_PROMPTS: usize = 8;
/// Default share of sessions that are agent loops.
pub const DEFAULT_AGENT_SHARE: f64 = 0.25;
/// Default mean arrival rate, requests per second.
pub const DEFAULT_RATE: f64 = 8.0;

const MAX_CONTEXT_BLOCKS: usize = 200;

/// Parameters of the generator.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SyntheticConfig {
    /// Requests to generate.
    pub requests: usize,
    /// Sessions (clamped to `requests`).
    pub sessions: usize,
    /// Shared system prompts (at least 1).
    pub system_prompts: usize,
    /// Share of sessions that are agent loops, in [0, 1].
    pub agent_share: f64,
    /// Mean arrival rate the session starts are spread for, requests per second.
    pub rate: f64,
    /// Tokens per block.
    pub block_size: u32,
    /// Seed of every draw.
    pub seed: u64,
}

impl Default for SyntheticConfig {
    fn default() -> Self {
        Self {
            requests: DEFAULT_REQUESTS,
            sessions: DEFAULT_SESSIONS,
            system_prompts: DEFAULT_SYSTEM_PROMPTS,
            agent_share: DEFAULT_AGENT_SHARE,
            rate: DEFAULT_RATE,
            block_size: crate::trace::DEFAULT_TRACE_BLOCK_SIZE,
            seed: 1,
        }
    }
}

/// A conversation so far: its full blocks (chain keys) and the tokens after them.
#[derive(Debug, Clone, Default)]
struct Context {
    keys: Vec<u64>,
    tail_tokens: u32,
}

struct Generator {
    rng: Rng,
    block_size: u32,
    ids: HashMap<u64, u64>,
    /// (arrival ms, generation order, request)
    out: Vec<(u64, usize, Request)>,
}

impl Generator {
    fn id(&mut self, key: u64) -> u64 {
        let next = self.ids.len() as u64;
        *self.ids.entry(key).or_insert(next)
    }

    /// A context of `tokens` fresh tokens.
    fn fresh(&mut self, tokens: u32) -> Context {
        self.extend(&Context::default(), tokens)
    }

    /// `context` followed by `tokens` new tokens, as a context.
    fn extend(&mut self, context: &Context, tokens: u32) -> Context {
        let total = context.tail_tokens + tokens;
        let mut keys = context.keys.clone();
        let mut parent = keys.last().copied().unwrap_or(0);
        for _ in 0..total / self.block_size {
            parent = mix64(parent ^ self.rng.next_u64());
            keys.push(parent);
        }
        Context {
            keys,
            tail_tokens: total % self.block_size,
        }
    }

    /// Emits a request whose prompt is `context` plus `tokens` new tokens;
    /// returns the prompt's context.
    fn emit(&mut self, at_ms: f64, context: &Context, tokens: u32, output: u32) -> Context {
        let prompt = self.extend(context, tokens);
        let mut keys = prompt.keys.clone();
        if prompt.tail_tokens > 0 {
            let parent = keys.last().copied().unwrap_or(0);
            keys.push(mix64(parent ^ self.rng.next_u64()));
        }
        let blocks = keys.into_iter().map(|k| self.id(k)).collect::<Vec<_>>();
        let input_tokens = prompt.keys.len() as u32 * self.block_size + prompt.tail_tokens;
        let order = self.out.len();
        self.out.push((
            at_ms.max(0.0) as u64,
            order,
            Request {
                arrival_ms: at_ms.max(0.0) as u64,
                input_tokens,
                output_tokens: output,
                blocks,
            },
        ));
        prompt
    }
}

/// Generates a trace; the same config always gives the same trace.
pub fn generate(config: &SyntheticConfig) -> Trace {
    let requests = config.requests;
    let sessions = config.sessions.clamp(1, requests.max(1));
    let mut g = Generator {
        rng: Rng::new(config.seed),
        block_size: config.block_size.max(1),
        ids: HashMap::new(),
        out: Vec::with_capacity(requests),
    };
    if requests == 0 {
        return Trace {
            block_size: g.block_size,
            requests: Vec::new(),
        };
    }
    let prompts = config.system_prompts.max(1);
    let systems: Vec<Context> = (0..prompts)
        .map(|_| {
            let tokens = g.rng.between(1000, 4000) as u32;
            g.fresh(tokens)
        })
        .collect();
    let popularity: Vec<f64> = (0..prompts).map(|k| 1.0 / (k as f64 + 1.0)).collect();
    let templates: Vec<Context> = (0..(prompts / 4).max(1))
        .map(|_| {
            let system = &systems[pick_weighted(&mut g.rng, &popularity)];
            let tokens = g.rng.between(6000, 16000) as u32;
            g.extend(system, tokens)
        })
        .collect();
    let kinds: Vec<bool> = (0..sessions)
        .map(|_| g.rng.chance(config.agent_share))
        .collect();
    let turns = divide(&mut g.rng, requests, &kinds);
    let span_ms = requests as f64 / config.rate.max(1e-9) * 1000.0;
    let mut starts: Vec<f64> = Vec::with_capacity(sessions);
    while starts.len() < sessions {
        let at = g.rng.unit() * span_ms;
        let burst = g.rng.between(1, 4) as usize;
        starts.extend(std::iter::repeat_n(at, burst.min(sessions - starts.len())));
    }
    for s in 0..sessions {
        let start = starts[s];
        if kinds[s] {
            let template = templates[g.rng.below(templates.len() as u64) as usize].clone();
            agent_session(&mut g, start, &template, turns[s]);
        } else {
            let system = systems[pick_weighted(&mut g.rng, &popularity)].clone();
            chat_session(&mut g, start, &system, turns[s]);
        }
    }
    g.out.sort_by_key(|(at, order, _)| (*at, *order));
    Trace {
        block_size: g.block_size,
        requests: g.out.into_iter().map(|(_, _, r)| r).collect(),
    }
}

fn chat_session(g: &mut Generator, start_ms: f64, system: &Context, turns: usize) {
    let mut at = start_ms;
    let mut context = system.clone();
    for _ in 0..turns {
        if context.keys.len() > MAX_CONTEXT_BLOCKS {
            context = system.clone();
        }
        let message = g.rng.between(100, 3000) as u32;
        let output = g.rng.between(50, 600) as u32;
        let prompt = g.emit(at, &context, message, output);
        context = g.extend(&prompt, output);
        at += g.rng.exponential(20_000.0);
    }
}

fn agent_session(g: &mut Generator, start_ms: f64, template: &Context, turns: usize) {
    let mut at = start_ms;
    let mut context = template.clone();
    let mut left = turns;
    while left > 0 {
        if context.keys.len() > MAX_CONTEXT_BLOCKS {
            context = template.clone();
        }
        let fan_out = if g.rng.chance(0.2) {
            g.rng.between(2, 3) as usize
        } else {
            1
        };
        let mut first = None;
        for _ in 0..fan_out.min(left) {
            let result = g.rng.between(100, 1500) as u32;
            let output = g.rng.between(20, 300) as u32;
            let prompt = g.emit(at, &context, result, output);
            first.get_or_insert((prompt, output));
            left -= 1;
        }
        if let Some((prompt, output)) = first {
            context = g.extend(&prompt, output);
        }
        at += g.rng.exponential(1_500.0);
    }
}

/// Index drawn with probability proportional to `weights`.
pub(crate) fn pick_weighted(rng: &mut Rng, weights: &[f64]) -> usize {
    let total: f64 = weights.iter().sum();
    let mut x = rng.unit() * total;
    for (i, w) in weights.iter().enumerate() {
        if x < *w {
            return i;
        }
        x -= w;
    }
    weights.len() - 1
}

/// Divides `requests` among sessions (agent loops weigh double), at least one each.
pub(crate) fn divide(rng: &mut Rng, requests: usize, agent: &[bool]) -> Vec<usize> {
    let weights: Vec<f64> = agent
        .iter()
        .map(|&a| rng.exponential(1.0) * if a { 2.0 } else { 1.0 })
        .collect();
    let total: f64 = weights.iter().sum();
    let spare = requests - agent.len();
    let mut turns: Vec<usize> = weights
        .iter()
        .map(|w| 1 + (spare as f64 * w / total).floor() as usize)
        .collect();
    let mut assigned: usize = turns.iter().sum();
    while assigned < requests {
        let i = rng.below(turns.len() as u64) as usize;
        turns[i] += 1;
        assigned += 1;
    }
    turns
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small(seed: u64) -> SyntheticConfig {
        SyntheticConfig {
            requests: 600,
            sessions: 60,
            seed,
            ..SyntheticConfig::default()
        }
    }

    #[test]
    fn deterministic_per_seed() {
        let a = generate(&small(7));
        assert_eq!(a, generate(&small(7)));
        assert_ne!(a, generate(&small(8)));
    }

    #[test]
    fn well_formed_and_sized() {
        let trace = generate(&small(3));
        assert_eq!(trace.requests.len(), 600);
        let bs = trace.block_size;
        for pair in trace.requests.windows(2) {
            assert!(pair[0].arrival_ms <= pair[1].arrival_ms);
        }
        for r in &trace.requests {
            assert_eq!(r.blocks.len(), r.input_tokens.div_ceil(bs) as usize);
        }
        // Valid Mooncake JSONL.
        let mut out = Vec::new();
        trace.write_jsonl(&mut out).expect("write to memory");
        assert_eq!(Trace::from_jsonl(&out[..], bs).expect("parses"), trace);
    }

    #[test]
    fn has_shared_heads_follow_up_turns_and_bursts() {
        let trace = generate(&small(5));
        let mut heads: HashMap<u64, usize> = HashMap::new();
        for r in &trace.requests {
            *heads.entry(r.blocks[0]).or_default() += 1;
        }
        // A system prompt's first block is shared by many sessions.
        assert!(heads.values().any(|&n| n >= 60), "{heads:?}");
        // Some request extends an earlier one by more than its system prompt.
        let extends = trace.requests.iter().enumerate().any(|(i, later)| {
            trace.requests[..i].iter().any(|earlier| {
                earlier.blocks.len() > 10
                    && later.blocks.len() > earlier.blocks.len()
                    && later.blocks[..earlier.blocks.len() - 1]
                        == earlier.blocks[..earlier.blocks.len() - 1]
            })
        });
        assert!(extends);
        let same_time = trace
            .requests
            .windows(2)
            .filter(|p| p[0].arrival_ms == p[1].arrival_ms)
            .count();
        assert!(same_time >= 20, "{same_time}");
    }
}
