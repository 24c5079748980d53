//! `qinfer bench --image-size PX`: a multimodal model's image costs. encode:
//! the vision tower over one square image; ttft: time to first token of an
//! image and `-p` text tokens against a text prompt of as many tokens, each
//! alone in the engine; stall: what one image request arriving costs
//! `--image-decoders` requests that are decoding (their longest gap between
//! tokens and the time lost over their usual step, in steps).

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, ensure};
use qinfer::engine::core::{EngineConfig, EngineCore};
use qinfer::engine::request::{Request, StopConditions};
use qinfer::image::{ImageProcessorConfig, PreparedImage, prepare_rgb};
use qinfer::models::LanguageModel;
use serde_json::{Value, json};

/// What the image rows measure.
pub struct ImageBench {
    /// The square image's side in pixels.
    pub side: usize,
    /// Text tokens after the image.
    pub text_tokens: usize,
    /// Requests decoding when the image request arrives.
    pub decoders: usize,
    pub repetitions: usize,
    pub max_batched_tokens: usize,
}

/// A smooth colour field with a little high-frequency texture, different
/// for each `seed`: content does not change the work, but each request must
/// bring an image the engine has not encoded before (it keeps the tokens of
/// images it has seen).
fn synthetic_rgb(side: usize, seed: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(side * side * 3);
    for y in 0..side {
        for x in 0..side {
            let t = (x * 7 + y * 13 + seed) % 17;
            out.push(((x * 255) / side.max(1)) as u8 ^ t as u8);
            out.push(((y * 255) / side.max(1)) as u8);
            out.push((((x + y) * 127) / side.max(1)) as u8 ^ (t as u8) << 2);
        }
    }
    out
}

fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn mean(xs: &[f64]) -> f64 {
    xs.iter().sum::<f64>() / xs.len().max(1) as f64
}

struct Prompts {
    /// One fresh image per use.
    images: Vec<Arc<PreparedImage>>,
    /// `<vision_start>`, the image's tokens, `<vision_end>`, then the text.
    with_image: Vec<u32>,
    vocab: usize,
    /// Token ids below every vision marker: the text tokens' range.
    text_range: u32,
}

impl Prompts {
    /// `n` text tokens, distinct for each `seed`, none a vision marker.
    fn text(&self, n: usize, seed: u64) -> Vec<u32> {
        super::bench::seeded_tokens(n, self.vocab, seed).into_iter().map(|t| t % self.text_range).collect()
    }
}

fn prompts(lm: &dyn LanguageModel, b: &ImageBench, processor: Option<&ImageProcessorConfig>) -> Result<Prompts> {
    let cfg = lm.config();
    let vision = cfg.vision.as_ref().context("--image-size needs a model with a vision tower (Qwen3.5)")?;
    ensure!(lm.takes_images(), "this model takes no images on {}", lm.device());
    let processor = processor.cloned().unwrap_or(ImageProcessorConfig {
        patch_size: vision.patch_size,
        temporal_patch_size: vision.temporal_patch_size,
        merge_size: vision.spatial_merge_size,
        ..Default::default()
    });
    // Encode warm-up and runs, TTFT warm-up and runs, stall runs.
    let uses = 2 * (b.repetitions.max(1) + 1) + b.repetitions.max(1);
    let images = (0..uses)
        .map(|seed| prepare_rgb(&synthetic_rgb(b.side, seed), b.side, b.side, &processor).map(Arc::new))
        .collect::<qinfer::Result<Vec<_>>>()?;
    let n = images[0].tokens(vision.spatial_merge_size);
    let markers = [vision.image_token_id, vision.vision_start_token_id, vision.vision_end_token_id];
    let text_range = markers.into_iter().min().unwrap_or(cfg.vocab_size as u32).min(cfg.vocab_size as u32);
    let mut p = Prompts { images, with_image: Vec::new(), vocab: cfg.vocab_size, text_range };
    let mut ids = vec![vision.vision_start_token_id];
    ids.extend(std::iter::repeat_n(vision.image_token_id, n));
    ids.push(vision.vision_end_token_id);
    ids.extend(p.text(b.text_tokens, 1));
    p.with_image = ids;
    Ok(p)
}

