//! Writing an MLX model directory as mlx-lm's `save` does: one safetensors
//! file with `{"format": "mlx"}` metadata, an index (always, even for one
//! shard), config.json with four-space indentation and sorted keys.
//!
//! The safetensors header is written first from the planned names, dtypes and
//! shapes, then each tensor's bytes as they are produced, so the quantizer
//! never holds more than one tensor's output in memory.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::{Value, json};

use crate::{Error, Result};

/// Files copied next to the weights when the model has them.
pub const SIDE_FILES: [&str; 8] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
];

/// Writes a model directory at `out` through `fill`, which gets a fresh
/// sibling temporary directory already holding `config.json` (`cfg`) and
/// the side files `src` has; renamed into place at the end (replacing what
/// was at `out`), so an error never leaves a partial model there.
pub fn write_model_dir(out: &Path, src: &Path, cfg: &Value, fill: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let tmp = out.with_file_name(format!(
        ".{}.tmp-{}",
        out.file_name().and_then(|n| n.to_str()).unwrap_or("out"),
        std::process::id()
    ));
    let result = (|| {
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
        write_json(&tmp.join("config.json"), cfg)?;
        for f in SIDE_FILES {
            if src.join(f).exists() {
                std::fs::copy(src.join(f), tmp.join(f)).map_err(|e| Error::io(src.join(f), e))?;
            }
        }
        fill(&tmp)
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    if out.exists() {
        std::fs::remove_dir_all(out).map_err(|e| Error::io(out, e))?;
    }
    std::fs::rename(&tmp, out).map_err(|e| Error::io(out, e))
}

/// One tensor of the output file, known before its bytes are.
#[derive(Debug, Clone)]
pub struct Entry {
    pub name: String,
    /// safetensors dtype name (`F32`, `BF16`, `U32`, …).
    pub dtype: &'static str,
    pub shape: Vec<usize>,
    pub len: usize,
}

pub struct SafetensorsWriter {
    path: PathBuf,
    file: BufWriter<File>,
    entries: Vec<Entry>,
    next: usize,
}

impl SafetensorsWriter {
    /// Creates `path` and writes the header with `{"format": format}`
    /// metadata (`mlx`, or `pt` as transformers writes); the data must then
    /// come in `entries` order through [`SafetensorsWriter::write`].
    pub fn create(path: &Path, entries: Vec<Entry>, format: &str) -> Result<Self> {
        let mut header = serde_json::Map::new();
        header.insert("__metadata__".into(), json!({"format": format}));
        let mut offset = 0usize;
        for e in &entries {
            header.insert(
                e.name.clone(),
                json!({"dtype": e.dtype, "shape": e.shape, "data_offsets": [offset, offset + e.len]}),
            );
            offset += e.len;
        }
        let mut h = Value::Object(header).to_string().into_bytes();
        while !h.len().is_multiple_of(8) {
            h.push(b' ');
        }
        let io = |e| Error::io(path, e);
        let mut file = BufWriter::new(File::create(path).map_err(io)?);
        file.write_all(&(h.len() as u64).to_le_bytes()).map_err(io)?;
        file.write_all(&h).map_err(io)?;
        Ok(SafetensorsWriter { path: path.to_path_buf(), file, entries, next: 0 })
    }

    /// The next tensor's bytes; its name and length must be the planned ones.
    pub fn write(&mut self, name: &str, bytes: &[u8]) -> Result<()> {
        let e = self.entries.get(self.next).ok_or_else(|| Error::tensor(name, "written past the planned tensors"))?;
        if e.name != name || e.len != bytes.len() {
            return Err(Error::tensor(
                name,
                format!("planned as `{}` with {} bytes, produced {} bytes", e.name, e.len, bytes.len()),
            ));
        }
        self.next += 1;
        self.file.write_all(bytes).map_err(|e| Error::io(&self.path, e))
    }

    pub fn finish(mut self) -> Result<()> {
        if let Some(e) = self.entries.get(self.next) {
            return Err(Error::tensor(&e.name, "planned but never written"));
        }
        self.file.flush().map_err(|e| Error::io(&self.path, e))
    }
}

/// `model.safetensors.index.json` as mlx-lm's `save_model` writes it.
pub fn write_index(dir: &Path, entries: &[Entry], total_parameters: usize) -> Result<()> {
    let total_size: usize = entries.iter().map(|e| e.len).sum();
    let weight_map: serde_json::Map<String, Value> =
        entries.iter().map(|e| (e.name.clone(), Value::from("model.safetensors"))).collect();
    let index = json!({
        "metadata": {"total_size": total_size, "total_parameters": total_parameters},
        "weight_map": weight_map,
    });
    write_json(&dir.join("model.safetensors.index.json"), &index)
}

/// JSON with Python's `json.dump(indent=4)` layout (serde_json's maps keep
/// keys sorted, as mlx-lm's `save_config` sorts them).
pub fn write_json(path: &Path, v: &Value) -> Result<()> {
    let mut out = Vec::new();
    let mut ser =
        serde_json::Serializer::with_formatter(&mut out, serde_json::ser::PrettyFormatter::with_indent(b"    "));
    v.serialize(&mut ser).map_err(|e| Error::Invalid(e.to_string()))?;
    std::fs::write(path, out).map_err(|e| Error::io(path, e))
}
