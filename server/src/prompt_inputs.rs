//! Server-side prompt inputs: the tokenizer registry that turns `prompt_text`,
//! `messages` / `messages_json` (with `tools_json`, `chat_template_kwargs_json`,
//! `documents_json`, `add_generation_prompt`, `continue_final_message`) and
//! `raw_prompt` into token ids, and the PromptTemplate store behind
//! RenderTemplate.
//!
//! The JSON fields are parsed on the blocking pool together with the
//! rendering, never on the async core threads. A field that is not the JSON
//! it should be, a request the engine itself would refuse, or content the
//! server cannot tokenize (images, audio) is a fail-open answer (NO_HINT),
//! counted in `tokenize_failure_total{reason}`.
//!
//! Tokenization is CPU-bound, so it runs on tokio's blocking pool under a
//! deadline (the tenant's `lookupTimeoutMs`, else `--tokenize-timeout`, and
//! never past the caller's gRPC deadline): a slow prompt never stalls the
//! async core threads that serve ingest and other lookups. At most
//! `--tokenize-concurrency` tokenizations run at once; a lookup arriving when
//! every slot is taken answers TIMEOUT at once instead of queueing. A
//! tokenizer call cannot be interrupted, so one that outlives its deadline
//! keeps its slot until it returns; its work is bounded by `--max-prompt-bytes`
//! (checked before it starts) and, for chat templates, by the template fuel. Tokenizers are
//! loaded once at start-up; a request's model id is only looked up in the
//! loaded map. Templates are re-read when the directory changes and on
//! SIGHUP; a bad edit keeps the last good store.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use arc_swap::ArcSwap;
use inference_cache_proto::v1alpha1::LookupRouteRequest;
use inference_cache_tokenizer::{ChatMessage, ChatOptions, TokenizeError, TokenizerRegistry};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use crate::prompt_templates::{RenderError, RenderedPrompt, TemplateStore};

/// Default `--tokenize-timeout`.
pub const DEFAULT_TOKENIZE_TIMEOUT: &str = "200ms";
/// Default `--templates-dir` (relative to the working directory).
pub const DEFAULT_TEMPLATES_DIR: &str = "templates";

/// Flags of the tokenizer and template inputs, flattened into `inference-cache serve`.
#[derive(Debug, Clone, clap::Args)]
pub struct PromptArgs {
    /// Directory with one subdirectory per model id (tokenizer.json plus
    /// tokenizer_config.json or chat_template.jinja), loaded at start-up;
    /// enables prompt_text, messages and raw_prompt lookups.
    #[arg(long, env = "INFERENCE_CACHE_TOKENIZER_MODELS_DIR")]
    pub tokenizer_models_dir: Option<PathBuf>,

    /// Upper bound on server-side tokenization when the tenant's policy sets no lookupTimeoutMs.
    #[arg(long, default_value = DEFAULT_TOKENIZE_TIMEOUT, value_parser = parse_timeout, env = "INFERENCE_CACHE_TOKENIZE_TIMEOUT")]
    pub tokenize_timeout: Duration,

    /// PromptTemplate directory served by RenderTemplate; re-read on change and on SIGHUP.
    #[arg(
        long,
        default_value = DEFAULT_TEMPLATES_DIR,
        env = "INFERENCE_CACHE_TEMPLATES_DIR"
    )]
    pub templates_dir: PathBuf,
}

fn parse_timeout(text: &str) -> Result<Duration, String> {
    let d = inference_cache_index::parse_duration(text)?;
    if d.is_zero() {
        return Err("must be greater than zero".into());
    }
    Ok(d)
}

impl PromptArgs {
    /// Resolves the flags into settings.
    pub fn into_settings(self) -> PromptSettings {
        PromptSettings {
            tokenizer_models_dir: self.tokenizer_models_dir,
            tokenize_timeout: self.tokenize_timeout,
            templates_dir: Some(self.templates_dir),
        }
    }
}

/// Resolved settings of the prompt inputs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptSettings {
    /// Tokenizer models directory; `None` disables server-side tokenization (fail open).
    pub tokenizer_models_dir: Option<PathBuf>,
    /// Tokenization bound when the tenant's policy sets no lookup timeout.
    pub tokenize_timeout: Duration,
    /// PromptTemplate directory; `None` (or a missing directory) serves no templates.
    pub templates_dir: Option<PathBuf>,
}

