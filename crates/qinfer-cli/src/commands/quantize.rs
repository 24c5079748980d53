//! `qinfer quantize`: write an MLX affine-quantized copy of a Hugging Face model.

use std::path::PathBuf;

use anyhow::Result;
use qinfer::quantize::{QuantizeOptions, Recipe, parse_dtype, quantize};

#[derive(clap::Args)]
pub struct Args {
    /// Hugging Face model directory (safetensors; llama, qwen2, qwen3, qwen3_moe,
    /// qwen3_next, qwen3_5 or qwen3_5_moe).
    #[arg(long)]
    model: PathBuf,
    /// Bits per weight: 2, 3, 4, 5, 6 or 8.
    #[arg(long, default_value_t = 4)]
    bits: u32,
    /// Values sharing one scale and bias: 32, 64 or 128.
    #[arg(long, default_value_t = 64)]
    group_size: usize,
    /// mlx-lm mixed-precision recipe: mixed_2_6, mixed_3_4, mixed_3_6 or mixed_4_6
    /// (low_high bits). v_proj and down_proj get the high width on the first and
    /// last eighth of the layers and every third layer between; lm_head always;
    /// all else the low width. Overrides --bits for the weights it names.
    #[arg(long)]
    mixed: Option<String>,
    /// Storage dtype of the unquantized tensors, scales and biases, as mlx-lm's
    /// `--dtype`: float16, bfloat16 or float32. Default: config.json's
    /// `torch_dtype` (or `text_config.dtype`), else as stored.
    #[arg(long)]
    dtype: Option<String>,
    /// Output directory (must not exist unless --force).
    #[arg(long)]
    out: PathBuf,
    /// Replace an existing output directory.
    #[arg(long)]
    force: bool,
}

pub fn main(a: Args) -> Result<()> {
    let recipe = a.mixed.as_deref().map(Recipe::parse).transpose()?;
    let dtype = a.dtype.as_deref().map(parse_dtype).transpose()?;
    let opts = QuantizeOptions { bits: a.bits, group_size: a.group_size, recipe, dtype, force: a.force };
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template("quantizing {bar:40} {pos}/{len} tensors {elapsed}")
            .expect("static template"),
    );
    quantize(&a.model, &a.out, &opts, &|done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    })?;
    bar.finish_and_clear();
    eprintln!("wrote {}", a.out.display());
    Ok(())
}
