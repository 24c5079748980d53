//! `qinfer quantize`: write an MLX affine-quantized or block-FP8 copy of a
//! Hugging Face model.

use std::path::PathBuf;

use anyhow::{Result, bail};
use qinfer::quantize::{Fp8QuantizeOptions, QuantizeOptions, Recipe, parse_dtype, quantize, quantize_fp8};

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Format {
    /// MLX affine groups, as `mlx_lm.convert -q` writes them.
    Mlx,
    /// Block-scaled FP8 (E4M3) in the layout of Qwen's FP8 checkpoints.
    Fp8,
}

#[derive(clap::Args)]
pub struct Args {
    /// Hugging Face model directory (safetensors; llama, qwen2, qwen3, qwen3_moe,
    /// qwen3_next, qwen3_5 or qwen3_5_moe).
    #[arg(long)]
    model: PathBuf,
    /// What to write: `mlx` (affine groups, the options below) or `fp8`
    /// (E4M3 weights with a scale per --block-size block, as Qwen's FP8
    /// checkpoints; transformers and vLLM load it).
    #[arg(long, value_enum, default_value = "mlx")]
    format: Format,
    /// FP8 only: rows,columns of the blocks sharing a scale.
    #[arg(long, default_value = "128,128")]
    block_size: String,
    /// Bits per weight: 2, 3, 4, 5, 6 or 8 (MLX; default 4).
    #[arg(long)]
    bits: Option<u32>,
    /// Values sharing one scale and bias: 32, 64 or 128 (MLX; default 64).
    #[arg(long)]
    group_size: Option<usize>,
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

fn parse_block(s: &str) -> Result<[usize; 2]> {
    let dims: Option<Vec<usize>> = s.split(',').map(|d| d.trim().parse().ok().filter(|&d| d > 0)).collect();
    match dims.as_deref() {
        Some(&[r, c]) => Ok([r, c]),
        _ => bail!("--block-size: expected two positive integers ROWS,COLS (e.g. 128,128), found `{s}`"),
    }
}

pub fn main(a: Args) -> Result<()> {
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template("quantizing {bar:40} {pos}/{len} tensors {elapsed}")
            .expect("static template"),
    );
    let progress = |done: usize, total: usize| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    };
    match a.format {
        Format::Fp8 => {
            let mlx_only = [
                ("--bits", a.bits.is_some()),
                ("--group-size", a.group_size.is_some()),
                ("--mixed", a.mixed.is_some()),
                ("--dtype", a.dtype.is_some()),
            ];
            if let Some((flag, _)) = mlx_only.iter().find(|(_, given)| *given) {
                bail!("{flag} is an MLX option; --format fp8 takes --block-size");
            }
            let opts = Fp8QuantizeOptions { block: parse_block(&a.block_size)?, force: a.force };
            quantize_fp8(&a.model, &a.out, &opts, &progress)?;
        }
        Format::Mlx => {
            let recipe = a.mixed.as_deref().map(Recipe::parse).transpose()?;
            let dtype = a.dtype.as_deref().map(parse_dtype).transpose()?;
            let opts = QuantizeOptions {
                bits: a.bits.unwrap_or(4),
                group_size: a.group_size.unwrap_or(64),
                recipe,
                dtype,
                force: a.force,
            };
            quantize(&a.model, &a.out, &opts, &progress)?;
        }
    }
    bar.finish_and_clear();
    eprintln!("wrote {}", a.out.display());
    Ok(())
}