impl Default for PromptSettings {
    fn default() -> Self {
        Self {
            tokenizer_models_dir: None,
            tokenize_timeout: parse_timeout(DEFAULT_TOKENIZE_TIMEOUT).unwrap_or_default(),
            templates_dir: Some(PathBuf::from(DEFAULT_TEMPLATES_DIR)),
        }
    }
}

/// A prompt that needs the server's tokenizer, by the input precedence
/// messages_json / messages > raw_prompt > prompt_text.
#[derive(Debug, Clone)]
pub enum TextInput {
    /// A whole chat conversation as structured messages (chat template).
    Messages(Vec<ChatMessage>, ChatFields),
    /// A whole chat conversation as the body's verbatim `messages` JSON.
    MessagesJson(String, ChatFields),
    /// A `/v1/completions` string prompt (no template, special tokens added).
    RawPrompt(String),
    /// One user message (chat template, generation prompt).
    PromptText(String),
}

impl TextInput {
    /// The text input of a lookup, by precedence messages_json / messages >
    /// raw_prompt > prompt_text; `None` when it has none. Nothing is parsed
    /// here: JSON fields are read on the blocking pool.
    pub fn from_request(request: &LookupRouteRequest) -> Option<Self> {
        if !request.messages_json.is_empty() {
            Some(Self::MessagesJson(
                request.messages_json.clone(),
                ChatFields::from_request(request),
            ))
        } else if !request.messages.is_empty() {
            let messages = request
                .messages
                .iter()
                .map(|m| ChatMessage::new(&m.role, &m.content))
                .collect();
            Some(Self::Messages(messages, ChatFields::from_request(request)))
        } else if !request.raw_prompt.is_empty() {
            Some(Self::RawPrompt(request.raw_prompt.clone()))
        } else if !request.prompt_text.is_empty() {
            Some(Self::PromptText(request.prompt_text.clone()))
        } else {
            None
        }
    }
}

/// The chat-request fields of a lookup besides its messages, still as JSON text.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChatFields {
    /// `tools_json`.
    pub tools_json: String,
    /// `chat_template_kwargs_json`.
    pub chat_template_kwargs_json: String,
    /// `documents_json`.
    pub documents_json: String,
    /// `add_generation_prompt` (unset: true).
    pub add_generation_prompt: Option<bool>,
    /// `continue_final_message`.
    pub continue_final_message: bool,
}

impl ChatFields {
    fn from_request(request: &LookupRouteRequest) -> Self {
        Self {
            tools_json: request.tools_json.clone(),
            chat_template_kwargs_json: request.chat_template_kwargs_json.clone(),
            documents_json: request.documents_json.clone(),
            add_generation_prompt: request.add_generation_prompt,
            continue_final_message: request.continue_final_message,
        }
    }

    /// Parses the JSON fields into rendering options.
    pub fn options(&self) -> Result<ChatOptions, Rejected> {
        Ok(ChatOptions {
            tools: json_array(&self.tools_json, Rejected::Tools)?,
            documents: json_array(&self.documents_json, Rejected::Documents)?,
            add_generation_prompt: self.add_generation_prompt.unwrap_or(true),
            continue_final_message: self.continue_final_message,
            template_kwargs: json_object(
                &self.chat_template_kwargs_json,
                Rejected::ChatTemplateKwargs,
            )?,
        })
    }
}

/// A JSON field that is not what it should be.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Rejected {
    /// `messages_json` is not an array of message objects.
    #[error("messages_json is not a JSON array of chat messages")]
    Messages,
    /// `tools_json` is not a JSON array (or null).
    #[error("tools_json is not a JSON array")]
    Tools,
    /// `chat_template_kwargs_json` is not a JSON object (or null).
    #[error("chat_template_kwargs_json is not a JSON object")]
    ChatTemplateKwargs,
    /// `documents_json` is not a JSON array (or null).
    #[error("documents_json is not a JSON array")]
    Documents,
}

impl Rejected {
    /// Label of `tokenize_failure_total{reason}`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Messages => "bad_messages_json",
            Self::Tools => "bad_tools_json",
            Self::ChatTemplateKwargs => "bad_chat_template_kwargs_json",
            Self::Documents => "bad_documents_json",
        }
    }
}

