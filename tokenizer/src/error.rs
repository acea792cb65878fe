//! Errors of loading models and of turning prompts into tokens.
//!
//! [`TokenizeError`] is what a request can hit; the server maps it to a
//! fail-open answer. [`ModelLoadError`] describes one model directory that was
//! skipped at start-up; [`LoadError`] means the models directory itself could
//! not be read.

use std::path::PathBuf;

/// Why a prompt could not be turned into token ids.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TokenizeError {
    /// No model with this id was loaded.
    #[error("no tokenizer is loaded for model {0:?}")]
    UnknownModel(String),
    /// The model has a tokenizer but no chat template (only raw prompts work).
    #[error("model {0:?} has no chat template")]
    NoChatTemplate(String),
    /// The chat template failed to render (including `raise_exception`).
    #[error("chat template failed: {0}")]
    Template(String),
    /// The tokenizer failed on the text.
    #[error("tokenization failed: {0}")]
    Encode(String),
    /// The chat request is one the engine itself would refuse (e.g.
    /// `continue_final_message` together with `add_generation_prompt`, or a
    /// template keyword argument that collides with a reserved name).
    #[error("invalid chat request: {0}")]
    InvalidRequest(String),
    /// A message carries a content part whose tokens the server cannot know
    /// (images, audio, video: the engine's processor expands them).
    #[error("unsupported content part: {0}")]
    UnsupportedContent(String),
}

/// A model directory that was reported and skipped at load time.
#[derive(Debug, thiserror::Error)]
#[error("model {model:?} in {}: {kind}", path.display())]
pub struct ModelLoadError {
    /// Directory name (the model id it would have had).
    pub model: String,
    /// The model directory.
    pub path: PathBuf,
    /// What was wrong.
    pub kind: ModelLoadErrorKind,
}

/// What was wrong with a model directory.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelLoadErrorKind {
    /// The directory name is not valid UTF-8, so it cannot be a model id.
    #[error("directory name is not valid UTF-8")]
    InvalidName,
    /// A file could not be read.
    #[error("cannot read {file}: {source}")]
    Io {
        /// The file.
        file: &'static str,
        /// The I/O error.
        source: std::io::Error,
    },
    /// `tokenizer.json` is missing.
    #[error("no tokenizer.json")]
    MissingTokenizer,
    /// `tokenizer.json` did not load.
    #[error("tokenizer.json: {0}")]
    Tokenizer(String),
    /// `tokenizer_config.json` is not valid or has an unexpected shape.
    #[error("tokenizer_config.json: {0}")]
    Config(String),
    /// The chat template does not compile.
    #[error("chat template: {0}")]
    Template(String),
}

/// The models directory itself could not be listed.
#[derive(Debug, thiserror::Error)]
#[error("cannot read tokenizer models directory {}: {source}", path.display())]
pub struct LoadError {
    /// The directory.
    pub path: PathBuf,
    /// The I/O error.
    pub source: std::io::Error,
}
