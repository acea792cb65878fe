//! A chat workload rendered the way the engine sees it, so a replay can show
//! whether tool-calling traffic keeps its cache hits.
//!
//! The generator writes OpenAI chat requests — shared system prompts,
//! multi-turn chats, and agent loops whose every step resends a long tool
//! list, the assistant's tool call and the tool's result — and renders each
//! one through a real tokenizer and chat template exactly as the server does
//! for a `/v1/chat/completions` lookup ([`TokenizerRegistry::encode_chat`]).
//! The token ids are cut into blocks and chained with the project's content
//! fingerprint, as the filter and the server key them, and every distinct
//! block gets a trace id in order of first appearance (the Mooncake
//! convention); a prompt's partial last block is never shared.
//!
//! The same draws make the same sessions *with* tools (`tools` definitions,
//! assistant `tool_calls`, `tool` messages with `tool_call_id`) or *without*
//! (no `tools`; each call and result written as plain text), so two replays
//! compare tool traffic with the same conversations as plain chat.
//!
//! Model: `system_prompts` system prompts (150–500 words, Zipf-like
//! popularity); two tool sets of 8–14 tools, each with its own system prompt;
//! session starts spread over `requests / rate` seconds; a chat turn adds an
//! assistant answer (30–250 words) and a user message (20–300 words) after a
//! mean think time of 20 s; an agent step adds one tool call and its result
//! (60–400 words) after a mean of 1.5 s. A conversation past
//! [`MAX_CONTEXT_TOKENS`] starts over from its first messages. Cost: every
//! request is rendered and tokenized whole (O(context) each).

use std::path::PathBuf;

use hashbrown::HashMap;
use inference_cache_tokenizer::{ChatMessage, ChatOptions, TokenizerRegistry};
use serde_json::{Value, json};

use crate::error::ReplayError;
use crate::rng::Rng;
use crate::synthetic::{divide, pick_weighted};
use crate::trace::{Request, Trace};

/// Default request count of the chat workload.
pub const DEFAULT_CHAT_REQUESTS: usize = 1000;
/// A conversation longer than this (prompt tokens) starts over.
pub const MAX_CONTEXT_TOKENS: usize = 24_000;

const SYLLABLES: [&str; 32] = [
    "ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "pe", "da", "gor", "lin", "tam", "ber", "chi",
    "fu", "wen", "dor", "qua", "zel", "mon", "rix", "sta", "ple", "tur", "nox", "bri", "ela", "um",
    "ost", "ian", "ex",
];

/// Parameters of the chat workload.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatConfig {
    /// Directory of tokenizer models (one subdirectory per model, as `serve --tokenizers-dir`).
    pub tokenizers: PathBuf,
    /// Model (subdirectory) whose tokenizer and chat template render the requests.
    pub model: String,
    /// Send tool definitions, tool calls and tool results as such (else as text).
    pub tools: bool,
    /// Requests to generate.
    pub requests: usize,
    /// Sessions (clamped to `requests`).
    pub sessions: usize,
    /// Shared system prompts of chat sessions (at least 1).
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

/// One tool of a tool set: its OpenAI definition and its parameter names.
struct Tool {
    definition: Value,
    name: String,
    params: Vec<String>,
}

struct Writer {
    rng: Rng,
}

impl Writer {
    fn word(&mut self) -> String {
        let n = self.rng.between(1, 3);
        (0..n)
            .map(|_| SYLLABLES[self.rng.below(SYLLABLES.len() as u64) as usize])
            .collect()
    }

    /// `words` words in sentences.
    fn text(&mut self, words: u64) -> String {
        let mut out = String::new();
        let mut sentence = 0;
        for i in 0..words {
            if i > 0 {
                out.push(' ');
            }
            let word = self.word();
            if sentence == 0 {
                let mut chars = word.chars();
                if let Some(first) = chars.next() {
                    out.extend(first.to_uppercase());
                    out.push_str(chars.as_str());
                }
            } else {
                out.push_str(&word);
            }
            sentence += 1;
            if sentence >= 6 + self.rng.below(10) || i + 1 == words {
                out.push('.');
                sentence = 0;
            }
        }
        out
    }

