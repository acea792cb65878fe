//! Full chat requests and cache salts over a real socket.
//!
//! - An agent loop sent as the body's verbatim JSON (`messages_json`,
//!   `tools_json`, `chat_template_kwargs_json`) is tokenized exactly as the
//!   tokenizer crate renders it (itself held to Python `transformers` by the
//!   parity fixtures), so step 2 matches the blocks the engine stored for step 1.
//! - Malformed JSON fields, media content and requests the engine would refuse
//!   answer NO_HINT and are counted by reason.
//! - A salted lookup matches only blocks reported under the same salt's
//!   partition (`fingerprint::partition_key`), for every input mode.
//!
//! Uses the real Qwen3 tokenizer that `scripts/setup-tokenizers.sh` fetches.

use crate::contract_support;

use contract_support::*;
use inference_cache_fingerprint::{partition_key, request_chain};
use inference_cache_proto::reason;
use inference_cache_proto::v1alpha1::{CacheStateUpdate, LookupRouteRequest, PrefixEntry};
use inference_cache_tokenizer::{ChatMessage, ChatOptions, TokenizerRegistry};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};

const MODEL: &str = "qwen3";
const BLOCK: u32 = 16;

fn qwen3_dir() -> PathBuf {
    let dir = match std::env::var_os("INFERENCE_CACHE_TOKENIZERS_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../.cache/tokenizers"),
    }
    .join(MODEL);
    assert!(
        dir.join("tokenizer.json").is_file(),
        "missing {}: run scripts/setup-tokenizers.sh",
        dir.display()
    );
    dir
}

/// A models directory holding only Qwen3 (linked, not copied).
fn models_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    std::os::unix::fs::symlink(qwen3_dir(), dir.path().join(MODEL)).expect("symlink");
    dir
}

async fn start(models: &Path) -> Harness {
    let models = models.to_path_buf();
    Harness::start_with("", move |config| {
        config.prompts.tokenizer_models_dir = Some(models);
        config.index.engine_block_size = BLOCK as usize;
    })
    .await
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
        {"type": "function", "function": {"name": "search_docs", "description": "Search the runbooks.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"},
                "limit": {"type": "integer"}}, "required": ["query"]}}}
    ])
}

fn step1() -> Value {
    json!([
        {"role": "system", "content": "You are an SRE agent. Use the tools; be brief."},
        {"role": "user", "content": "Is it raining in Zürich, and what do the runbooks say about rain?"}
    ])
}

fn step2() -> Value {
    let mut messages = step1().as_array().cloned().expect("array");
    messages.push(json!({"role": "assistant", "content": null, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Zürich\"}"}}]}));
    messages.push(json!({"role": "tool", "tool_call_id": "call_1", "content": "{\"rain\": true}"}));
    Value::Array(messages)
}

fn chat_lookup(messages: &Value, tools: Option<&Value>) -> LookupRouteRequest {
    LookupRouteRequest {
        model_id: MODEL.into(),
        tenant_id: T.into(),
        hash_scheme: S.into(),
        messages_json: messages.to_string(),
        tools_json: tools.map(Value::to_string).unwrap_or_default(),
        chat_template_kwargs_json: r#"{"enable_thinking": false}"#.into(),
        ..Default::default()
    }
}

/// The ids the engine would compute for a request, from the tokenizer crate.
fn engine_ids(models: &Path, messages: &Value, tools: Option<&Value>) -> Vec<u32> {
    let (registry, failures) = TokenizerRegistry::load_dir(models).expect("models dir");
    assert!(failures.is_empty(), "{failures:?}");
    let messages: Vec<ChatMessage> = messages
        .as_array()
        .expect("array")
        .iter()
        .map(|m| ChatMessage::from_openai(m).expect("message"))
        .collect();
    let mut options = ChatOptions {
        tools: tools.and_then(Value::as_array).cloned(),
        ..ChatOptions::default()
    };
    options
        .template_kwargs
        .insert("enable_thinking".into(), json!(false));
    registry
        .encode_chat(MODEL, &messages, &options)
        .expect("renders")
}