/// An optional JSON array field: empty or `null` is `None`.
fn json_array(text: &str, rejected: Rejected) -> Result<Option<Vec<serde_json::Value>>, Rejected> {
    if text.is_empty() {
        return Ok(None);
    }
    match serde_json::from_str(text) {
        Ok(serde_json::Value::Null) => Ok(None),
        Ok(serde_json::Value::Array(items)) => Ok(Some(items)),
        _ => Err(rejected),
    }
}

/// An optional JSON object field: empty or `null` is empty.
fn json_object(
    text: &str,
    rejected: Rejected,
) -> Result<serde_json::Map<String, serde_json::Value>, Rejected> {
    if text.is_empty() {
        return Ok(serde_json::Map::new());
    }
    match serde_json::from_str(text) {
        Ok(serde_json::Value::Null) => Ok(serde_json::Map::new()),
        Ok(serde_json::Value::Object(map)) => Ok(map),
        _ => Err(rejected),
    }
}

/// `messages_json` as chat messages.
fn parse_messages(text: &str) -> Result<Vec<ChatMessage>, TokenizeFailure> {
    let Ok(serde_json::Value::Array(items)) = serde_json::from_str(text) else {
        return Err(TokenizeFailure::Rejected(Rejected::Messages));
    };
    items
        .iter()
        .map(|item| {
            ChatMessage::from_openai(item)
                .map_err(|_| TokenizeFailure::Rejected(Rejected::Messages))
        })
        .collect()
}

/// Runs one text input through the registry (on the blocking pool).
fn encode(
    tokenizers: &TokenizerRegistry,
    model: &str,
    input: TextInput,
) -> Result<Vec<u32>, TokenizeFailure> {
    match input {
        TextInput::Messages(messages, fields) => {
            let options = fields.options().map_err(TokenizeFailure::Rejected)?;
            Ok(tokenizers.encode_chat(model, &messages, &options)?)
        }
        TextInput::MessagesJson(text, fields) => {
            let messages = parse_messages(&text)?;
            let options = fields.options().map_err(TokenizeFailure::Rejected)?;
            Ok(tokenizers.encode_chat(model, &messages, &options)?)
        }
        TextInput::RawPrompt(text) => Ok(tokenizers.encode_raw_prompt(model, &text)?),
        TextInput::PromptText(text) => Ok(tokenizers.encode_prompt_text(model, &text)?),
    }
}

/// Why a text input produced no token ids.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeFailure {
    /// The deadline passed first.
    #[error("tokenization exceeded its {0:?} budget")]
    Timeout(Duration),
    /// A JSON field of the request is malformed.
    #[error(transparent)]
    Rejected(Rejected),
    /// The model has no tokenizer, no chat template, or encoding failed.
    #[error(transparent)]
    Tokenizer(#[from] TokenizeError),
    /// Every tokenization slot is taken.
    #[error("all {0} tokenization slots are busy")]
    Busy(usize),
    /// The blocking task died.
    #[error("tokenization task failed: {0}")]
    Task(String),
}

impl TokenizeFailure {
    /// Label of `tokenize_failure_total{reason}`.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Timeout(_) => "timeout",
            Self::Rejected(rejected) => rejected.as_str(),
            Self::Tokenizer(TokenizeError::UnknownModel(_)) => "unknown_model",
            Self::Tokenizer(TokenizeError::NoChatTemplate(_)) => "no_chat_template",
            Self::Tokenizer(TokenizeError::Template(_)) => "template_error",
            Self::Tokenizer(TokenizeError::InvalidRequest(_)) => "invalid_chat_request",
            Self::Tokenizer(TokenizeError::UnsupportedContent(_)) => "unsupported_content",
            Self::Tokenizer(_) => "encode_error",
            Self::Busy(_) => "busy",
            Self::Task(_) => "task_failed",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: String,
}

