//! The replay's error type: what went wrong, with enough context (file, line,
//! field, flag, server) to fix it without reading the code.

use std::path::PathBuf;

/// Why a replay could not run to the end.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReplayError {
    /// A file could not be read or written.
    #[error("{}: {error}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating-system error.
        error: std::io::Error,
    },
    /// A trace line is not a valid Mooncake record.
    #[error("{}: {error}", path.display())]
    Trace {
        /// The trace file.
        path: PathBuf,
        /// Line, field and reason.
        error: TraceError,
    },
    /// A flag value is out of range or contradicts another flag.
    #[error("--{flag}: {reason}")]
    Setting {
        /// The flag, without dashes.
        flag: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The `--policy-file` could not be accepted.
    #[error("--policy-file {}: {error}", path.display())]
    Policy {
        /// The policy file.
        path: PathBuf,
        /// The parse error, naming document and field.
        error: inference_cache_index::PolicyError,
    },
    /// A call to the `--server` failed.
    #[error("server {endpoint}: {message}")]
    Server {
        /// The server URL.
        endpoint: String,
        /// What failed.
        message: String,
    },
}

/// A trace record that could not be parsed, with its 1-based line number.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}{}: {reason}", field.map(|f| format!(", field `{f}`")).unwrap_or_default())]
pub struct TraceError {
    /// 1-based line of the record.
    pub line: usize,
    /// The offending field, when one field is to blame.
    pub field: Option<&'static str>,
    /// What is wrong.
    pub reason: String,
}

/// `error` and its sources, joined by `: `.
pub(crate) fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut next = error.source();
    while let Some(cause) = next {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        next = cause.source();
    }
    text
}
