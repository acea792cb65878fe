//! Token-for-token parity with Python `transformers` on real tokenizers.
//!
//! `parity/expected_ids.json` holds the ids that `apply_chat_template(messages,
//! add_generation_prompt=True, tokenize=True)` and `tokenizer(text)` produced
//! for every case (see `parity/generate_fixtures.py`). The tokenizer files
//! themselves are not committed: `scripts/setup-tokenizers.sh` fetches them
//! into `.cache/tokenizers/` (or point `INFERENCE_CACHE_TOKENIZERS_DIR` at a
//! directory with the same layout).

use inference_cache_tokenizer::{ChatMessage, TokenizeError, TokenizerRegistry};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

const MODELS: [&str; 4] = ["qwen3", "llama3", "deepseek_v3", "gemma3"];

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
                 DeepSeek-V3 and Gemma 3 tokenizer files into .cache/tokenizers/), or set INFERENCE_CACHE_TOKENIZERS_DIR",
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
        other => panic!("unknown case kind {other:?}"),
    }
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
            (Err(TokenizeError::Template(_)), None) => {}
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