/// Tokenizers, templates and their metrics.
pub struct PromptState {
    tokenizers: Arc<TokenizerRegistry>,
    tokenize_timeout: Duration,
    templates: ArcSwap<TemplateStore>,
    templates_dir: Option<PathBuf>,
    tokenize_latency: Histogram,
    tokenize_failures: Family<ReasonLabel, Counter>,
    template_reloads: Family<ResultLabel, Counter>,
    slots: Arc<tokio::sync::Semaphore>,
    slot_count: usize,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

impl PromptState {
    /// Loads the tokenizers and templates. Broken model directories are logged
    /// and skipped; an unreadable models directory or an invalid template file
    /// fails start-up with a message naming it.
    pub fn new(
        settings: &PromptSettings,
        tokenize_concurrency: usize,
        registry: &mut Registry,
    ) -> anyhow::Result<Self> {
        let tokenizers = match &settings.tokenizer_models_dir {
            None => TokenizerRegistry::empty(),
            Some(dir) => {
                let started = Instant::now();
                let (tokenizers, skipped) = TokenizerRegistry::load_dir(dir)
                    .with_context(|| format!("loading tokenizers from {}", dir.display()))?;
                for error in &skipped {
                    tracing::error!("tokenizer skipped: {error}");
                }
                tracing::info!(
                    dir = %dir.display(),
                    models = ?tokenizers.model_ids(),
                    elapsed_ms = started.elapsed().as_millis() as u64,
                    "tokenizers loaded"
                );
                tokenizers
            }
        };
        let templates = match &settings.templates_dir {
            Some(dir) if dir.is_dir() => {
                let store = TemplateStore::load_dir(dir)
                    .with_context(|| format!("loading templates from {}", dir.display()))?;
                tracing::info!(dir = %dir.display(), templates = store.len(), "templates loaded");
                store
            }
            Some(dir) => {
                tracing::warn!(dir = %dir.display(), "templates directory not found; RenderTemplate answers TEMPLATE_NOT_FOUND");
                TemplateStore::default()
            }
            None => TemplateStore::default(),
        };
        let tokenize_latency = Histogram::new(exponential_buckets(0.000_01, 2.0, 15));
        registry.register(
            "tokenize_latency_seconds",
            "Server-side tokenization of prompt_text / messages / raw_prompt",
            tokenize_latency.clone(),
        );
        let tokenize_failures = Family::<ReasonLabel, Counter>::default();
        registry.register(
            "tokenize_failure",
            "Server-side tokenizations that answered no tokens (fail open), by reason",
            tokenize_failures.clone(),
        );
        let template_reloads = Family::<ResultLabel, Counter>::default();
        registry.register(
            "template_reload",
            "Template directory loads by result (success, error)",
            template_reloads.clone(),
        );
        Ok(Self {
            tokenizers: Arc::new(tokenizers),
            tokenize_timeout: settings.tokenize_timeout,
            templates: ArcSwap::from_pointee(templates),
            templates_dir: settings.templates_dir.clone().filter(|d| d.is_dir()),
            tokenize_latency,
            tokenize_failures,
            template_reloads,
            slots: Arc::new(tokio::sync::Semaphore::new(tokenize_concurrency.max(1))),
            slot_count: tokenize_concurrency.max(1),
        })
    }

    /// True when a tokenizer is loaded for `model`.
    pub fn has_tokenizer(&self, model: &str) -> bool {
        self.tokenizers.contains(model)
    }

    /// Tokenizes `input` for `model` on the blocking pool, giving up after
    /// `policy_timeout` (or the configured default) and never past `deadline`.
    pub async fn tokenize(
        &self,
        model: &str,
        input: TextInput,
        policy_timeout: Option<Duration>,
        deadline: Option<Instant>,
    ) -> Result<Vec<u32>, TokenizeFailure> {
        let started = Instant::now();
        let mut budget = policy_timeout.unwrap_or(self.tokenize_timeout);
        if let Some(deadline) = deadline {
            budget = budget.min(deadline.saturating_duration_since(started));
        }
        // The slot travels with the blocking work: a call that outlives its
        // deadline keeps it until the tokenizer returns.
        let Ok(slot) = Arc::clone(&self.slots).try_acquire_owned() else {
            return Err(TokenizeFailure::Busy(self.slot_count));
        };
        let tokenizers = Arc::clone(&self.tokenizers);
        let model = model.to_owned();
        let task = tokio::task::spawn_blocking(move || {
            let _slot = slot;
            encode(&tokenizers, &model, input)
        });
        let result = match tokio::time::timeout(budget, task).await {
            Err(_) => Err(TokenizeFailure::Timeout(budget)),
            Ok(Err(join)) => Err(TokenizeFailure::Task(join.to_string())),
            Ok(Ok(ids)) => ids,
        };
        self.tokenize_latency
            .observe(started.elapsed().as_secs_f64());
        if let Err(failure) = &result {
            self.tokenize_failures
                .get_or_create(&ReasonLabel {
                    reason: failure.reason(),
                })
                .inc();
        }
        result
    }

