//! `qinfer batch`: offline throughput. Every line of a JSONL file is a
//! request (`prompt` as raw text, or chat `messages` with the model's
//! template), all run through the continuous-batching engine at once; the
//! results are written in input order, the file whole or not at all.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use qinfer::engine::core::EngineCore;
use qinfer::engine::request::{FinishReason, Request, StopConditions};
use qinfer::loader::LoadedModel;
use qinfer::sampling::SamplingParams;
use qinfer::tokenizer::{ChatMessage, ChatOptions, Tokenizer};
use serde_json::{Value, json};

use crate::common::{EngineArgs, LoraArgs, SamplingArgs, open_model, stop_tokens};

#[derive(clap::Args)]
pub struct Args {
    /// Model directory, .gguf file or Hugging Face repo id (default: the fetched SmolLM2).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Requests, one JSON object per line: {"id": …, "prompt": "…"} or
    /// {"id": …, "messages": [{"role": …, "content": …}, …]}, with optional
    /// max_tokens, temperature, top_p, top_k, min_p, seed, stop.
    #[arg(long)]
    input: PathBuf,
    /// Results, one line per request in input order: {"id", "text",
    /// "tokens", "finish_reason", "usage"}, or {"id", "error"}.
    #[arg(long)]
    output: PathBuf,
    /// New tokens of a request that gives no max_tokens.
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// Do not stop at the model's end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    engine: EngineArgs,
    #[command(flatten)]
    lora: LoraArgs,
}

/// The fields a request line may have, and what each must be.
const FIELDS: &[(&str, &str)] = &[
    ("id", "any JSON value"),
    ("prompt", "a string"),
    ("messages", "an array of {\"role\": string, \"content\": string}"),
    ("max_tokens", "an integer >= 1"),
    ("temperature", "a number"),
    ("top_p", "a number"),
    ("top_k", "an integer >= 0"),
    ("min_p", "a number"),
    ("seed", "an integer >= 0"),
    ("stop", "a string or an array of strings"),
];

/// One input line as a request, or why it is not one.
fn parse_line(
    line: &str,
    tok: &Tokenizer,
    defaults: &SamplingParams,
    max_tokens: usize,
    stop_ids: &[u32],
) -> std::result::Result<Request, String> {
    let v: Value = serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
    let obj = v.as_object().ok_or("not a JSON object")?;
    for key in obj.keys() {
        if !FIELDS.iter().any(|(f, _)| f == key) {
            let known: Vec<&str> = FIELDS.iter().map(|(f, _)| *f).collect();
            return Err(format!("unknown field `{key}` (known: {})", known.join(", ")));
        }
    }
    let wrong = |f: &str| {
        let what = FIELDS.iter().find(|(n, _)| *n == f).map_or("", |(_, w)| *w);
        format!("field `{f}` must be {what}")
    };
    let uint = |f: &str| -> std::result::Result<Option<u64>, String> {
        obj.get(f).map(|x| x.as_u64().ok_or_else(|| wrong(f))).transpose()
    };
    let float = |f: &str| -> std::result::Result<Option<f32>, String> {
        obj.get(f).map(|x| x.as_f64().map(|x| x as f32).ok_or_else(|| wrong(f))).transpose()
    };
    let prompt = match (obj.get("prompt"), obj.get("messages")) {
        (Some(_), Some(_)) => return Err("give `prompt` or `messages`, not both".into()),
        (None, None) => return Err("no `prompt` or `messages`".into()),
        (Some(p), None) => {
            let text = p.as_str().ok_or_else(|| wrong("prompt"))?;
            tok.encode(text, true).map_err(|e| e.to_string())?
        }
        (None, Some(m)) => {
            let items = m.as_array().ok_or_else(|| wrong("messages"))?;
            let messages = items
                .iter()
                .map(|m| match (m.get("role").and_then(Value::as_str), m.get("content").and_then(Value::as_str)) {
                    (Some(r), Some(c)) => Ok(ChatMessage::new(r, c)),
                    _ => Err(wrong("messages")),
                })
                .collect::<std::result::Result<Vec<_>, _>>()?;
            if !tok.has_chat_template() {
                return Err("`messages` needs a chat template; this model has none (use `prompt`)".into());
            }
            let opts = ChatOptions { add_generation_prompt: true, ..Default::default() };
            let text = tok.apply_chat_template(&messages, &opts).map_err(|e| e.to_string())?;
            tok.encode(&text, false).map_err(|e| e.to_string())?
        }
    };
    let mut sampling = defaults.clone();
    if let Some(t) = float("temperature")? {
        sampling.temperature = t;
    }
    if let Some(p) = float("top_p")? {
        sampling.top_p = p;
    }
    if let Some(p) = float("min_p")? {
        sampling.min_p = p;
    }
    if let Some(k) = uint("top_k")? {
        sampling.top_k = k as usize;
    }
    if let Some(s) = uint("seed")? {
        sampling.seed = s;
    }
    let max_tokens = match uint("max_tokens")? {
        Some(0) => return Err(wrong("max_tokens")),
        Some(n) => n as usize,
        None => max_tokens,
    };
    let stop = match obj.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => {
            a.iter().map(|s| s.as_str().map(str::to_string).ok_or_else(|| wrong("stop"))).collect::<Result<_, _>>()?
        }
        Some(_) => return Err(wrong("stop")),
    };
    let cache_salt = match obj.get("cache_salt") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
        Some(_) => return Err(wrong("cache_salt")),
    };
    let stop = StopConditions { max_tokens, stop_token_ids: stop_ids.to_vec(), stop };
    Ok(Request { prompt, sampling, stop, cache_salt, ..Default::default() })
}

