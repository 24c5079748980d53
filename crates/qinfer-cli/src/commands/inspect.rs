//! `qinfer inspect`: what a model file holds.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::Result;
use qinfer::loader::{self, ModelFormat};

#[derive(clap::Args)]
pub struct Args {
    /// Model directory, .gguf file or Hugging Face repo id (`Qwen/Qwen3-0.6B[:REVISION or :FILE.gguf]`).
    path: PathBuf,
    /// List every tensor.
    #[arg(long)]
    tensors: bool,
}

fn human(bytes: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.1} {}", units[u])
}

pub fn main(a: Args) -> Result<()> {
    let m = loader::open(&a.path)?;
    let c = &m.config;
    let format = match m.format {
        ModelFormat::Safetensors => "safetensors",
        ModelFormat::Gguf => "gguf",
    };
    println!("model:         {}", m.path.display());
    println!("format:        {format}");
    println!("architecture:  {}", c.arch.name());
    println!("layers:        {}", c.num_layers);
    println!("hidden:        {}  intermediate: {}", c.hidden_size, c.intermediate_size);
    println!("heads:         {} q / {} kv, head_dim {}", c.num_heads, c.num_kv_heads, c.head_dim);
    println!("vocab:         {}  tied embeddings: {}", c.vocab_size, c.tie_word_embeddings);
    println!("rope:          theta {} {:?} scaling {:?}", c.rope.theta, c.rope.style, c.rope.scaling);
    println!("context:       {}", c.max_position_embeddings);
    let windows: Vec<_> = c.layer_windows.iter().enumerate().filter_map(|(i, w)| w.map(|w| (i, w))).collect();
    if !windows.is_empty() {
        println!("sliding window: {} layers, window {}", windows.len(), windows[0].1);
    }
    println!("eos ids:       {:?}  bos: {:?}", c.eos_token_ids, c.bos_token_id);
    println!("tokenizer:     {}", if m.tokenizer.is_some() { "yes" } else { "none" });
    let mut params = 0usize;
    let mut by_type: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    let names = m.source.names();
    for n in &names {
        match m.source.raw_tensor(n) {
            Ok(t) => {
                params += t.numel();
                let e = by_type.entry(t.dtype.name().to_string()).or_default();
                e.0 += 1;
                e.1 += t.data.len();
                if a.tensors {
                    println!("  {n:<48} {:<6} {:?}", t.dtype.name(), t.shape);
                }
            }
            Err(e) => {
                *by_type.entry("unsupported".into()).or_default() =
                    (by_type.get("unsupported").map_or(0, |x| x.0) + 1, 0);
                if a.tensors {
                    println!("  {n:<48} {e}");
                }
            }
        }
    }
    println!("tensors:       {}", names.len());
    for (t, (count, bytes)) in &by_type {
        println!("  {t:<12} {count:>5} tensors  {}", human(*bytes as u64));
    }
    println!("parameters:    {params} ({:.1} M)", params as f64 / 1e6);
    for (p, size) in &m.files {
        println!("file:          {} ({})", p.display(), human(*size));
    }
    Ok(())
}
