//! The registry of loaded models and the three prompt encoders.
//!
//! [`TokenizerRegistry::load_dir`] reads every subdirectory of the models
//! directory once, at start-up: `tokenizer.json` (required), the chat
//! template (`chat_template.jinja`, else `tokenizer_config.json`'s
//! `chat_template` — a string, or a list of `{name, template}` of which
//! `default` is used) and the special tokens (`bos_token`, `eos_token`, … as
//! strings or `{"content": …}` objects; `special_tokens_map.json` overrides
//! the config as in `transformers`). For the `transformers` classes that
//! rebuild the post-processor from `add_bos_token` / `add_eos_token` (Llama,
//! CodeLlama, Gemma, Cohere, GPT-NeoX) the same rebuild happens here, so raw
//! prompts get exactly the special tokens Python adds. A directory that fails
//! is returned as a [`ModelLoadError`], logged, and skipped; the others still
//! load.
//!
//! Requests name a model id that is only ever looked up in the in-memory map:
//! nothing here joins a request string onto a path or touches the disk after
//! loading.
//!
//! Concurrency and cost: the registry is immutable after loading and
//! `Send + Sync`; share it with `Arc`. Encoding is synchronous and CPU-bound
//! (template rendering is microseconds; BPE is roughly linear in text length),
//! so async callers should run it on a blocking pool with a deadline.

use crate::chat_template::ChatTemplate;
use crate::clock::{Clock, SystemClock};
use crate::conversation::{self, ChatMessage, ChatOptions};
use crate::error::{LoadError, ModelLoadError, ModelLoadErrorKind, TokenizeError};
use minijinja::Value;
use std::collections::HashMap;
use std::fmt;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;
use tokenizers::Tokenizer;

/// Special-token keys `transformers` exposes to chat templates as variables.
const SPECIAL_TOKEN_KEYS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// Options for loading a registry.
#[derive(Clone)]
pub struct RegistryOptions {
    /// Clock read by the `strftime_now` template global.
    pub clock: Arc<dyn Clock>,
}

impl Default for RegistryOptions {
    fn default() -> Self {
        Self {
            clock: Arc::new(SystemClock),
        }
    }
}

impl fmt::Debug for RegistryOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegistryOptions").finish_non_exhaustive()
    }
}

/// One loaded model.
#[derive(Debug)]
struct Model {
    tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
}

/// Tokenizers and chat templates of every model loaded at start-up.
#[derive(Debug, Default)]
pub struct TokenizerRegistry {
    models: HashMap<String, Model>,
}

impl TokenizerRegistry {
    /// A registry with no models: every lookup is [`TokenizeError::UnknownModel`].
    pub fn empty() -> Self {
        Self::default()
    }

    /// Loads every model subdirectory of `dir` with the system clock.
    ///
    /// Returns the registry and the directories that were skipped. Fails only
    /// when `dir` itself cannot be listed.
    pub fn load_dir(dir: &Path) -> Result<(Self, Vec<ModelLoadError>), LoadError> {
        Self::load_dir_with(dir, &RegistryOptions::default())
    }

    /// [`load_dir`](Self::load_dir) with explicit options.
    pub fn load_dir_with(
        dir: &Path,
        options: &RegistryOptions,
    ) -> Result<(Self, Vec<ModelLoadError>), LoadError> {
        let io_error = |source| LoadError {
            path: dir.to_path_buf(),
            source,
        };
        let mut entries = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(io_error)? {
            let entry = entry.map_err(io_error)?;
            let path = entry.path();
            // Follows symlinks: a model may be linked in from elsewhere.
            if !path.is_dir() {
                continue;
            }
            let name = entry.file_name();
            if name.to_string_lossy().starts_with('.') {
                continue;
            }
            entries.push((name, path));
        }
        entries.sort();

        let mut registry = Self::default();
        let mut failures = Vec::new();
        for (name, path) in entries {
            let Some(model_id) = name.to_str().map(str::to_owned) else {
                let error = ModelLoadError {
                    model: name.to_string_lossy().into_owned(),
                    path,
                    kind: ModelLoadErrorKind::InvalidName,
                };
                tracing::warn!(error = %error, "skipping tokenizer model");
                failures.push(error);
                continue;
            };
            let started = Instant::now();
            match load_model(&path, options) {
                Ok((model, bytes)) => {
                    tracing::info!(
                        model = %model_id,
                        vocab_size = model.tokenizer.get_vocab_size(true),
                        tokenizer_bytes = bytes,
                        chat_template = model.template.is_some(),
                        load_ms = started.elapsed().as_secs_f64() * 1e3,
                        "tokenizer model loaded"
                    );
                    registry.models.insert(model_id, model);
                }
                Err(kind) => {
                    let error = ModelLoadError {
                        model: model_id,
                        path,
                        kind,
                    };
                    tracing::warn!(error = %error, "skipping tokenizer model");
                    failures.push(error);
                }
            }
        }
        tracing::info!(
            dir = %dir.display(),
            loaded = registry.models.len(),
            skipped = failures.len(),
            "tokenizer models loaded"
        );
        Ok((registry, failures))
    }

