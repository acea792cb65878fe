//! Unit tests of loading and encoding with a tiny word-level tokenizer.

use super::*;
use crate::clock::FixedClock;
use std::fs;
use std::path::PathBuf;

/// A word-level tokenizer whose post-processor prepends `<s>` (id 0).
const TINY_TOKENIZER: &str = r#"{
  "version": "1.0",
  "truncation": null,
  "padding": null,
  "added_tokens": [
    {"id": 0, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
    {"id": 1, "content": "<unk>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
    {"id": 9, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}
  ],
  "normalizer": null,
  "pre_tokenizer": {"type": "Whitespace"},
  "post_processor": {
    "type": "TemplateProcessing",
    "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
    "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
    "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}}
  },
  "decoder": null,
  "model": {
    "type": "WordLevel",
    "vocab": {"<s>": 0, "<unk>": 1, "hello": 2, "world": 3, "user": 4, "assistant": 5, ":": 6, "system": 7, "|": 8, "</s>": 9},
    "unk_token": "<unk>"
  }
}"#;

const TEMPLATE: &str = "{{ bos_token }}{% for m in messages %}{{ m.role }} : {{ m.content }} | {% endfor %}{% if add_generation_prompt %}assistant :{% endif %}";

struct Models {
    dir: tempfile::TempDir,
}

impl Models {
    fn new() -> Self {
        Self {
            dir: tempfile::tempdir().expect("tempdir"),
        }
    }

    fn add(&self, model: &str, files: &[(&str, &str)]) -> PathBuf {
        let path = self.dir.path().join(model);
        fs::create_dir_all(&path).expect("mkdir");
        for (name, text) in files {
            fs::write(path.join(name), text).expect("write");
        }
        path
    }

    fn load(&self) -> (TokenizerRegistry, Vec<ModelLoadError>) {
        let options = RegistryOptions {
            clock: Arc::new(FixedClock::from_ymd_hms(2026, 1, 2, 3, 4, 5)),
        };
        TokenizerRegistry::load_dir_with(self.dir.path(), &options).expect("dir readable")
    }
}

fn config_with(template: serde_json::Value, bos: serde_json::Value) -> String {
    serde_json::json!({"bos_token": bos, "eos_token": null, "chat_template": template}).to_string()
}

#[test]
fn three_encoders() {
    let models = Models::new();
    models.add(
        "tiny",
        &[
            ("tokenizer.json", TINY_TOKENIZER),
            (
                "tokenizer_config.json",
                &config_with(TEMPLATE.into(), "<s>".into()),
            ),
        ],
    );
    let (registry, failures) = models.load();
    assert!(failures.is_empty(), "{failures:?}");
    assert_eq!(registry.model_ids(), vec!["tiny"]);
    assert!(registry.has_chat_template("tiny"));

    // user : hello | assistant :
    assert_eq!(
        registry
            .encode_prompt_text("tiny", "hello")
            .expect("encodes"),
        vec![0, 4, 6, 2, 8, 5, 6]
    );
    let conversation = [
        ChatMessage::new("system", "world"),
        ChatMessage::new("user", "hello world"),
    ];
    assert_eq!(
        registry
            .render_messages("tiny", &conversation)
            .expect("renders"),
        "<s>system : world | user : hello world | assistant :"
    );
    assert_eq!(
        registry
            .encode_messages("tiny", &conversation)
            .expect("encodes"),
        vec![0, 7, 6, 3, 8, 4, 6, 2, 3, 8, 5, 6]
    );
    // Raw prompts get the post-processor's BOS and no template.
    assert_eq!(
        registry
            .encode_raw_prompt("tiny", "hello world")
            .expect("encodes"),
        vec![0, 2, 3]
    );
}

#[test]
fn template_sources_and_special_token_shapes() {
    let models = Models::new();
    // A list of named templates; BOS given as an AddedToken object.
    models.add(
        "named",
        &[
            ("tokenizer.json", TINY_TOKENIZER),
            (
                "tokenizer_config.json",
                &config_with(
                    serde_json::json!([
                        {"name": "tool_use", "template": "unused"},
                        {"name": "default", "template": TEMPLATE}
                    ]),
                    serde_json::json!({"content": "<s>", "__type": "AddedToken"}),
                ),
            ),
        ],
    );
    // chat_template.jinja wins over the config.
    models.add(
        "jinja",
        &[
            ("tokenizer.json", TINY_TOKENIZER),
            (
                "tokenizer_config.json",
                &config_with("ignored".into(), "<s>".into()),
            ),
            ("chat_template.jinja", "{{ messages[0].content }}"),
        ],
    );
    // No template at all: raw prompts only.
    models.add("bare", &[("tokenizer.json", TINY_TOKENIZER)]);
    let (registry, failures) = models.load();
    assert!(failures.is_empty(), "{failures:?}");
    assert_eq!(registry.model_ids(), vec!["bare", "jinja", "named"]);
    assert_eq!(
        registry
            .encode_prompt_text("named", "hello")
            .expect("encodes"),
        vec![0, 4, 6, 2, 8, 5, 6]
    );
    assert_eq!(
        registry
            .encode_prompt_text("jinja", "world")
            .expect("encodes"),
        vec![3]
    );
    assert_eq!(
        registry.encode_prompt_text("bare", "hello"),
        Err(TokenizeError::NoChatTemplate("bare".to_owned()))
    );
    assert_eq!(
        registry.encode_raw_prompt("bare", "hello").expect("raw"),
        vec![0, 2]
    );
}

#[test]
fn broken_models_are_reported_and_skipped() {
    let models = Models::new();
    models.add("good", &[("tokenizer.json", TINY_TOKENIZER)]);
    models.add("no-tokenizer", &[("tokenizer_config.json", "{}")]);
    models.add("bad-json", &[("tokenizer.json", "{not json")]);
    models.add(
        "bad-template",
        &[
            ("tokenizer.json", TINY_TOKENIZER),
            ("chat_template.jinja", "{% for x in %}"),
        ],
    );
    models.add(
        "bad-config",
        &[
            ("tokenizer.json", TINY_TOKENIZER),
            ("tokenizer_config.json", r#"{"bos_token": 5}"#),
        ],
    );
    fs::write(models.dir.path().join("stray-file.txt"), "x").expect("write");
    let (registry, failures) = models.load();
    assert_eq!(registry.model_ids(), vec!["good"]);
    let mut failed: Vec<(&str, String)> = failures
        .iter()
        .map(|f| (f.model.as_str(), f.kind.to_string()))
        .collect();
    failed.sort();
    let names: Vec<&str> = failed.iter().map(|(m, _)| *m).collect();
    assert_eq!(
        names,
        vec!["bad-config", "bad-json", "bad-template", "no-tokenizer"]
    );
    assert!(failed[3].1.contains("no tokenizer.json"), "{failed:?}");
}

#[test]
fn lookups_never_touch_paths() {
    let models = Models::new();
    models.add("good", &[("tokenizer.json", TINY_TOKENIZER)]);
    let (registry, _) = models.load();
    for model in ["../good", "good/", "/good", "", "GOOD"] {
        assert_eq!(
            registry.encode_raw_prompt(model, "hello"),
            Err(TokenizeError::UnknownModel(model.to_owned()))
        );
    }
    assert!(TokenizerRegistry::empty().is_empty());
}

#[test]
fn template_errors_surface() {
    let models = Models::new();
    models.add(
        "strict",
        &[
            ("tokenizer.json", TINY_TOKENIZER),
            (
                "chat_template.jinja",
                "{% if messages[0].role != 'system' %}{{ raise_exception('system prompt required') }}{% endif %}",
            ),
        ],
    );
    let (registry, _) = models.load();
    match registry.encode_prompt_text("strict", "hello") {
        Err(TokenizeError::Template(message)) => {
            assert!(message.contains("system prompt required"), "{message}");
        }
        other => panic!("expected a template error, got {other:?}"),
    }
}

#[test]
fn registry_is_shareable() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<TokenizerRegistry>();
    assert_send_sync::<Arc<TokenizerRegistry>>();
}

#[test]
fn bos_eos_flags_of_llama_style_classes() {
    let models = Models::new();
    let config = |extra: serde_json::Value| {
        let mut config = serde_json::json!({"bos_token": "<s>", "eos_token": "</s>"});
        if let (Some(base), Some(extra)) = (config.as_object_mut(), extra.as_object()) {
            base.extend(extra.clone());
        }
        config.to_string()
    };
    models.add(
        "llama-both",
        &[
            ("tokenizer.json", TINY_TOKENIZER),
            (
                "tokenizer_config.json",
                &config(serde_json::json!({"tokenizer_class": "LlamaTokenizerFast", "add_eos_token": true})),
            ),
        ],
    );
    models.add(
        "llama-none",
        &[
            ("tokenizer.json", TINY_TOKENIZER),
            (
                "tokenizer_config.json",
                &config(serde_json::json!({"tokenizer_class": "LlamaTokenizer", "add_bos_token": false})),
            ),
        ],
    );
    models.add(
        "neox-default",
        &[
            ("tokenizer.json", TINY_TOKENIZER),
            (
                "tokenizer_config.json",
                &config(serde_json::json!({"tokenizer_class": "GPTNeoXTokenizerFast"})),
            ),
        ],
    );
    models.add(
        "other-class",
        &[
            ("tokenizer.json", TINY_TOKENIZER),
            (
                "tokenizer_config.json",
                &config(serde_json::json!({"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": false})),
            ),
        ],
    );
    models.add(
        "llama-no-bos",
        &[
            ("tokenizer.json", TINY_TOKENIZER),
            (
                "tokenizer_config.json",
                r#"{"tokenizer_class": "LlamaTokenizerFast", "bos_token": null}"#,
            ),
        ],
    );
    let (registry, failures) = models.load();
    assert_eq!(
        registry
            .encode_raw_prompt("llama-both", "hello")
            .expect("raw"),
        vec![0, 2, 9]
    );
    assert_eq!(
        registry
            .encode_raw_prompt("llama-none", "hello")
            .expect("raw"),
        vec![2]
    );
    assert_eq!(
        registry
            .encode_raw_prompt("neox-default", "hello")
            .expect("raw"),
        vec![2]
    );
    // Classes without the rebuild keep tokenizer.json's post-processor (BOS here).
    assert_eq!(
        registry
            .encode_raw_prompt("other-class", "hello")
            .expect("raw"),
        vec![0, 2]
    );
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert_eq!(failures[0].model, "llama-no-bos");
    assert!(
        failures[0].kind.to_string().contains("bos_token"),
        "{}",
        failures[0]
    );
}