fn engine(lm: &Arc<dyn LanguageModel>, b: &ImageBench, seqs: usize, tokens: usize) -> Result<EngineCore> {
    let block = qinfer::kv::blocks::DEFAULT_BLOCK_SIZE;
    let cfg = EngineConfig {
        max_batched_tokens: b.max_batched_tokens,
        max_num_seqs: seqs,
        block_size: block,
        num_blocks: seqs * tokens.div_ceil(block) + 4,
        max_model_len: lm.config().max_position_embeddings,
        prefix_cache: None,
        speculative: None,
    };
    Ok(EngineCore::new(lm.clone(), None, cfg)?)
}

fn request(prompt: Vec<u32>, image: Option<&Arc<PreparedImage>>, max_tokens: usize) -> Request {
    let stop = StopConditions { max_tokens, ..Default::default() };
    Request { prompt, stop, images: image.into_iter().cloned().collect(), ..Default::default() }
}

/// Milliseconds from queueing `req` alone to its first token.
fn time_to_first_token(core: &mut EngineCore, id: u64, req: Request) -> Result<f64> {
    let t = Instant::now();
    core.add(id, req)?;
    while core.num_unfinished() > 0 {
        if core.step()?.iter().any(|o| o.id == id && !o.token_ids.is_empty()) {
            break;
        }
    }
    let ms = t.elapsed().as_secs_f64() * 1e3;
    while core.num_unfinished() > 0 {
        core.step()?;
    }
    Ok(ms)
}