    /// Ids of the loaded models, sorted.
    pub fn model_ids(&self) -> Vec<&str> {
        let mut ids: Vec<&str> = self.models.keys().map(String::as_str).collect();
        ids.sort_unstable();
        ids
    }

    /// Whether `model` is loaded.
    pub fn contains(&self, model: &str) -> bool {
        self.models.contains_key(model)
    }

    /// Whether `model` is loaded and has a chat template.
    pub fn has_chat_template(&self, model: &str) -> bool {
        self.models.get(model).is_some_and(|m| m.template.is_some())
    }

    /// Number of loaded models.
    pub fn len(&self) -> usize {
        self.models.len()
    }

    /// True when no model is loaded.
    pub fn is_empty(&self) -> bool {
        self.models.is_empty()
    }

    /// Tokens of a single-turn prompt: `text` as one user message, chat
    /// template applied with the assistant generation prompt appended.
    pub fn encode_prompt_text(&self, model: &str, text: &str) -> Result<Vec<u32>, TokenizeError> {
        self.encode_messages(model, &[ChatMessage::new("user", text)])
    }

    /// Tokens of a whole conversation with the generation prompt appended, as
    /// the engine tokenizes a `/v1/chat/completions` request.
    pub fn encode_messages(
        &self,
        model: &str,
        messages: &[ChatMessage],
    ) -> Result<Vec<u32>, TokenizeError> {
        self.encode_chat(model, messages, &ChatOptions::default())
    }

    /// Tokens of a full chat request — tools, tool calls, documents,
    /// `add_generation_prompt`, `continue_final_message` and
    /// `chat_template_kwargs` — as the engine tokenizes it (see
    /// [`crate::ChatOptions`] and the `conversation` module for what is
    /// normalized the way vLLM does).
    pub fn encode_chat(
        &self,
        model: &str,
        messages: &[ChatMessage],
        options: &ChatOptions,
    ) -> Result<Vec<u32>, TokenizeError> {
        let entry = self.model(model)?;
        let text = render(entry, model, messages, options)?;
        // The rendered text already carries BOS and the other special tokens.
        encode(&entry.tokenizer, &text, false)
    }

    /// The text the chat template renders for a full chat request, before tokenization.
    pub fn render_chat(
        &self,
        model: &str,
        messages: &[ChatMessage],
        options: &ChatOptions,
    ) -> Result<String, TokenizeError> {
        render(self.model(model)?, model, messages, options)
    }

    /// Tokens of a completion-style prompt: no template, the tokenizer's own
    /// special tokens added, as the engine tokenizes a `/v1/completions` string.
    pub fn encode_raw_prompt(&self, model: &str, text: &str) -> Result<Vec<u32>, TokenizeError> {
        encode(&self.model(model)?.tokenizer, text, true)
    }

    /// The text the chat template renders for `messages` (generation prompt
    /// appended), before tokenization.
    pub fn render_messages(
        &self,
        model: &str,
        messages: &[ChatMessage],
    ) -> Result<String, TokenizeError> {
        render(self.model(model)?, model, messages, &ChatOptions::default())
    }

    fn model(&self, model: &str) -> Result<&Model, TokenizeError> {
        self.models
            .get(model)
            .ok_or_else(|| TokenizeError::UnknownModel(model.to_owned()))
    }
}

fn render(
    entry: &Model,
    model: &str,
    messages: &[ChatMessage],
    options: &ChatOptions,
) -> Result<String, TokenizeError> {
    let template = entry
        .template
        .as_ref()
        .ok_or_else(|| TokenizeError::NoChatTemplate(model.to_owned()))?;
    let mut context = conversation::template_variables(options)?;
    let mut messages = conversation::conversation(messages, template.content_format())?;
    let final_message = if options.continue_final_message {
        Some(conversation::mark_final_message(&mut messages)?)
    } else {
        None
    };
    let tools = match &options.tools {
        Some(tools) => serde_json::Value::Array(conversation::normalize_tools(tools)?),
        None => serde_json::Value::Null,
    };
    context.insert("messages".to_owned(), serde_json::Value::Array(messages));
    context.insert("tools".to_owned(), tools);
    let rendered = template
        .render_context(&context)
        .map_err(|err| TokenizeError::Template(template_error_message(&err)))?;
    match final_message {
        Some(final_message) => conversation::cut_after_final_message(rendered, &final_message),
        None => Ok(rendered),
    }
}

