//! The crate's error type: every variant names the file or field at fault.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The I/O error is part of the message, not a separate source: the CLI
    /// prints an error's chain of sources, which would repeat it.
    #[error("{path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    #[error("{path}: malformed file: {reason}")]
    Malformed { path: PathBuf, reason: String },
    #[error("config field `{field}`: {reason}")]
    Config { field: String, reason: String },
    #[error("unknown architecture `{found}`; supported: {supported}")]
    UnknownArchitecture { found: String, supported: String },
    #[error("tensor `{name}`: {reason}")]
    Tensor { name: String, reason: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), error: source }
    }
    pub fn malformed(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        Error::Malformed { path: path.into(), reason: reason.into() }
    }
    pub fn config(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::Config { field: field.into(), reason: reason.into() }
    }
    pub fn tensor(name: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::Tensor { name: name.into(), reason: reason.into() }
    }
}