/// Reports that `replica` holds the full blocks of `ids` in `partition`.
fn holds(replica: &str, ids: &[u32], partition: &str) -> CacheStateUpdate {
    let chain = request_chain(ids, BLOCK as usize);
    CacheStateUpdate {
        replica_id: replica.into(),
        model_id: MODEL.into(),
        tenant_id: T.into(),
        hash_scheme: S.into(),
        prefixes: vec![PrefixEntry {
            block_hashes: chain.block_hashes.iter().map(|h| h.to_vec()).collect(),
            block_token_counts: chain.block_token_counts.clone(),
            ..Default::default()
        }],
        adapter_id: partition.into(),
        ..Default::default()
    }
}

#[tokio::test]
async fn agent_step_two_matches_the_blocks_of_step_one() {
    let models = models_dir();
    let mut h = start(models.path()).await;
    let tools = tools();
    let stored = engine_ids(models.path(), &step1(), Some(&tools));
    h.report(vec![holds("replica-a", &stored, "")]).await;

    let next = engine_ids(models.path(), &step2(), Some(&tools));
    let r = h.lookup(chat_lookup(&step2(), Some(&tools))).await;
    assert_eq!(r.reason_code, reason::PREFIX_MATCH);
    assert_eq!(
        r.token_ids, next,
        "the server renders what the engine renders"
    );
    assert_eq!(ids(&r), vec!["replica-a"]);
    // Everything step 1 stored up to where the two prompts part is matched.
    let common = stored.iter().zip(&next).take_while(|(a, b)| a == b).count();
    let expected = (common / BLOCK as usize * BLOCK as usize) as i32;
    assert!(
        expected >= 200,
        "the tool preamble is shared ({common} tokens)"
    );
    assert_eq!(r.replica_scores[0].matched_tokens, expected);

    // Without the tools the prompt parts from step 1 right after the system
    // text: at most the blocks before the tool preamble match.
    let bare = h.lookup(chat_lookup(&step2(), None)).await;
    let bare_matched = bare.replica_scores.first().map_or(0, |s| s.matched_tokens);
    assert!(
        bare_matched < 64,
        "matched {bare_matched} tokens without tools"
    );

    // The structured `messages` field takes the same options.
    let structured = LookupRouteRequest {
        messages: vec![
            inference_cache_proto::v1alpha1::ChatMessage {
                role: "system".into(),
                content: "You are an SRE agent. Use the tools; be brief.".into(),
            },
            inference_cache_proto::v1alpha1::ChatMessage {
                role: "user".into(),
                content: "Is it raining in Zürich, and what do the runbooks say about rain?".into(),
            },
        ],
        messages_json: String::new(),
        ..chat_lookup(&step1(), Some(&tools))
    };
    let r = h.lookup(structured).await;
    assert_eq!(r.token_ids, stored);
    assert_eq!(r.reason_code, reason::PREFIX_MATCH);
    h.stop().await;
}