fn encode(
    tokenizer: &Tokenizer,
    text: &str,
    add_special_tokens: bool,
) -> Result<Vec<u32>, TokenizeError> {
    tokenizer
        .encode(text, add_special_tokens)
        .map(|encoding| encoding.get_ids().to_vec())
        .map_err(|err| TokenizeError::Encode(err.to_string()))
}

/// The error and its causes on one line (minijinja keeps the detail in the chain).
fn template_error_message(err: &minijinja::Error) -> String {
    let mut message = err.to_string();
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        message.push_str(": ");
        message.push_str(&cause.to_string());
        source = cause.source();
    }
    message
}

/// Loads one model directory; returns the model and the tokenizer file size.
fn load_model(dir: &Path, options: &RegistryOptions) -> Result<(Model, u64), ModelLoadErrorKind> {
    let tokenizer_path = dir.join("tokenizer.json");
    if !tokenizer_path.is_file() {
        return Err(ModelLoadErrorKind::MissingTokenizer);
    }
    let bytes = std::fs::metadata(&tokenizer_path)
        .map_err(|source| ModelLoadErrorKind::Io {
            file: "tokenizer.json",
            source,
        })?
        .len();
    let mut tokenizer = Tokenizer::from_file(&tokenizer_path)
        .map_err(|err| ModelLoadErrorKind::Tokenizer(err.to_string()))?;

    let config = read_json(dir, "tokenizer_config.json")?;
    let special_map = read_json(dir, "special_tokens_map.json")?;

    let jinja_path = dir.join("chat_template.jinja");
    let source = if jinja_path.is_file() {
        Some(
            std::fs::read_to_string(&jinja_path).map_err(|source| ModelLoadErrorKind::Io {
                file: "chat_template.jinja",
                source,
            })?,
        )
    } else {
        config
            .as_ref()
            .map(config_chat_template)
            .transpose()?
            .flatten()
    };

    let mut special = HashMap::new();
    for key in SPECIAL_TOKEN_KEYS {
        let value = special_map
            .as_ref()
            .and_then(|map| map.get(key))
            .or_else(|| config.as_ref().and_then(|c| c.get(key)));
        if let Some(value) = value
            && let Some(token) = token_content(key, value)?
        {
            special.insert(key, token);
        }
    }
    if let Some(config) = &config {
        apply_bos_eos_flags(&mut tokenizer, config, &special)?;
    }
    let mut globals: Vec<(String, Value)> = SPECIAL_TOKEN_KEYS
        .iter()
        .filter_map(|key| Some(((*key).to_owned(), Value::from(special.get(key)?.clone()))))
        .collect();
    let additional = special_map
        .as_ref()
        .and_then(|map| map.get("additional_special_tokens"))
        .or_else(|| {
            config
                .as_ref()
                .and_then(|c| c.get("additional_special_tokens"))
        });
    if let Some(serde_json::Value::Array(items)) = additional {
        let mut tokens = Vec::with_capacity(items.len());
        for item in items {
            if let Some(token) = token_content("additional_special_tokens", item)? {
                tokens.push(Value::from(token));
            }
        }
        globals.push(("additional_special_tokens".to_owned(), Value::from(tokens)));
    }

    let template = source
        .map(|source| {
            ChatTemplate::compile(&source, globals, Arc::clone(&options.clock))
                .map_err(|err| ModelLoadErrorKind::Template(template_error_message(&err)))
        })
        .transpose()?;
    Ok((
        Model {
            tokenizer,
            template,
        },
        bytes,
    ))
}

/// `transformers` tokenizer classes whose fast tokenizer replaces the
/// `tokenizer.json` post-processor at load time with one built from the
/// config's `add_bos_token` / `add_eos_token` (the bool is the class default
/// for `add_bos_token`; `add_eos_token` defaults to false for all of them).
const BOS_EOS_CLASSES: [(&str, bool); 5] = [
    ("LlamaTokenizer", true),
    ("CodeLlamaTokenizer", true),
    ("GemmaTokenizer", true),
    ("CohereTokenizer", true),
    ("GPTNeoXTokenizer", false),
];