    fn between_text(&mut self, lo: u64, hi: u64) -> String {
        let words = self.rng.between(lo, hi);
        self.text(words)
    }

    fn tool(&mut self, index: usize) -> Tool {
        let name = format!("{}_{}_{index}", self.word(), self.word());
        let mut properties = serde_json::Map::new();
        let params: Vec<String> = (0..self.rng.between(2, 5))
            .map(|i| format!("{}_{i}", self.word()))
            .collect();
        for p in &params {
            let description = self.between_text(8, 20);
            properties.insert(
                p.clone(),
                json!({"type": "string", "description": description}),
            );
        }
        let description = self.between_text(30, 80);
        Tool {
            definition: json!({
                "type": "function",
                "function": {
                    "name": name,
                    "description": description,
                    "parameters": {
                        "type": "object",
                        "properties": properties,
                        "required": [params[0]],
                    },
                },
            }),
            name,
            params,
        }
    }
}

/// A session's requests so far.
struct Session {
    opening: Vec<ChatMessage>,
    messages: Vec<ChatMessage>,
    tools: Option<usize>,
}

struct Render<'a> {
    registry: &'a TokenizerRegistry,
    config: &'a ChatConfig,
    tool_sets: Vec<Vec<Tool>>,
    ids: HashMap<u64, u64>,
    fresh: u64,
    /// (arrival ms, generation order, request)
    out: Vec<(u64, usize, Request)>,
}

impl Render<'_> {
    /// Renders, tokenizes and fingerprints one request; returns its prompt tokens.
    fn emit(&mut self, at_ms: f64, session: &Session, output: u32) -> Result<usize, ReplayError> {
        let options = ChatOptions {
            tools: session.tools.filter(|_| self.config.tools).map(|set| {
                self.tool_sets[set]
                    .iter()
                    .map(|t| t.definition.clone())
                    .collect()
            }),
            ..ChatOptions::default()
        };
        let tokens = self
            .registry
            .encode_chat(&self.config.model, &session.messages, &options)
            .map_err(|error| ReplayError::Setting {
                flag: "chat-model",
                reason: format!("rendering a request failed: {error}"),
            })?;
        let block_size = self.config.block_size as usize;
        let mut blocks: Vec<u64> = inference_cache_fingerprint::prefix_hashes(&tokens, block_size)
            .into_iter()
            .map(|hash| {
                let next = self.ids.len() as u64;
                *self.ids.entry(hash).or_insert(next)
            })
            .collect();
        if !tokens.len().is_multiple_of(block_size) {
            // A partial block is never reused: ids past every shared one.
            self.fresh += 1;
            blocks.push(u64::MAX / 2 + self.fresh);
        }
        let arrival_ms = at_ms.max(0.0) as u64;
        let order = self.out.len();
        self.out.push((
            arrival_ms,
            order,
            Request {
                arrival_ms,
                input_tokens: u32::try_from(tokens.len()).unwrap_or(u32::MAX),
                output_tokens: output,
                blocks,
            },
        ));
        Ok(tokens.len())
    }
}

