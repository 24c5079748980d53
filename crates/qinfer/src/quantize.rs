//! `qinfer quantize`: a Hugging Face safetensors model → an MLX affine-quantized
//! model that mlx-lm loads (the layout `mlx_lm.convert -q` writes for dense models).
//!
//! Quantized, as mlx-lm's `quantize_model` chooses: every 2-D `*.weight` (the
//! linear layers and the embedding) whose row length is a multiple of the group
//! size. Everything else (norms, biases) is copied as stored. Groups are
//! quantized exactly as `mx.quantize` does ([`quantize_group`]); scales and
//! biases are stored in the weight's own dtype, as mlx does.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::affine::{AffineParams, pack, quantize_group};
use crate::config::Architecture;
use crate::loader;
use crate::tensor::DType;
use crate::{Error, Result};

/// mlx-lm's mixed-precision recipes (`mlx_lm.convert --quant-predicate`),
/// following llama.cpp's Q4_K_M choices: `v_proj` and `down_proj` get the high
/// width on the first and last eighth of the layers and on every third layer in
/// between (`i < L/8 or i >= 7L/8 or (i - L/8) % 3 == 2`), `lm_head` always;
/// everything else the low width.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recipe {
    Mixed2_6,
    Mixed3_4,
    Mixed3_6,
    Mixed4_6,
}

impl Recipe {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "mixed_2_6" => Ok(Recipe::Mixed2_6),
            "mixed_3_4" => Ok(Recipe::Mixed3_4),
            "mixed_3_6" => Ok(Recipe::Mixed3_6),
            "mixed_4_6" => Ok(Recipe::Mixed4_6),
            other => Err(Error::Invalid(format!(
                "unknown recipe `{other}`; expected mixed_2_6, mixed_3_4, mixed_3_6 or mixed_4_6"
            ))),
        }
    }
    /// (low, high) bits.
    fn bits(self) -> (u32, u32) {
        match self {
            Recipe::Mixed2_6 => (2, 6),
            Recipe::Mixed3_4 => (3, 4),
            Recipe::Mixed3_6 => (3, 6),
            Recipe::Mixed4_6 => (4, 6),
        }
    }
    fn bits_for(self, module: &str, num_layers: usize) -> u32 {
        let (low, high) = self.bits();
        let index = module.split('.').find_map(|p| p.parse::<usize>().ok()).unwrap_or(0);
        let l8 = num_layers / 8;
        let more = index < l8 || index >= 7 * num_layers / 8 || (index as i64 - l8 as i64).rem_euclid(3) == 2;
        let wants_high = (module.contains("v_proj") || module.contains("down_proj")) && more;
        if wants_high || module.contains("lm_head") { high } else { low }
    }
}

#[derive(Debug, Clone)]
pub struct QuantizeOptions {
    pub bits: u32,
    pub group_size: usize,
    pub recipe: Option<Recipe>,
    /// Replace an existing output directory.
    pub force: bool,
}

/// Files copied next to the weights when the model has them.
const SIDE_FILES: [&str; 8] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
];

struct Output {
    name: String,
    dtype: &'static str,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

fn st_dtype(d: DType) -> Result<&'static str> {
    match d {
        DType::F32 => Ok("F32"),
        DType::F16 => Ok("F16"),
        DType::BF16 => Ok("BF16"),
        DType::U32 => Ok("U32"),
        DType::Q4_0
        | DType::Q4_1
        | DType::Q5_0
        | DType::Q5_1
        | DType::Q8_0
        | DType::Q2_K
        | DType::Q3_K
        | DType::Q4_K
        | DType::Q5_K
        | DType::Q6_K => Err(Error::Invalid(format!("{} input cannot be requantized", d.name()))),
    }
}

