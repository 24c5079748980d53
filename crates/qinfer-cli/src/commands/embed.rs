//! `qinfer embed`: texts from a JSONL file (a JSON string per line, or an
//! object with `text`) to embeddings, through the engine's prompt-only
//! requests, written as JSONL (`{"index", "embedding"}` per line) or as a
//! float32 `.npy` matrix; all of it or nothing (a bad line fails the run
//! before any work, naming the line).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use qinfer::engine::core::EngineCore;
use qinfer::engine::pooling::finish_embedding;
use qinfer::engine::request::{Request, Task};
use qinfer_server::ServedTask;
use serde_json::{Value, json};

use crate::common::{EngineArgs, TaskArgs, TaskKind, open_model};

#[derive(clap::Args)]
pub struct Args {
    /// Model directory (an embedding checkpoint) or .gguf file.
    #[arg(long)]
    model: Option<PathBuf>,
    /// JSONL: a JSON string per line, or an object with a `text` field.
    #[arg(long)]
    input: PathBuf,
    /// Where the embeddings go: `.npy` (a float32 [inputs, dimensions]
    /// matrix) or JSONL (anything else).
    #[arg(long)]
    output: PathBuf,
    /// The model's named prompt to put before each text (its
    /// sentence-transformers `prompts`, e.g. `query`).
    #[arg(long)]
    prompt_name: Option<String>,
    /// A task description: each text becomes Qwen3-Embedding's
    /// `Instruct: {task}\nQuery:{text}`.
    #[arg(long, conflicts_with = "prompt_name")]
    instruction: Option<String>,
    /// Keep the first N values of each embedding (Matryoshka), renormalized.
    #[arg(long)]
    dimensions: Option<usize>,
    #[command(flatten)]
    engine: EngineArgs,
}

fn texts(path: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let v: Value = serde_json::from_str(line).with_context(|| format!("{}:{}: not JSON", path.display(), i + 1))?;
        match v {
            Value::String(s) => out.push(s),
            Value::Object(o) => match o.get("text") {
                Some(Value::String(s)) => out.push(s.clone()),
                _ => bail!("{}:{}: an object needs a string `text`", path.display(), i + 1),
            },
            _ => bail!("{}:{}: a line is a JSON string or an object with `text`", path.display(), i + 1),
        }
    }
    if out.is_empty() {
        bail!("{}: no texts", path.display());
    }
    Ok(out)
}

pub fn main(a: Args, device: qinfer::loader::Device) -> Result<()> {
    let inputs = texts(&a.input)?;
    let mut model = open_model(a.model.as_ref())?;
    let tok = model.tokenizer.take().context("`qinfer embed` needs a model with a tokenizer")?;
    let ServedTask::Embed(cfg) =
        (TaskArgs { task: TaskKind::Embed }).resolve(&model.path, model.gguf_pooling_type, Some(&tok))?
    else {
        unreachable!("the embed task resolves to pooling")
    };
    let lm: Arc<dyn qinfer::models::LanguageModel> = Arc::from(model.load(device, true)?);
    let hidden = lm.config().hidden_size;
    if let Some(d) = a.dimensions
        && !(1..=hidden).contains(&d)
    {
        bail!("--dimensions must be between 1 and {hidden}, this model's width");
    }
    let engine_cfg = a.engine.config(lm.as_ref(), &device);
    let mut core = EngineCore::new(lm.clone(), None, engine_cfg)?;
    for (i, t) in inputs.iter().enumerate() {
        let text = cfg.input_text(t, a.prompt_name.as_deref(), a.instruction.as_deref())?;
        let prompt = tok.encode(&text, true)?;
        let req = Request { prompt, task: Task::Embed(cfg.pooling), ..Default::default() };
        core.add(i as u64, req).with_context(|| format!("{}: line {}", a.input.display(), i + 1))?;
    }
    let bar = indicatif::ProgressBar::new(inputs.len() as u64).with_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} texts, {msg} [{elapsed_precise}]")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let mut vectors: Vec<Option<Vec<f32>>> = vec![None; inputs.len()];
    let (t0, mut tokens) = (Instant::now(), 0usize);
    while core.num_unfinished() > 0 {
        for out in core.step()? {
            tokens += out.usage.prompt_tokens;
            let v = finish_embedding(out.pooled.unwrap_or_default(), cfg.normalize, a.dimensions)?;
            vectors[out.id as usize] = Some(v);
            bar.inc(1);
        }
        bar.set_message(format!("{:.0} tok/s", tokens as f64 / t0.elapsed().as_secs_f64().max(1e-9)));
    }
    bar.finish();
    let vectors: Vec<Vec<f32>> = vectors.into_iter().map(|v| v.expect("every text embedded")).collect();
    write(&a.output, &vectors)?;
    eprintln!(
        "{} texts ({tokens} tokens) embedded in {:.2} s ({:.0} tok/s) to {}",
        vectors.len(),
        t0.elapsed().as_secs_f64(),
        tokens as f64 / t0.elapsed().as_secs_f64().max(1e-9),
        a.output.display()
    );
    Ok(())
}

/// `.npy` or JSONL, through a temporary file renamed over `path`.
fn write(path: &Path, vectors: &[Vec<f32>]) -> Result<()> {
    if path.extension().is_some_and(|e| e == "npy") {
        let flat: Vec<f32> = vectors.iter().flatten().copied().collect();
        return Ok(qinfer::npy::write_f32(path, &[vectors.len(), vectors[0].len()], &flat)?);
    }
    let tmp = path.with_extension("partial");
    let mut f =
        std::io::BufWriter::new(std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?);
    for (i, v) in vectors.iter().enumerate() {
        serde_json::to_writer(&mut f, &json!({"index": i, "embedding": v}))?;
        f.write_all(b"\n")?;
    }
    f.into_inner().map_err(|e| e.into_error())?.sync_all()?;
    std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))
}
