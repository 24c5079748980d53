//! The special tokens a chat template may name.

/// Special-token strings as the chat template sees them (`bos_token`, …).
#[derive(Debug, Clone, Default)]
pub(crate) struct SpecialTokens {
    pub bos: Option<String>,
    pub eos: Option<String>,
    pub unk: Option<String>,
    pub pad: Option<String>,
    pub sep: Option<String>,
    pub cls: Option<String>,
    pub mask: Option<String>,
    pub additional: Vec<String>,
}