/// Generates the chat workload and renders it with `config.model`'s
/// tokenizer and chat template; the same config always gives the same trace.
pub fn generate_chat(config: &ChatConfig) -> Result<Trace, ReplayError> {
    let (registry, _skipped) =
        TokenizerRegistry::load_dir(&config.tokenizers).map_err(|error| ReplayError::Setting {
            flag: "tokenizers",
            reason: format!("{}: {error}", config.tokenizers.display()),
        })?;
    if !registry.has_chat_template(&config.model) {
        return Err(ReplayError::Setting {
            flag: "chat-model",
            reason: format!(
                "no model {:?} with a chat template under {} (found: {})",
                config.model,
                config.tokenizers.display(),
                registry.model_ids().join(", ")
            ),
        });
    }
    let requests = config.requests;
    let sessions = config.sessions.clamp(1, requests.max(1));
    let block_size = config.block_size.max(1);
    let mut w = Writer {
        rng: Rng::new(config.seed),
    };
    let prompts = config.system_prompts.max(1);
    let systems: Vec<String> = (0..prompts).map(|_| w.between_text(150, 500)).collect();
    let popularity: Vec<f64> = (0..prompts).map(|k| 1.0 / (k as f64 + 1.0)).collect();
    let tool_sets: Vec<Vec<Tool>> = (0..2)
        .map(|_| {
            let n = w.rng.between(8, 14) as usize;
            (0..n).map(|i| w.tool(i)).collect()
        })
        .collect();
    let agent_systems: Vec<String> = (0..2).map(|_| w.between_text(80, 200)).collect();
    let mut r = Render {
        registry: &registry,
        config,
        tool_sets,
        ids: HashMap::new(),
        fresh: 0,
        out: Vec::with_capacity(requests),
    };
    if requests == 0 {
        return Ok(Trace {
            block_size,
            requests: Vec::new(),
        });
    }
    let kinds: Vec<bool> = (0..sessions)
        .map(|_| w.rng.chance(config.agent_share))
        .collect();
    let turns = divide(&mut w.rng, requests, &kinds);
    let span_ms = requests as f64 / config.rate.max(1e-9) * 1000.0;
    let starts: Vec<f64> = (0..sessions).map(|_| w.rng.unit() * span_ms).collect();
    for s in 0..sessions {
        if kinds[s] {
            let set = w.rng.below(2) as usize;
            agent_session(
                &mut r,
                &mut w,
                starts[s],
                set,
                &agent_systems[set],
                turns[s],
            )?;
        } else {
            let system = &systems[pick_weighted(&mut w.rng, &popularity)];
            chat_session(&mut r, &mut w, starts[s], system, turns[s])?;
        }
    }
    r.out.sort_by_key(|(at, order, _)| (*at, *order));
    Ok(Trace {
        block_size,
        requests: r.out.into_iter().map(|(_, _, request)| request).collect(),
    })
}

fn output_tokens(text: &str) -> u32 {
    // About 1.6 tokens per generated word; only the decode time model reads it.
    (text.split_whitespace().count() as u32 * 8).div_ceil(5)
}

fn chat_session(
    r: &mut Render<'_>,
    w: &mut Writer,
    start_ms: f64,
    system: &str,
    turns: usize,
) -> Result<(), ReplayError> {
    let opening = vec![
        ChatMessage::new("system", system),
        ChatMessage::new("user", w.between_text(20, 300)),
    ];
    let mut session = Session {
        messages: opening.clone(),
        opening,
        tools: None,
    };
    let mut at = start_ms;
    for _ in 0..turns {
        let answer = w.between_text(30, 250);
        let prompt = r.emit(at, &session, output_tokens(&answer))?;
        if prompt > MAX_CONTEXT_TOKENS {
            session.messages = session.opening.clone();
        } else {
            session.messages.push(ChatMessage::new("assistant", answer));
            session
                .messages
                .push(ChatMessage::new("user", w.between_text(20, 300)));
        }
        at += w.rng.exponential(20_000.0);
    }
    Ok(())
}

