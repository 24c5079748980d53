//! A multi-token-prediction head from a file of its own, beside a model
//! that has none: llama.cpp's converter publishes a target (`--no-mtp`) and
//! its head (`--mtp`, an `mtp-*.gguf` holding the head's block, the
//! embeddings, the final norm and the output head) as two files, and a
//! Hugging Face directory may hold the head as well. The model's `mtp.*`
//! tensors are then read from that file, everything else from the model's.

use std::path::Path;

use super::routed::Routed;
use super::{LoadedModel, open};
use crate::formats::TensorSource;
use crate::formats::gguf::{GgufFile, architecture_named};
use crate::{Error, Result};

/// The head's prefix: the names routed to the head's file.
const HEAD: &str = "mtp.";

impl LoadedModel {
    /// The model with its multi-token-prediction head read from `path` (a
    /// GGUF file the converter's `--mtp` wrote, or a model directory that
    /// holds `mtp.*`), loaded with it. The file must be a head for this
    /// model: the same architecture, hidden width, layer count and
    /// vocabulary.
    pub fn with_mtp_head(self, path: &Path) -> Result<LoadedModel> {
        let head = open_head(path)?;
        let c = &self.config;
        let checks = [
            ("architecture", c.arch.name().to_string(), head.arch.clone()),
            ("hidden size", c.hidden_size.to_string(), head.hidden.to_string()),
            ("main layers", c.num_layers.to_string(), head.layers.to_string()),
            ("vocabulary", c.vocab_size.to_string(), head.vocab.to_string()),
        ];
        if let Some((what, want, got)) = checks.into_iter().find(|(_, x, y)| x != y) {
            return Err(Error::malformed(
                path,
                format!("is no head for {}: its {what} is {got}, the model's {want}", self.path.display()),
            ));
        }
        if !head.source.contains("mtp.fc.weight") {
            return Err(Error::malformed(
                path,
                "holds no multi-token-prediction head (`mtp.fc.weight`; in a GGUF \
                 `blk.{layers}.nextn.eh_proj.weight`)",
            ));
        }
        let mut config = self.config;
        config.mtp_layers = config.mtp_layers.max(head.mtp_layers).max(1);
        config.load_mtp = true;
        let mut all_files = self.files;
        all_files.extend(head.files);
        let source = Box::new(Routed { model: self.source, other: head.source, prefix: HEAD });
        Ok(LoadedModel { config, files: all_files, source, ..self })
    }
}

/// A head file: its tensors and files, and what it says of the model it
/// belongs to.
struct HeadFile {
    source: Box<dyn TensorSource>,
    files: Vec<(std::path::PathBuf, u64)>,
    arch: String,
    hidden: usize,
    layers: usize,
    vocab: usize,
    mtp_layers: usize,
}

/// Opens a head file. A GGUF head holds too little of
/// the model for its whole configuration (no main layers: an all-MoE
/// file's layers can't be told apart from dense ones), so only the keys a
/// head needs are read.
fn open_head(path: &Path) -> Result<HeadFile> {
    if path.is_dir() {
        let m = open(path)?;
        let c = &m.config;
        return Ok(HeadFile {
            arch: c.arch.name().to_string(),
            hidden: c.hidden_size,
            layers: c.num_layers,
            vocab: c.vocab_size,
            mtp_layers: c.mtp_layers,
            source: m.source,
            files: m.files,
        });
    }
    let file = GgufFile::open(path)?;
    let arch = file.architecture().unwrap_or_default().to_string();
    let count = |key: &str| -> Result<usize> {
        let k = format!("{arch}.{key}");
        (file.metadata().get(&k).and_then(|v| v.as_u64()).map(|v| v as usize))
            .ok_or_else(|| Error::malformed(path, format!("`{k}` is missing from its metadata")))
    };
    let (blocks, hidden) = (count("block_count")?, count("embedding_length")?);
    let mtp_layers = count("nextn_predict_layers").unwrap_or(0);
    let vocab = file.tensor("model.embed_tokens.weight")?.shape.first().copied().unwrap_or(0);
    let size = std::fs::metadata(path).map_err(|e| Error::io(path, e))?.len();
    Ok(HeadFile {
        arch: architecture_named(&arch).map_or(arch.clone(), |a| a.name().to_string()),
        hidden,
        layers: blocks.saturating_sub(mtp_layers),
        vocab,
        mtp_layers,
        source: Box::new(file),
        files: vec![(path.to_path_buf(), size)],
    })
}