fn encode(values: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::BF16 => values.iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect(),
        DType::F16 => values.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect(),
        DType::F32
        | DType::U32
        | DType::Q4_0
        | DType::Q4_1
        | DType::Q5_0
        | DType::Q5_1
        | DType::Q8_0
        | DType::Q2_K
        | DType::Q3_K
        | DType::Q4_K
        | DType::Q5_K
        | DType::Q6_K => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

/// Quantizes the model in `src` into a new directory `out`. `progress` is
/// called with (tensors done, total) as the work advances.
pub fn quantize(src: &Path, out: &Path, opts: &QuantizeOptions, progress: &dyn Fn(usize, usize)) -> Result<()> {
    if out.exists() && !opts.force {
        return Err(Error::Invalid(format!("{} exists; pass --force to replace it", out.display())));
    }
    let model = loader::open(src)?;
    match model.config.arch {
        Architecture::Llama | Architecture::Qwen2 | Architecture::Qwen3 => {}
        Architecture::Qwen3Moe | Architecture::Qwen3Next | Architecture::Qwen35 | Architecture::Qwen35Moe => {
            return Err(Error::Invalid(format!(
                "quantize writes dense models (llama, qwen2, qwen3); {} needs mlx-lm's expert stacking and \
                 norm conventions, which it does not write yet",
                model.config.arch.name()
            )));
        }
    }
    if model.source.names().iter().any(|n| n.ends_with(".scales")) {
        return Err(Error::Invalid(format!("{} is already quantized", src.display())));
    }
    let default = AffineParams::new(opts.bits, opts.group_size, "--bits/--group-size")?;
    let names = model.source.names();
    let mut outputs = Vec::new();
    let mut modules = BTreeMap::new();
    for (i, name) in names.iter().enumerate() {
        let t = model.source.tensor(name)?;
        let module = name.strip_suffix(".weight");
        match module {
            Some(m) if t.shape.len() == 2 && t.shape[1].is_multiple_of(opts.group_size) => {
                let bits = opts.recipe.map_or(default.bits, |r| r.bits_for(m, model.config.num_layers));
                let params = AffineParams::new(bits, opts.group_size, "--mixed")?;
                if opts.recipe.is_some() {
                    modules.insert(m.to_string(), params);
                }
                let (rows, cols) = (t.shape[0], t.shape[1]);
                let w = t.to_f32_vec();
                let mut levels = vec![0u8; w.len()];
                let (mut scales, mut biases) = (Vec::new(), Vec::new());
                for (g, q) in w.chunks_exact(opts.group_size).zip(levels.chunks_exact_mut(opts.group_size)) {
                    let (s, b) = quantize_group(g, bits, q);
                    scales.push(s);
                    biases.push(b);
                }
                let mut packed = Vec::with_capacity(params.row_bytes(cols) * rows);
                pack(bits, &levels, &mut packed);
                let groups = vec![rows, cols / opts.group_size];
                let dt = st_dtype(t.dtype)?;
                outputs.push(Output {
                    name: name.clone(),
                    dtype: "U32",
                    shape: vec![rows, cols * bits as usize / 32],
                    bytes: packed,
                });
                outputs.push(Output {
                    name: format!("{m}.scales"),
                    dtype: dt,
                    shape: groups.clone(),
                    bytes: encode(&scales, t.dtype),
                });
                outputs.push(Output {
                    name: format!("{m}.biases"),
                    dtype: dt,
                    shape: groups,
                    bytes: encode(&biases, t.dtype),
                });
            }
            _ => outputs.push(Output {
                name: name.clone(),
                dtype: st_dtype(t.dtype)?,
                shape: t.shape.clone(),
                bytes: t.data.as_slice().to_vec(),
            }),
        }
        progress(i + 1, names.len());
    }
    let mut quant = json!({"group_size": opts.group_size, "bits": opts.bits, "mode": "affine"});
    for (m, p) in &modules {
        quant[m] = json!({"group_size": p.group_size, "bits": p.bits, "mode": "affine"});
    }
    let cfg_path = src.join("config.json");
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).map_err(|e| Error::io(&cfg_path, e))?)
            .map_err(|e| Error::malformed(&cfg_path, e.to_string()))?;
    cfg["quantization"] = quant.clone();
    cfg["quantization_config"] = quant;

    // Everything goes to a sibling temporary directory, renamed into place at
    // the end, so an error never leaves a partial model at `out`.
    let tmp = out.with_file_name(format!(
        ".{}.tmp-{}",
        out.file_name().and_then(|n| n.to_str()).unwrap_or("out"),
        std::process::id()
    ));
    let result = write_dir(&tmp, src, &cfg, &outputs);
    if let Err(e) = result {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    if out.exists() {
        std::fs::remove_dir_all(out).map_err(|e| Error::io(out, e))?;
    }
    std::fs::rename(&tmp, out).map_err(|e| Error::io(out, e))
}

fn write_dir(dir: &Path, src: &Path, cfg: &Value, outputs: &[Output]) -> Result<()> {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let io = |p: PathBuf| move |e| Error::io(p.clone(), e);
    let cfg_text = serde_json::to_string_pretty(cfg).map_err(|e| Error::Invalid(e.to_string()))?;
    std::fs::write(dir.join("config.json"), cfg_text).map_err(io(dir.join("config.json")))?;
    for f in SIDE_FILES {
        if src.join(f).exists() {
            std::fs::copy(src.join(f), dir.join(f)).map_err(io(src.join(f)))?;
        }
    }
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), json!({"format": "mlx"}));
    let mut offset = 0usize;
    for o in outputs {
        header.insert(
            o.name.clone(),
            json!({"dtype": o.dtype, "shape": o.shape, "data_offsets": [offset, offset + o.bytes.len()]}),
        );
        offset += o.bytes.len();
    }
    let mut h = Value::Object(header).to_string().into_bytes();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut file = (h.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(&h);
    for o in outputs {
        file.extend_from_slice(&o.bytes);
    }
    let st = dir.join("model.safetensors");
    std::fs::write(&st, file).map_err(io(st.clone()))?;
    // mlx-lm's save_model always writes an index, even for one shard.
    let weight_map: serde_json::Map<String, Value> =
        outputs.iter().map(|o| (o.name.clone(), Value::from("model.safetensors"))).collect();
    let index = json!({"metadata": {"total_size": offset}, "weight_map": weight_map});
    let ip = dir.join("model.safetensors.index.json");
    std::fs::write(&ip, index.to_string()).map_err(io(ip.clone()))
}
