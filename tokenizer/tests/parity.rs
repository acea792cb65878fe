//! Token-for-token parity with Python `transformers` on real tokenizers.
//!
//! `parity/expected_ids.json` holds the ids that `apply_chat_template(messages,
//! add_generation_prompt=True, tokenize=True)` and `tokenizer(text)` produced
//! for every case (see `parity/generate_fixtures.py`); `chat_request` cases are
//! whole OpenAI chat bodies — tools, tool calls and results, content parts,
//! documents, `chat_template_kwargs`, `add_generation_prompt`,
//! `continue_final_message` — that Python prepares as vLLM does before
//! `apply_chat_template(..., tools=..., **kwargs)`. The tokenizer files
//! themselves are not committed: `scripts/setup-tokenizers.sh` fetches them
//! into `.cache/tokenizers/` (or point `INFERENCE_CACHE_TOKENIZERS_DIR` at a
//! directory with the same layout).

use inference_cache_tokenizer::{ChatMessage, ChatOptions, TokenizeError, TokenizerRegistry};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

const MODELS: [&str; 5] = ["qwen3", "llama3", "deepseek_v3", "gemma3", "llama3_1"];

fn manifest_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn tokenizers_dir() -> PathBuf {
    match std::env::var_os("INFERENCE_CACHE_TOKENIZERS_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => manifest_dir().join("../.cache/tokenizers"),
    }
}

fn registry() -> &'static TokenizerRegistry {
    static REGISTRY: OnceLock<TokenizerRegistry> = OnceLock::new();
    REGISTRY.get_or_init(|| {
        let dir = tokenizers_dir();
        for model in MODELS {
            let file = dir.join(model).join("tokenizer.json");
            assert!(
                file.is_file(),
                "missing {}: run scripts/setup-tokenizers.sh (it fetches the Qwen3, Llama-3, \
                 DeepSeek-V3, Gemma 3 and Llama 3.1 tokenizer files into .cache/tokenizers/), or set INFERENCE_CACHE_TOKENIZERS_DIR",
                file.display()
            );
        }
        let (registry, failures) =
            TokenizerRegistry::load_dir(&dir).expect("tokenizers directory is readable");
        assert!(failures.is_empty(), "models failed to load: {failures:?}");
        registry
    })
}

fn fixture() -> &'static Value {
    static FIXTURE: OnceLock<Value> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let path = manifest_dir().join("parity/expected_ids.json");
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|err| panic!("cannot read {}: {err}", path.display()));
        serde_json::from_str(&text).expect("fixture is valid JSON")
    })
}

/// Python's ids for a case, or `None` when its chat template raised.
fn expected_ids(model: &str, case: &str) -> Option<Vec<u32>> {
    let ids = &fixture()["expected"][model][case];
    if ids.is_null() {
        return None;
    }
    let ids = ids
        .as_array()
        .unwrap_or_else(|| panic!("fixture has no ids for {model}/{case}"));
    Some(
        ids.iter()
            .map(|id| {
                id.as_u64()
                    .and_then(|id| u32::try_from(id).ok())
                    .expect("token id")
            })
            .collect(),
    )
}

/// Encodes one fixture case the way its `kind` says.
fn encode(model: &str, case: &Value) -> Result<Vec<u32>, TokenizeError> {
    let registry = registry();
    let text = case["text"].as_str();
    match case["kind"].as_str().expect("case kind") {
        "prompt_text" => registry.encode_prompt_text(model, text.expect("text")),
        "raw_prompt" => registry.encode_raw_prompt(model, text.expect("text")),
        "messages" => {
            let messages: Vec<ChatMessage> = case["messages"]
                .as_array()
                .expect("messages")
                .iter()
                .map(|m| {
                    ChatMessage::new(
                        m["role"].as_str().expect("role"),
                        m["content"].as_str().expect("content"),
                    )
                })
                .collect();
            registry.encode_messages(model, &messages)
        }
        "chat_request" => {
            let (messages, options) = chat_request(&case["request"]);
            registry.encode_chat(model, &messages, &options)
        }
        other => panic!("unknown case kind {other:?}"),
    }
}