pub fn main(a: Args, device: qinfer::loader::Device) -> Result<()> {
    let text = std::fs::read_to_string(&a.input).with_context(|| format!("reading {}", a.input.display()))?;
    let mut model: LoadedModel = open_model(a.model.as_ref())?;
    let tok = Arc::new(model.tokenizer.take().context("`qinfer batch` needs a model with a tokenizer")?);
    let defaults = a.sampling.resolve(&model.sampling_defaults);
    let stop_ids = if a.ignore_eos { Vec::new() } else { stop_tokens(&model, Some(&tok)) };
    let model = crate::common::SpeculativeKind::target(a.engine.speculative.as_ref(), model)?;
    let lm: Arc<dyn qinfer::models::LanguageModel> = Arc::from(model.load(device, true)?);
    let cfg = a.engine.config(lm.as_ref(), &device);
    eprintln!("{}", crate::common::kv_pool_summary(lm.as_ref(), &cfg, &device));
    let adapter = a.lora.place(lm.as_ref())?;
    let draft = match &a.engine.speculative {
        Some(kind) => kind.load_draft(device, Some(&tok))?,
        None => None,
    };
    let mut core = EngineCore::with_draft(lm.clone(), Some(tok.clone()), cfg, draft)?;

    // Parse every line; a bad one becomes its error result, the rest run.
    let mut results: Vec<(Value, Option<Value>)> = Vec::new();
    let mut failed = 0;
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let id = serde_json::from_str::<Value>(line).ok().and_then(|v| v.get("id").cloned()).unwrap_or(Value::Null);
        let row = results.len();
        let added = parse_line(line, &tok, &defaults, a.max_tokens, &stop_ids)
            .and_then(|req| core.add(row as u64, Request { adapter, ..req }).map_err(|e| e.to_string()));
        if let Err(e) = added {
            eprintln!("{}:{}: {e}", a.input.display(), i + 1);
            results.push((id.clone(), Some(json!({"id": id, "error": format!("line {}: {e}", i + 1)}))));
            failed += 1;
        } else {
            results.push((id, None));
        }
    }
    let total = results.len() - failed;
    let bar = indicatif::ProgressBar::new(total as u64).with_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} requests, {msg} [{elapsed_precise}]")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let mut acc: HashMap<u64, (Vec<u32>, String)> = HashMap::new();
    let (t0, mut generated) = (Instant::now(), 0usize);
    while core.num_unfinished() > 0 {
        for out in core.step()? {
            generated += out.token_ids.len();
            let e = acc.entry(out.id).or_default();
            e.0.extend(&out.token_ids);
            e.1.push_str(&out.text);
            if let Some(finish) = out.finish {
                let (tokens, text) = acc.remove(&out.id).unwrap_or_default();
                let row = &mut results[out.id as usize];
                let reason = match finish {
                    FinishReason::Stop => "stop",
                    FinishReason::Length | FinishReason::Abort => "length",
                };
                row.1 = Some(json!({
                    "id": row.0,
                    "text": text,
                    "tokens": tokens,
                    "finish_reason": reason,
                    "usage": {"prompt_tokens": out.usage.prompt_tokens, "completion_tokens": out.usage.completion_tokens},
                }));
                bar.inc(1);
            }
        }
        bar.set_message(format!("{:.1} tok/s generated", generated as f64 / t0.elapsed().as_secs_f64().max(1e-9)));
    }
    bar.finish();
    write_whole(&a.output, results.into_iter().map(|(_, r)| r.expect("every request finished")))?;
    eprintln!(
        "{total} requests, {generated} tokens generated in {:.2} s ({:.1} tok/s), {} preemptions",
        t0.elapsed().as_secs_f64(),
        generated as f64 / t0.elapsed().as_secs_f64().max(1e-9),
        core.preemptions()
    );
    let spec = core.speculative_stats();
    if spec.verifications > 0 {
        eprintln!(
            "speculative decoding: {} of {} draft tokens accepted ({:.0}%) in {} verifications",
            spec.accepted,
            spec.drafted,
            100.0 * spec.acceptance(),
            spec.verifications
        );
    }
    if failed > 0 {
        bail!(
            "{failed} of {} lines were not valid requests (their errors are in {})",
            total + failed,
            a.output.display()
        );
    }
    Ok(())
}

/// Writes one JSON line per result to a temporary file beside `path`, then
/// renames it over `path`: a reader never sees part of the results.
fn write_whole(path: &Path, rows: impl Iterator<Item = Value>) -> Result<()> {
    let tmp = path.with_extension("partial");
    let mut f =
        std::io::BufWriter::new(std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?);
    for r in rows {
        serde_json::to_writer(&mut f, &r)?;
        f.write_all(b"\n")?;
    }
    f.into_inner().map_err(|e| e.into_error())?.sync_all()?;
    std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))
}