fn agent_session(
    r: &mut Render<'_>,
    w: &mut Writer,
    start_ms: f64,
    set: usize,
    system: &str,
    turns: usize,
) -> Result<(), ReplayError> {
    let opening = vec![
        ChatMessage::new("system", system),
        ChatMessage::new("user", w.between_text(30, 150)),
    ];
    let mut session = Session {
        messages: opening.clone(),
        opening,
        tools: Some(set),
    };
    let mut at = start_ms;
    for step in 0..turns {
        let tool = &r.tool_sets[set][w.rng.below(r.tool_sets[set].len() as u64) as usize];
        let (name, params) = (tool.name.clone(), tool.params.clone());
        let mut arguments = serde_json::Map::new();
        for p in &params[..w.rng.between(1, params.len() as u64) as usize] {
            arguments.insert(p.clone(), Value::String(w.between_text(1, 6)));
        }
        let arguments = Value::Object(arguments).to_string();
        let result = w.between_text(60, 400);
        let prompt = r.emit(at, &session, output_tokens(&arguments) + 12)?;
        if prompt > MAX_CONTEXT_TOKENS {
            session.messages = session.opening.clone();
        } else if r.config.tools {
            let id = format!("call_{step}");
            let mut call = ChatMessage::new("assistant", "");
            call.tool_calls = Some(vec![json!({
                "id": id,
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            })]);
            let mut answer = ChatMessage::new("tool", result);
            answer.tool_call_id = Some(id);
            answer.name = Some(name);
            session.messages.push(call);
            session.messages.push(answer);
        } else {
            session.messages.push(ChatMessage::new(
                "assistant",
                format!("Calling {name} with {arguments}"),
            ));
            session.messages.push(ChatMessage::new(
                "user",
                format!("Result of {name}: {result}"),
            ));
        }
        at += w.rng.exponential(1_500.0);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::{Policy, SimConfig, replay_trace};

    fn config(model: &str, tools: bool) -> ChatConfig {
        let tokenizers = match std::env::var_os("INFERENCE_CACHE_TOKENIZERS_DIR") {
            Some(dir) => PathBuf::from(dir),
            None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../.cache/tokenizers"),
        };
        assert!(
            tokenizers.join(model).join("tokenizer.json").is_file(),
            "missing tokenizer files under {}: run scripts/setup-tokenizers.sh",
            tokenizers.display()
        );
        ChatConfig {
            tokenizers,
            model: model.into(),
            tools,
            requests: 240,
            sessions: 24,
            system_prompts: 4,
            agent_share: 0.5,
            rate: 8.0,
            block_size: 16,
            seed: 3,
        }
    }

    fn prefix_match_share(result: &crate::PolicyResult) -> f64 {
        result
            .reasons
            .iter()
            .flatten()
            .find(|r| r.code == "PREFIX_MATCH")
            .map_or(0.0, |r| r.share)
    }

    #[test]
    fn the_same_sessions_with_and_without_tools() {
        let with = generate_chat(&config("qwen3", true)).expect("renders");
        let without = generate_chat(&config("qwen3", false)).expect("renders");
        assert_eq!(with.requests.len(), 240);
        assert_eq!(
            with,
            generate_chat(&config("qwen3", true)).expect("renders")
        );
        for trace in [&with, &without] {
            for pair in trace.requests.windows(2) {
                assert!(pair[0].arrival_ms <= pair[1].arrival_ms);
            }
            for r in &trace.requests {
                assert_eq!(r.blocks.len(), r.input_tokens.div_ceil(16) as usize);
            }
        }
        // The tool definitions are in the prompt: the first request of the
        // trace's agent sessions is thousands of tokens longer with them.
        let longest = |t: &Trace| t.requests.iter().map(|r| r.input_tokens).max().unwrap_or(0);
        assert!(longest(&with) > longest(&without) + 1000);
    }

    #[test]
    fn tool_traffic_matches_as_well_as_plain_chat() {
        let sim = SimConfig::new(4, 4000);
        let policies = [Policy::InferenceCache, Policy::PooledOracle];
        let mut rows = Vec::new();
        for tools in [true, false] {
            let trace = generate_chat(&config("qwen3", tools)).expect("renders");
            rows.push(replay_trace(&trace, &policies, &sim, &Default::default()).expect("replays"));
        }
        let (with, without) = (&rows[0][0], &rows[1][0]);
        let (share_with, share_without) = (prefix_match_share(with), prefix_match_share(without));
        assert!(
            share_with > 0.5,
            "PREFIX_MATCH share with tools {share_with}"
        );
        // Tools lose nothing (a longer shared preamble may gain a little).
        assert!(
            share_with >= 0.98 * share_without,
            "PREFIX_MATCH share {share_with} with tools, {share_without} without"
        );
        assert!(
            with.block_hit_rate >= 0.98 * without.block_hit_rate,
            "block hit rate {} with tools, {} without",
            with.block_hit_rate,
            without.block_hit_rate
        );
    }
}
