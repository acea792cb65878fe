//! Tokenizer registry: Hugging Face tokenizers and chat templates loaded once
//! at start-up, turning the three prompt shapes of an OpenAI-style request into
//! the token ids the engine will see.
//!
//! - [`TokenizerRegistry`] — one entry per model subdirectory of the models
//!   directory (`tokenizer.json` plus the chat template and special tokens of
//!   `tokenizer_config.json` / `chat_template.jinja`).
//! - [`TokenizerRegistry::encode_prompt_text`] — one user message, chat
//!   template, generation prompt (the contract's `prompt_text`).
//! - [`TokenizerRegistry::encode_messages`] — a whole conversation, as the
//!   engine's `/v1/chat/completions` renders it.
//! - [`TokenizerRegistry::encode_chat`] — a full chat request: tools, tool
//!   calls, content parts, documents, `add_generation_prompt`,
//!   `continue_final_message` and `chat_template_kwargs` ([`ChatOptions`]),
//!   normalized the way vLLM prepares them for the template.
//! - [`TokenizerRegistry::encode_raw_prompt`] — no template, the tokenizer's
//!   special tokens added, as the engine's `/v1/completions` string prompt.
//!
//! Token ids match Python `transformers`' `apply_chat_template(...,
//! add_generation_prompt=True, tokenize=True)` and `tokenizer(text)` on the
//! same files; the crate's parity tests prove it on real Qwen3, Llama 3,
//! DeepSeek-V3 and Gemma 3 tokenizers.
//!
//! ```no_run
//! use inference_cache_tokenizer::{ChatMessage, TokenizerRegistry};
//! use std::{path::Path, sync::Arc};
//!
//! let (registry, skipped) = TokenizerRegistry::load_dir(Path::new("/models"))?;
//! for error in &skipped {
//!     eprintln!("skipped: {error}");
//! }
//! let registry = Arc::new(registry);
//! let ids = registry.encode_messages(
//!     "qwen3",
//!     &[ChatMessage::new("system", "Be brief."), ChatMessage::new("user", "Hi!")],
//! )?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Everything is synchronous and CPU-bound; the registry is immutable and
//! `Send + Sync`, so a server shares it through an `Arc` and calls it from a
//! blocking pool.

mod chat_template;
mod clock;
mod conversation;
mod error;
mod pyjson;
mod registry;

pub use clock::{Clock, FixedClock, SystemClock};
pub use conversation::{ChatMessage, ChatOptions};
pub use error::{LoadError, ModelLoadError, ModelLoadErrorKind, TokenizeError};
pub use registry::{RegistryOptions, TokenizerRegistry};