#[tokio::test]
async fn malformed_chat_fields_fail_open_and_are_counted() {
    let models = models_dir();
    let mut h = start(models.path()).await;
    let tools = tools();
    h.report(vec![holds(
        "replica-a",
        &engine_ids(models.path(), &step1(), Some(&tools)),
        "",
    )])
    .await;
    let image = json!([{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]);
    let cases: Vec<(&str, LookupRouteRequest)> = vec![
        (
            "bad_messages_json",
            LookupRouteRequest {
                messages_json: "[{\"role\": ".into(),
                ..chat_lookup(&step1(), Some(&tools))
            },
        ),
        (
            "bad_messages_json",
            LookupRouteRequest {
                messages_json: "{\"role\": \"user\"}".into(),
                ..chat_lookup(&step1(), Some(&tools))
            },
        ),
        (
            "bad_tools_json",
            LookupRouteRequest {
                tools_json: "{\"type\": \"function\"}".into(),
                ..chat_lookup(&step1(), Some(&tools))
            },
        ),
        (
            "bad_chat_template_kwargs_json",
            LookupRouteRequest {
                chat_template_kwargs_json: "[true]".into(),
                ..chat_lookup(&step1(), Some(&tools))
            },
        ),
        (
            "bad_documents_json",
            LookupRouteRequest {
                documents_json: "not json".into(),
                ..chat_lookup(&step1(), Some(&tools))
            },
        ),
        ("unsupported_content", chat_lookup(&image, None)),
        (
            "invalid_chat_request",
            LookupRouteRequest {
                continue_final_message: true,
                ..chat_lookup(&step1(), Some(&tools))
            },
        ),
        (
            "invalid_chat_request",
            LookupRouteRequest {
                tools_json: r#"[{"type": "function", "function": {"description": "no name"}}]"#
                    .into(),
                ..chat_lookup(&step1(), Some(&tools))
            },
        ),
    ];
    for (expected, request) in cases {
        let r = h.lookup(request).await;
        assert_eq!(r.reason_code, reason::NO_HINT, "{expected}");
        assert!(r.replica_scores.is_empty() && r.token_ids.is_empty());
    }
    for (label, count) in [
        ("bad_messages_json", 2.0),
        ("bad_tools_json", 1.0),
        ("bad_chat_template_kwargs_json", 1.0),
        ("bad_documents_json", 1.0),
        ("unsupported_content", 1.0),
        ("invalid_chat_request", 2.0),
    ] {
        let series = format!("inferencecache_tokenize_failure_total{{reason=\"{label}\"}}");
        assert_eq!(h.metric(&series).await, Some(count), "{series}");
    }
    // The server still answers well-formed requests.
    let r = h.lookup(chat_lookup(&step1(), Some(&tools))).await;
    assert_eq!(r.reason_code, reason::PREFIX_MATCH);
    h.stop().await;
}

#[tokio::test]
async fn salted_lookups_match_only_their_salt() {
    let mut h = Harness::start("").await;
    let blocks = chain(0..4);
    let salted = |salt: &str, adapter: &str| {
        let mut update = update(
            &format!("replica-{}{salt}", adapter.len()),
            vec![chain_entry(&blocks, 64)],
        );
        update.adapter_id = partition_key(adapter, salt).into_owned();
        update
    };
    h.report(vec![
        salted("", ""),
        salted("tenant-a-salt", ""),
        salted("tenant-b-salt", ""),
        salted("tenant-a-salt", "sql-lora"),
    ])
    .await;
    let look = |salt: &str, adapter: &str| LookupRouteRequest {
        cache_salt: salt.into(),
        adapter_id: adapter.into(),
        ..chain_lookup(&blocks)
    };
    for (salt, adapter, holder) in [
        ("", "", "replica-0"),
        ("tenant-a-salt", "", "replica-0tenant-a-salt"),
        ("tenant-b-salt", "", "replica-0tenant-b-salt"),
        ("tenant-a-salt", "sql-lora", "replica-8tenant-a-salt"),
    ] {
        let r = h.lookup(look(salt, adapter)).await;
        assert_eq!(r.reason_code, reason::PREFIX_MATCH, "{salt}/{adapter}");
        assert_eq!(ids(&r), vec![holder], "{salt}/{adapter}");
        assert_eq!(r.adapter_id, adapter, "the salt never echoes back");
    }
    // A salt nobody stored under matches nothing, and neither does a salted
    // adapter that only has unsalted or differently salted blocks.
    for (salt, adapter) in [
        ("tenant-c-salt", ""),
        ("tenant-b-salt", "sql-lora"),
        ("", "sql-lora"),
    ] {
        let r = h.lookup(look(salt, adapter)).await;
        assert_ne!(r.reason_code, reason::PREFIX_MATCH, "{salt}/{adapter}");
        assert!(
            r.replica_scores.iter().all(|s| s.matched_tokens == 0),
            "{salt}/{adapter}: {:?}",
            r.replica_scores
        );
    }
    // Token ids and exact hashes are partitioned the same way.
    let r = h
        .lookup(LookupRouteRequest {
            cache_salt: "tenant-c-salt".into(),
            ..exact_lookup(7, 64)
        })
        .await;
    assert_ne!(r.reason_code, reason::PREFIX_MATCH);
    h.stop().await;
}