pub fn rows(
    lm: &Arc<dyn LanguageModel>,
    b: &ImageBench,
    processor: Option<&ImageProcessorConfig>,
) -> Result<Vec<Value>> {
    let p = prompts(lm.as_ref(), b, processor)?;
    let reps = b.repetitions.max(1);
    let mut fresh = p.images.iter();
    let mut next_image = move || fresh.next().cloned().expect("one image per use was made");
    let first = next_image();
    let image_tokens = first.tokens(lm.config().vision.as_ref().map_or(2, |v| v.spatial_merge_size));
    let mut rows = Vec::new();

    lm.encode_image(&first)?;
    let mut encode = Vec::new();
    for _ in 0..reps {
        let img = next_image();
        let t = Instant::now();
        lm.encode_image(&img)?;
        encode.push(t.elapsed().as_secs_f64() * 1e3);
    }
    rows.push(json!({"test": "encode", "side": b.side, "grid": first.grid, "patches": first.patches(),
        "image_tokens": image_tokens, "avg_ms": mean(&encode), "samples_ms": encode}));

    let total = p.with_image.len();
    let mut core = engine(lm, b, 1, total + 2)?;
    time_to_first_token(&mut core, 0, request(p.text(total, 2), None, 1))?;
    time_to_first_token(&mut core, 1, request(p.with_image.clone(), Some(&next_image()), 1))?;
    let (mut with_image, mut text, mut seen) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..reps as u64 {
        text.push(time_to_first_token(&mut core, 10 + 2 * r, request(p.text(total, 100 + r), None, 1))?);
        let img = next_image();
        seen.push(img.clone());
        let req = request(p.with_image.clone(), Some(&img), 1);
        with_image.push(time_to_first_token(&mut core, 11 + 2 * r, req)?);
    }
    let (ti, tt) = (mean(&with_image), mean(&text));
    // The same images again (a later turn of a conversation): their tokens
    // are kept, the prompt is computed again.
    let mut again = Vec::new();
    for (r, img) in seen.iter().enumerate() {
        let req = request(p.with_image.clone(), Some(img), 1);
        again.push(time_to_first_token(&mut core, 500 + r as u64, req)?);
    }
    rows.push(json!({"test": "ttft", "prompt_tokens": total, "image_tokens": image_tokens,
        "text_tokens": b.text_tokens, "image_avg_ms": ti, "text_avg_ms": tt, "ratio": ti / tt,
        "seen_image_avg_ms": mean(&again), "image_samples_ms": with_image, "text_samples_ms": text,
        "seen_image_samples_ms": again}));

    // Decoders in their steady state, then one image request per repetition.
    let (warm, after) = (8, 8);
    let decode_len = 32;
    let n_gen = (warm + after + 8) * (reps + 1) + 64;
    let mut core = engine(lm, b, b.decoders + 1, total.max(decode_len + n_gen) + 2)?;
    for d in 0..b.decoders as u64 {
        core.add(1000 + d, request(p.text(decode_len, 1000 + d), None, n_gen))?;
    }
    let step = |core: &mut EngineCore| -> Result<(f64, bool)> {
        let t = Instant::now();
        let out = core.step()?;
        let image_token = out.iter().any(|o| o.id < 1000 && !o.token_ids.is_empty());
        Ok((t.elapsed().as_secs_f64() * 1e3, image_token))
    };
    while core.num_running() < b.decoders || core.num_waiting() > 0 {
        step(&mut core)?;
    }
    let mut stalls = Vec::new();
    for r in 0..reps as u64 {
        let base: Vec<f64> = (0..warm).map(|_| step(&mut core).map(|s| s.0)).collect::<Result<_>>()?;
        let base = median(&base);
        let t = Instant::now();
        core.add(r, request(p.with_image.clone(), Some(&next_image()), 1))?;
        let add_ms = t.elapsed().as_secs_f64() * 1e3;
        let mut gaps = Vec::new();
        loop {
            let (ms, first) = step(&mut core)?;
            gaps.push(ms);
            if first {
                break;
            }
        }
        gaps[0] += add_ms;
        for _ in 0..after {
            step(&mut core)?;
        }
        let lost: f64 = gaps.iter().map(|g| g - base).sum();
        let max_gap = gaps.iter().cloned().fold(0.0, f64::max);
        stalls.push(json!({"base_step_ms": base, "add_ms": add_ms, "gaps_ms": gaps, "steps": gaps.len(),
            "max_gap_ms": max_gap, "max_gap_steps": max_gap / base, "lost_ms": lost, "lost_steps": lost / base}));
    }
    let of = |k: &str| -> Vec<f64> { stalls.iter().map(|s| s[k].as_f64().unwrap_or(0.0)).collect() };
    rows.push(json!({"test": "stall", "decoders": b.decoders, "max_batched_tokens": b.max_batched_tokens,
        "avg_lost_steps": mean(&of("lost_steps")), "avg_max_gap_steps": mean(&of("max_gap_steps")),
        "avg_base_step_ms": mean(&of("base_step_ms")), "runs": stalls}));
    Ok(rows)
}

/// The rows as a table: one figure per test.
pub fn print(file: &str, device: &str, rows: &[Value]) {
    println!("| model | backend | test | result |");
    println!("| --- | --- | --- | --- |");
    for r in rows {
        let f = |k: &str| r[k].as_f64().unwrap_or(0.0);
        let result = match r["test"].as_str().unwrap_or("") {
            "encode" => format!("{:.1} ms for {} patches ({} tokens)", f("avg_ms"), r["patches"], r["image_tokens"]),
            "ttft" => format!(
                "{:.1} ms with the image ({:.1} ms seen before), {:.1} ms text only ({} tokens): {:.2}×",
                f("image_avg_ms"),
                f("seen_image_avg_ms"),
                f("text_avg_ms"),
                r["prompt_tokens"],
                f("ratio")
            ),
            "stall" => {
                format!("{:.2} steps lost per image by {} decoding requests", f("avg_lost_steps"), r["decoders"])
            }
            _ => String::new(),
        };
        println!("| {file} | {device} | {} | {result} |", r["test"].as_str().unwrap_or(""));
    }
}