/// A fixture's OpenAI chat body as the registry's messages and options.
fn chat_request(request: &Value) -> (Vec<ChatMessage>, ChatOptions) {
    let messages = request["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .map(|m| ChatMessage::from_openai(m).expect("fixture message"))
        .collect();
    let list = |key: &str| request.get(key).and_then(Value::as_array).cloned();
    let options = ChatOptions {
        tools: list("tools"),
        documents: list("documents"),
        add_generation_prompt: request
            .get("add_generation_prompt")
            .and_then(Value::as_bool)
            .unwrap_or(true),
        continue_final_message: request
            .get("continue_final_message")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        template_kwargs: request
            .get("chat_template_kwargs")
            .and_then(Value::as_object)
            .cloned()
            .unwrap_or_default(),
    };
    (messages, options)
}

/// Asserts equality with a message that shows where the ids diverge.
fn assert_same(model: &str, name: &str, actual: &[u32], expected: &[u32]) {
    if actual == expected {
        return;
    }
    let first = actual
        .iter()
        .zip(expected)
        .position(|(a, e)| a != e)
        .unwrap_or(actual.len().min(expected.len()));
    let window = |ids: &[u32]| ids[first.saturating_sub(3)..(first + 5).min(ids.len())].to_vec();
    panic!(
        "{model}/{name}: ids differ from Python transformers at index {first} \
         (rust {} ids, python {} ids)\n  rust:   …{:?}\n  python: …{:?}",
        actual.len(),
        expected.len(),
        window(actual),
        window(expected),
    );
}

fn check_model(model: &str) {
    let cases = fixture()["cases"].as_array().expect("cases");
    assert!(cases.len() >= 10, "fixture has too few cases");
    for case in cases {
        let name = case["name"].as_str().expect("case name");
        match (encode(model, case), expected_ids(model, name)) {
            (Ok(actual), Some(expected)) => assert_same(model, name, &actual, &expected),
            (Err(TokenizeError::Template(_) | TokenizeError::InvalidRequest(_)), None) => {}
            (Err(err), Some(_)) => panic!("{model}/{name}: {err}"),
            (result, None) => {
                panic!("{model}/{name}: Python's template raised, Rust gave {result:?}")
            }
        }
    }
}

#[test]
fn qwen3_matches_transformers() {
    check_model("qwen3");
}

#[test]
fn llama3_matches_transformers() {
    check_model("llama3");
}

#[test]
fn deepseek_v3_matches_transformers() {
    check_model("deepseek_v3");
}

#[test]
fn gemma3_matches_transformers() {
    check_model("gemma3");
}

#[test]
fn llama3_1_matches_transformers() {
    check_model("llama3_1");
}

#[test]
fn fixture_covers_the_required_shapes() {
    let cases = fixture()["cases"].as_array().expect("cases");
    let chat = cases.iter().filter(|c| c["kind"] != "raw_prompt").count();
    assert!(chat >= 10, "at least 10 conversations, found {chat}");
    let raw = cases.iter().filter(|c| c["kind"] == "raw_prompt").count();
    assert!(raw >= 3, "raw prompts present, found {raw}");
    for model in MODELS {
        assert!(
            expected_ids(model, "prompt_long_8k").map_or(0, |ids| ids.len()) >= 7_500,
            "{model}: the long case must be about 8k tokens"
        );
    }
    // Agent traffic: multi-step tool loops rendered with tools on the models
    // whose templates have a tool format, thinking on and off for Qwen3.
    let requests: Vec<&Value> = cases
        .iter()
        .filter(|c| c["kind"] == "chat_request")
        .collect();
    let steps = requests
        .iter()
        .filter(|c| {
            let messages = c["request"]["messages"].as_array().expect("messages");
            let calls = messages
                .iter()
                .filter(|m| m.get("tool_calls").is_some())
                .count();
            let results = messages.iter().filter(|m| m["role"] == "tool").count();
            calls >= 2 && results >= 2
        })
        .count();
    assert!(
        steps >= 2,
        "multi-step agent conversations present, found {steps}"
    );
    for kwargs in [
        serde_json::json!({"enable_thinking": false}),
        serde_json::json!({"enable_thinking": true}),
    ] {
        assert!(
            requests
                .iter()
                .any(|c| c["request"]["chat_template_kwargs"] == kwargs
                    && c["request"].get("tools").is_some()),
            "a tool case with chat_template_kwargs {kwargs}"
        );
    }
    for model in ["qwen3", "llama3_1"] {
        for step in [
            "agent_step1",
            "agent_step2",
            "agent_step3",
            "agent_many_tools_step3",
        ] {
            assert!(
                expected_ids(model, step).is_some(),
                "{model}/{step}: Python must render it"
            );
        }
        assert!(
            expected_ids(model, "agent_many_tools_step1").map_or(0, |ids| ids.len()) >= 4_000,
            "{model}: the tool list must be a 4k-token preamble"
        );
    }
}

/// The committed fixture is exactly what the Python generator produces from the
/// fetched tokenizer files (so a changed case list cannot go unregenerated).
#[test]
fn fixture_matches_python_generator() {
    let python = manifest_dir().join("../.cache/venv/bin/python");
    assert!(
        python.is_file(),
        "missing {}: run scripts/setup-tokenizers.sh (it creates the venv with transformers)",
        python.display()
    );
    let output = Command::new(&python)
        .arg(manifest_dir().join("parity/generate_fixtures.py"))
        .arg("--check")
        .env("INFERENCE_CACHE_TOKENIZERS_DIR", tokenizers_dir())
        .output()
        .expect("python runs");
    assert!(
        output.status.success(),
        "parity/expected_ids.json differs from what transformers produces:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}