/// Makes raw-prompt encoding add BOS/EOS exactly as `transformers` does for
/// the classes in [`BOS_EOS_CLASSES`]; other classes keep `tokenizer.json`'s
/// own post-processor.
fn apply_bos_eos_flags(
    tokenizer: &mut Tokenizer,
    config: &serde_json::Value,
    special: &HashMap<&str, String>,
) -> Result<(), ModelLoadErrorKind> {
    let Some(class) = config
        .get("tokenizer_class")
        .and_then(serde_json::Value::as_str)
    else {
        return Ok(());
    };
    let class = class.strip_suffix("Fast").unwrap_or(class);
    let Some((_, bos_default)) = BOS_EOS_CLASSES.iter().find(|(name, _)| *name == class) else {
        return Ok(());
    };
    let flag = |key: &str, default: bool| {
        config
            .get(key)
            .and_then(serde_json::Value::as_bool)
            .unwrap_or(default)
    };
    let mut added = Vec::new();
    for (key, token_key, default) in [
        ("add_bos_token", "bos_token", *bos_default),
        ("add_eos_token", "eos_token", false),
    ] {
        if !flag(key, default) {
            added.push(None);
            continue;
        }
        let token = special.get(token_key).ok_or_else(|| {
            ModelLoadErrorKind::Config(format!("{key} is true but {token_key} is not set"))
        })?;
        let id = tokenizer.token_to_id(token).ok_or_else(|| {
            ModelLoadErrorKind::Config(format!("{token_key} {token:?} is not in the vocabulary"))
        })?;
        added.push(Some((token.clone(), id)));
    }
    let (bos, eos) = (added[0].clone(), added[1].clone());
    let piece = |token: &Option<(String, u32)>, type_id: u32| {
        token.as_ref().map(
            |(content, _)| serde_json::json!({"SpecialToken": {"id": content, "type_id": type_id}}),
        )
    };
    let sequence =
        |id: &str, type_id: u32| serde_json::json!({"Sequence": {"id": id, "type_id": type_id}});
    let single: Vec<serde_json::Value> = [piece(&bos, 0), Some(sequence("A", 0)), piece(&eos, 0)]
        .into_iter()
        .flatten()
        .collect();
    let mut pair = single.clone();
    pair.extend(
        [piece(&bos, 1), Some(sequence("B", 1)), piece(&eos, 1)]
            .into_iter()
            .flatten(),
    );
    let mut special_tokens = serde_json::Map::new();
    for (content, id) in added.iter().flatten() {
        special_tokens.insert(
            content.clone(),
            serde_json::json!({"id": content, "ids": [id], "tokens": [content]}),
        );
    }
    let processor: tokenizers::processors::template::TemplateProcessing =
        serde_json::from_value(serde_json::json!({
            "type": "TemplateProcessing",
            "single": single,
            "pair": pair,
            "special_tokens": special_tokens,
        }))
        .map_err(|err| ModelLoadErrorKind::Tokenizer(format!("post-processor: {err}")))?;
    tokenizer.with_post_processor(Some(processor));
    Ok(())
}

/// Parses an optional JSON file of the model directory.
fn read_json(
    dir: &Path,
    file: &'static str,
) -> Result<Option<serde_json::Value>, ModelLoadErrorKind> {
    let path = dir.join(file);
    if !path.is_file() {
        return Ok(None);
    }
    let text =
        std::fs::read_to_string(&path).map_err(|source| ModelLoadErrorKind::Io { file, source })?;
    let value = serde_json::from_str(&text)
        .map_err(|err| ModelLoadErrorKind::Config(format!("{file}: {err}")))?;
    Ok(Some(value))
}

/// `chat_template` of `tokenizer_config.json`: a string, or a list of named
/// templates of which `default` is used.
fn config_chat_template(config: &serde_json::Value) -> Result<Option<String>, ModelLoadErrorKind> {
    match config.get("chat_template") {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(source)) => Ok(Some(source.clone())),
        Some(serde_json::Value::Array(named)) => {
            for entry in named {
                let name = entry.get("name").and_then(serde_json::Value::as_str);
                let template = entry.get("template").and_then(serde_json::Value::as_str);
                match (name, template) {
                    (Some("default"), Some(source)) => return Ok(Some(source.to_owned())),
                    (Some(_), Some(_)) => {}
                    _ => {
                        return Err(ModelLoadErrorKind::Config(
                            "chat_template list entries need string `name` and `template`"
                                .to_owned(),
                        ));
                    }
                }
            }
            Err(ModelLoadErrorKind::Config(
                "chat_template list has no `default` template".to_owned(),
            ))
        }
        Some(_) => Err(ModelLoadErrorKind::Config(
            "chat_template must be a string or a list of named templates".to_owned(),
        )),
    }
}

/// A special token given as a string, `{"content": …}`, or null.
fn token_content(
    key: &str,
    value: &serde_json::Value,
) -> Result<Option<String>, ModelLoadErrorKind> {
    match value {
        serde_json::Value::Null => Ok(None),
        serde_json::Value::String(token) => Ok(Some(token.clone())),
        serde_json::Value::Object(object) => match object.get("content") {
            Some(serde_json::Value::String(token)) => Ok(Some(token.clone())),
            _ => Err(ModelLoadErrorKind::Config(format!(
                "{key}: object without a string `content`"
            ))),
        },
        _ => Err(ModelLoadErrorKind::Config(format!(
            "{key}: expected a string or an object"
        ))),
    }
}

#[cfg(test)]
mod tests;