    /// Renders `template_ref` with `variables` from the current template store.
    pub fn render(
        &self,
        template_ref: &str,
        variables: &HashMap<String, String>,
    ) -> Result<RenderedPrompt, RenderError> {
        self.templates.load().render(template_ref, variables)
    }

    /// Re-reads the template directory; on error logs, counts and keeps the current store.
    pub fn reload_templates(&self) -> bool {
        let Some(dir) = &self.templates_dir else {
            return false;
        };
        let (result, ok) = match TemplateStore::load_dir(dir) {
            Ok(store) => {
                tracing::info!(dir = %dir.display(), templates = store.len(), "templates reloaded");
                self.templates.store(Arc::new(store));
                ("success", true)
            }
            Err(error) => {
                tracing::error!(dir = %dir.display(), "template reload failed, keeping the last good templates: {error}");
                ("error", false)
            }
        };
        self.template_reloads
            .get_or_create(&ResultLabel {
                result: result.to_owned(),
            })
            .inc();
        ok
    }

    /// Starts the template reloader; it stops with `shutdown`.
    pub fn spawn_background(self: &Arc<Self>, shutdown: CancellationToken) {
        if let Some(dir) = self.templates_dir.clone() {
            let state = Arc::clone(self);
            crate::reload::spawn_reloader(dir, "templates", shutdown, move || {
                state.reload_templates();
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use inference_cache_proto::v1alpha1::ChatMessage as WireMessage;

    #[test]
    fn text_input_precedence() {
        let mut request = LookupRouteRequest {
            prompt_text: "p".into(),
            ..Default::default()
        };
        assert!(matches!(
            TextInput::from_request(&request),
            Some(TextInput::PromptText(_))
        ));
        request.raw_prompt = "r".into();
        assert!(matches!(
            TextInput::from_request(&request),
            Some(TextInput::RawPrompt(_))
        ));
        request.messages.push(WireMessage {
            role: "user".into(),
            content: "m".into(),
        });
        assert!(matches!(
            TextInput::from_request(&request),
            Some(TextInput::Messages(..))
        ));
        request.messages_json = "[]".into();
        request.add_generation_prompt = Some(false);
        match TextInput::from_request(&request) {
            Some(TextInput::MessagesJson(text, fields)) => {
                assert_eq!(text, "[]");
                assert_eq!(fields.add_generation_prompt, Some(false));
            }
            other => panic!("messages_json wins: {other:?}"),
        }
        assert!(TextInput::from_request(&LookupRouteRequest::default()).is_none());
    }

    #[test]
    fn chat_fields_parse_or_reject() {
        let fields = ChatFields {
            tools_json: "null".into(),
            chat_template_kwargs_json: r#"{"enable_thinking": false}"#.into(),
            documents_json: String::new(),
            add_generation_prompt: None,
            continue_final_message: false,
        };
        let options = fields.options().expect("valid");
        assert_eq!(options.tools, None);
        assert!(
            options.add_generation_prompt,
            "unset means the engine default"
        );
        assert_eq!(
            options.template_kwargs.get("enable_thinking"),
            Some(&serde_json::Value::Bool(false))
        );
        for (fields, rejected) in [
            (
                ChatFields {
                    tools_json: "{}".into(),
                    ..ChatFields::default()
                },
                Rejected::Tools,
            ),
            (
                ChatFields {
                    chat_template_kwargs_json: "[]".into(),
                    ..ChatFields::default()
                },
                Rejected::ChatTemplateKwargs,
            ),
            (
                ChatFields {
                    documents_json: "[".into(),
                    ..ChatFields::default()
                },
                Rejected::Documents,
            ),
        ] {
            assert_eq!(fields.options(), Err(rejected));
        }
        assert!(matches!(
            parse_messages(r#"[{"content": "no role"}]"#),
            Err(TokenizeFailure::Rejected(Rejected::Messages))
        ));
        assert_eq!(
            parse_messages(r#"[{"role": "user", "content": "hi"}]"#)
                .expect("valid")
                .len(),
            1
        );
    }
}
