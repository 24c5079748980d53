//! The CUDA backend: f32 activations on the device, weights kept in their
//! stored type (bf16, f16, f32) in device memory, kernels from the .cu files
//! (NVRTC, see compile.rs), cuBLAS for multi-row GEMMs. Everything stays on one
//! stream. The CUDA libraries load at run time, so this builds without CUDA.
//!
//! The `Backend` ops are infallible by signature; a failing CUDA call records a
//! sticky error, later launches are skipped, and the model's forward returns
//! the error through [`Backend::check`].

/// Launches kernel `$name` with `$cfg` and the arguments, unless an earlier
/// call failed; records a failure. (Defined before the submodules that use it.)
macro_rules! launch {
    ($self:expr, $name:expr, $cfg:expr, $($arg:expr),* $(,)?) => {{
        let args: Vec<Arg> = vec![$(Arg::from($arg)),*];
        $self.launch_args($name, $cfg, &args);
    }};
}

mod compile;
mod moe;
mod moe_prefill;
mod sampling;
mod types;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::cublas::CudaBlas;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::driver::sys::{self, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaContext, CudaFunction, CudaGraph, CudaSlice, CudaStream, DevicePtr, LaunchConfig};

use super::{AttentionShape, Backend, DEVICE_PICK, ExpertWeights, GdnWeights, QkvShape, Routing};
use crate::config::rope::Rope;
use crate::config::{GdnConfig, RopeStyle};
use crate::kv::{KvCache, KvPrecision};
use crate::sampling::SamplingParams;
use crate::tensor::{DType, Tensor};
use crate::{Error, Result};
pub use compile::prebuild as prebuild_kernels;
pub use types::{AffineSide, AffineWeight, BufferPool, CudaAct, CudaGdnState, CudaKv, CudaWeight, QuantizedRow};

const KERNEL_NAMES: &[&str] = &[
    "embed_bf16",
    "embed_f16",
    "embed_f32",
    "f32_to_bf16",
    "f32_to_f16",
    "f32_split_bf16",
    "f32_split_f16",
    "add_bias",
    "rms_norm",
    "rope",
    "attention",
    "silu_mul",
    "add_assign",
    "mul_sigmoid",
    "copy_columns",
    "gather_rows",
    "scatter_add_rows",
    "gdn_conv_bf16",
    "gdn_conv_f16",
    "gdn_conv_f32",
    "gdn_prepare",
    "gdn_recurrent",
    "attention_split",
    "attention_combine",
    "set_step",
    "attention_decode64",
    "attention_decode128",
    "attention_decode256",
    "attention_decode64_prologue",
    "attention_decode128_prologue",
    "attention_decode256_prologue",
    "kv_append",
    "qkv_prologue",
    "attention_f16",
    "attention_split_f16",
    "attention_decode64_f16",
    "attention_decode128_f16",
    "attention_decode256_f16",
    "attention_decode64_prologue_f16",
    "attention_decode128_prologue_f16",
    "attention_decode256_prologue_f16",
    "kv_append_f16",
    "qkv_prologue_f16",
    "swiglu",
    "flash_prefill64",
    "flash_prefill128",
    "flash_prefill256",
    "kv_to_half",
    "gdn_scan128",
    "gdn_conv_rows_bf16",
    "gdn_conv_rows_f16",
    "gdn_conv_rows_f32",
    "gdn_conv_window",
    "gdn_decode128",
    "gdn_chunk_prep",
    "gdn_chunk_state",
    "moe_route",
    "moe_count",
    "moe_offsets",
    "moe_scatter_bf16",
    "moe_scatter_f16",
    "moe_gather_combine",
    "moe_gemm_bf16",
    "moe_gemm_f16",
    "moe_gemv_bf16",
    "moe_gemv_f16",
    "moe_gemv_f32",
    "moe_combine",
    "moe_swiglu_bf16",
    "moe_swiglu_f16",
    "moe_swiglu_f32",
    "moe_down_bf16",
    "moe_down_f16",
    "moe_down_f32",
    "sample_argmax",
    "sample_filtered",
    "sample_top_k",
    "sample_penalty",
];

/// Device addresses of the gated delta rule's inputs: rows of q and k
/// `qk_stride` floats apart, of v `v_stride`, of a and b `ab_stride` (each
/// may be columns of wider stacked rows). q and k are normalized in place.
struct DeltaRuleInputs {
    q: u64,
    k: u64,
    v: u64,
    a: u64,
    b: u64,
    qk_stride: usize,
    v_stride: usize,
    ab_stride: usize,
}

/// Value columns per block of `gdn_scan128` (`GDN_SCAN_COLS`).
const GDN_SCAN_COLS: usize = 16;

/// Tokens per chunk of the chunked delta rule (`GDN_CHUNK` in gdn_chunked.cu):
/// prompts of at least this many tokens take it (key heads of 128).
const GDN_CHUNK: usize = 64;

/// Value columns per block of `gdn_chunk_state` (`GDN_CHUNK_COLS`).
const GDN_CHUNK_COLS: usize = 32;

/// Tokens per launch pair of the chunked delta rule. Its per-chunk operands
/// take 160 KB a chunk and value head at dv = 128 (84 MB for 1024 tokens of
/// the 4B hybrid's 32 value heads); longer prompts reuse them slice by slice.
const GDN_CHUNK_SLICE: usize = 1024;

/// Floats a row of the state or V' of `gdn_chunk_state` takes in shared
/// memory past the block's value columns (`GCK_SP_PAD`).
const GDN_CHUNK_STATE_PAD: usize = 8;

/// Dynamic shared memory of a `gdn_chunk_state` block, as the kernel carves
/// it: two chunks' A fragments (3 × 32 KB each), the state's and V''s rows.
const GDN_CHUNK_STATE_SHARED: usize =
    2 * 3 * 2048 * 16 + (128 + GDN_CHUNK) * (GDN_CHUNK_COLS + GDN_CHUNK_STATE_PAD) * 4;

/// Floats a q or k row of `gdn_chunk_prep` takes in shared memory (`GCK_PITCH`).
const GDN_CHUNK_QK_PITCH: usize = 132;

/// Floats a row of A or P of `gdn_chunk_prep` takes in shared memory (`GCK_TRI`).
const GDN_CHUNK_TRI_PITCH: usize = 68;

/// Columns a U | W row of `gdn_chunk_prep` is rounded up to (`GCK_X_ALIGN`).
const GDN_CHUNK_X_ALIGN: usize = 32;

/// Floats a U | W row of `gdn_chunk_prep` takes past that rounding (`GCK_X_PAD`).
const GDN_CHUNK_X_PAD: usize = 8;

/// Floats a U | W row of `gdn_chunk_prep` takes (the kernel's `gck_x_pitch`):
/// value and key columns, rounded up, then padded.
fn gdn_chunk_x_pitch(dv: usize) -> usize {
    (dv + 128).div_ceil(GDN_CHUNK_X_ALIGN) * GDN_CHUNK_X_ALIGN + GDN_CHUNK_X_PAD
}

/// Dynamic shared memory of a `gdn_chunk_prep` block, as the kernel carves
/// it: q and k rows, U | W rows (`gck_x_pitch`), A and P rows, four scalars
/// a token.
fn gdn_chunk_prep_shared(dv: usize) -> usize {
    let floats = 2 * GDN_CHUNK * GDN_CHUNK_QK_PITCH
        + GDN_CHUNK * gdn_chunk_x_pitch(dv)
        + 2 * GDN_CHUNK * GDN_CHUNK_TRI_PITCH
        + 4 * GDN_CHUNK;
    floats * 4
}

/// Rows per thread of `gdn_conv_rows` (`GDN_CONV_RUN`).
const GDN_CONV_RUN: usize = 16;

/// Rows up to which the GDN conv walks the rows in one launch (decode); longer
/// inputs take every row at once and a second launch for the window.
const GDN_CONV_WALKED_ROWS: usize = 8;

/// Keys per block of the split-K decode attention (`ATTN_CHUNK` in kernels.cu).
const ATTENTION_CHUNK: usize = 128;

/// Keys times head dim of one `attention_decode{head_dim}` block that holds
/// the whole cache (`DECODE_ONE_BLOCK`): its key rows, and as many values.
const DECODE_ONE_BLOCK: usize = 16384;

/// Static shared memory of `attention_decode` (q, scores, sums: at most
/// 8.3 KB) and the 1 KB the driver reserves per block, rounded up.
const DECODE_STATIC_SHARED: usize = 10 * 1024;

/// Every id of `ids` names a row of a `rows`-row embedding table, except a
/// one-token pass's [`DEVICE_PICK`] (the step inputs hold its id).
fn check_token_ids(ids: &[u32], rows: usize) -> Result<()> {
    let device_pick = ids == [DEVICE_PICK];
    match ids.iter().find(|&&id| id as usize >= rows && !device_pick) {
        Some(id) => Err(Error::Invalid(format!("token id {id} is out of range for a vocabulary of {rows}"))),
        None => Ok(()),
    }
}

/// The token id the step inputs hold after a pick fed on the device
/// (sampling.rs `sample_ahead_on_device`): the host does not
/// know it ([`DEVICE_PICK`]).
const PICK_ON_DEVICE: i32 = -1;

/// Keys whose key and value rows an `attention_decode{head_dim}` block holds
/// when one block takes the whole cache: DECODE_ONE_BLOCK / head_dim (128 KB
/// of f32 rows, 64 KB of f16 ones), or the largest power of two that fits a
/// device giving a block less shared memory (`max_shared`, opt-in). None
/// below 32 keys: the plain split kernel then.
fn decode_whole_keys(head_dim: usize, max_shared: usize, kv: KvPrecision) -> Option<usize> {
    let room = max_shared.saturating_sub(DECODE_STATIC_SHARED);
    let mut keys = DECODE_ONE_BLOCK / head_dim;
    while keys >= 32 && decode_shared(keys, head_dim, kv) > room {
        keys /= 2;
    }
    (keys >= 32).then_some(keys)
}

/// How `attention_decode` covers `n_keys` keys of a `kv` cache when one
/// block holds `whole` keys: (keys per block, blocks). A cache that fits one
/// block is one block's (no combine); a longer one is split in chunks of 64
/// KB of rows where the whole block's f32 rows are 128 KB (half the keys in
/// f32, all of them in f16; at least 32), so three blocks share an SM, their
/// number a power of two so one recorded step serves every cache length up
/// to it. (f16 chunks of half a block, 32 KB, made decode after 8192 tokens
/// 8-9% slower than 64 KB ones, and of a quarter 18-24%: run 83.)
fn decode_plan(n_keys: usize, whole: usize, kv: KvPrecision) -> (usize, usize) {
    if n_keys <= whole {
        return (whole, 1);
    }
    let chunk = (whole * 2 / kv.bytes()).max(32);
    (chunk, n_keys.div_ceil(chunk).next_power_of_two())
}

/// Whether a one-row decode step over `n_keys` keys (one block holding
/// `whole`) folds the q|k|v prologue into the decode attention: where a
/// cache one block holds, and with `fold_splits` where the split kernel's
/// blocks fit one wave (every (KV head, chunk, pair of query heads) block has
/// an SM). Longer caches do not: each of their blocks norms and rotates its
/// query heads again, which waves of blocks cannot hide (the fold everywhere
/// measured tg32 after 8192 tokens 2-11% slower; at 512 keys the fold made an
/// 8B q4g64 layer 3.0% faster, session-ab.txt run 100).
fn folds_prologue(
    n_keys: usize,
    whole: usize,
    kv: KvPrecision,
    shape: &QkvShape,
    sm_count: usize,
    fold_splits: bool,
) -> bool {
    let (_, splits) = decode_plan(n_keys, whole, kv);
    let pairs = (shape.num_heads / shape.num_kv_heads).div_ceil(DECODE_FUSED_HEADS);
    splits == 1 || (fold_splits && splits * shape.num_kv_heads * pairs <= sm_count)
}

/// Bytes of dynamic shared memory of an `attention_decode{head_dim}` block
/// of `chunk` keys: its key rows, at least as many as the warps' value sums
/// fill (`decode_red_keys`: 8 warps' f32 sums of `DECODE_HEADS` heads), then
/// its value rows.
fn decode_shared(chunk: usize, head_dim: usize, kv: KvPrecision) -> usize {
    let red_keys = 8 * DECODE_HEADS * 4 / kv.bytes();
    (chunk.max(red_keys) + chunk) * head_dim * kv.bytes()
}

/// Dynamic shared memory of an `attention_decode{head_dim}` block that holds
/// the whole cache (`whole` keys): an f16 cache's block asks for what an f32
/// cache's takes (where the device allows), twice its rows. At short
/// contexts the decode attention is the step's critical path, and the
/// smaller blocks share their SMs with more of the GEMV blocks launched
/// behind them: Qwen3-0.6B bf16 decoded at 1382 tok/s with 64 KB blocks and
/// 1466 with 128 KB, the other models within 0.2% either way; the whole
/// SM's shared memory cost 0.6B q4g64 5% (session-ab.txt run 87).
fn decode_whole_shared(whole: usize, head_dim: usize, kv: KvPrecision, max_shared: usize) -> usize {
    let room = max_shared.saturating_sub(DECODE_STATIC_SHARED);
    decode_shared(whole, head_dim, kv).max(decode_shared(whole, head_dim, KvPrecision::F32).min(room))
}

/// The name suffix of the kernels that read or write a cache of `kv`.
fn kv_suffix(kv: KvPrecision) -> &'static str {
    match kv {
        KvPrecision::F16 => "_f16",
        KvPrecision::F32 => "",
    }
}

/// Index of a precision in per-precision tables.
fn kv_slot(kv: KvPrecision) -> usize {
    match kv {
        KvPrecision::F16 => 0,
        KvPrecision::F32 => 1,
    }
}

/// Threads of an `attention_combine` block.
const COMBINE_THREADS: usize = 256;

/// Output values of a head per `attention_combine` block (`COMBINE_DIMS`).
const COMBINE_DIMS: usize = 32;

/// Bytes of dynamic shared memory of `attention_combine` merging `splits`
/// parts: a weight per split, and each warp's partial sums.
fn combine_shared(splits: usize) -> usize {
    (splits + COMBINE_THREADS / 32 * COMBINE_DIMS) * 4
}

/// The tiling of `flash_prefill{head_dim}` (`FLASH_PREFILL` in flash.cu):
/// query rows and threads per block, keys per tile, and its shared memory in
/// bytes (f16 q rows and two stages of k and v tiles, rows padded by 8).
struct FlashTile {
    rows: usize,
    threads: usize,
    shared: usize,
}

fn flash_tile(head_dim: usize) -> FlashTile {
    let (keys, warps) = if head_dim > 128 { (32, 4) } else { (64, 8) };
    let rows = 16 * warps;
    FlashTile { rows, threads: 32 * warps, shared: 2 * (rows + 2 * 2 * keys) * (head_dim + 8) }
}

/// Query heads per block of the GQA decode attention (`DECODE_HEADS`).
const DECODE_HEADS: usize = 4;

/// Query heads per block of the decode attention that folds the q|k|v
/// prologue (`DECODE_FUSED_HEADS`).
const DECODE_FUSED_HEADS: usize = 2;

/// Values per prefill tile of dequantized affine weights (bf16 scratch of 128 MiB).
const AFFINE_TILE_VALUES: usize = 64 << 20;

/// Rows at or below this go through the GEMV kernel; above, cuBLAS.
const GEMV_MAX_ROWS: usize = 8;

/// The GEMV kernels' weight formats (`gemv_{format}_r{rows}a{act}`).
const GEMV_WEIGHTS: &[&str] = &[
    "bf16",
    "f16",
    "f32",
    "affine2",
    "affine3",
    "affine4",
    "affine5",
    "affine6",
    "affine8",
    "affine2_bf16",
    "affine3_bf16",
    "affine4_bf16",
    "affine5_bf16",
    "affine6_bf16",
    "affine8_bf16",
    "affine4_k",
    "affine5_k",
];

/// Affine formats of groups of 16 only: Q2_K, Q3_K and Q6_K's super-block
/// records.
const G16_ONLY_WEIGHTS: &[&str] = &["affine2_k", "affine3_k", "affine6_k"];

/// Every affine format's kernels besides its GEMVs, and the GEMVs of
/// groups of 16 (`gemv_{format}_g16_r{R}a{A}`: f32 scales, or records).
fn affine_kernel_names() -> impl Iterator<Item = String> {
    let affine = GEMV_WEIGHTS.iter().filter(|f| f.starts_with("affine"));
    affine
        .clone()
        .flat_map(|f| [format!("moe_gemv_{f}"), format!("moe_swiglu_{f}"), format!("moe_down_{f}")])
        .chain(affine.clone().chain(G16_ONLY_WEIGHTS).flat_map(|f| {
            [format!("{f}_to_bf16"), format!("moe_{f}_to_bf16"), format!("moe_gemm_{f}"), format!("embed_{f}")]
        }))
        .chain(affine.filter(|f| !f.contains('_')).chain(G16_ONLY_WEIGHTS).flat_map(|f| {
            GEMV_SHAPES
                .iter()
                .map(move |(r, a)| gemv_kernel(&format!("{f}_g16"), *r, *a))
                .chain(["moe_gemv", "moe_swiglu", "moe_down"].map(|k| format!("{k}_{f}_g16")))
        }))
        .chain(
            GEMV_WEIGHTS
                .iter()
                .filter(|f| AFFINE_ROWS_FORMATS.iter().any(|a| f.starts_with(a)))
                .map(|f| format!("gemv_{f}_rows")),
        )
        .chain(affine_mma_kernels())
}

/// The tensor-core affine decode GEMVs (affine_mma.cu), `gemv_{format}_mma_g{group}`
/// and their `_swiglu` forms: (format, bits, groups).
const AFFINE_MMA_KERNELS: &[(&str, usize, &[usize])] = &[
    ("affine4", 4, &[32, 64, 128]),
    ("affine4_bf16", 4, &[32, 64, 128]),
    ("affine8", 8, &[32, 64]),
    ("affine8_bf16", 8, &[32, 64]),
    ("affine4_k", 4, &[32]),
];

fn affine_mma_kernels() -> impl Iterator<Item = String> {
    AFFINE_MMA_KERNELS.iter().flat_map(|(f, _, groups)| {
        groups.iter().flat_map(move |g| [format!("gemv_{f}_mma_g{g}"), format!("gemv_{f}_mma_g{g}_swiglu")])
    })
}

/// Activation rows the tensor-core affine GEMV takes (`AMMA_MAX_ACT`).
const AFFINE_MMA_MAX_ACT: usize = 4;

/// Stages of each warp's ring in the tensor-core affine GEMV (`AMMA_STAGES`).
const AFFINE_MMA_STAGES: usize = 3;

/// Shared memory left out of a kernel's dynamic allowance (the device's
/// opt-in maximum per block, which counts static and dynamic together): room
/// for the static arrays (block reductions' scratch) of the kernels that take
/// the whole allowance.
const STATIC_SHARED_ROOM: usize = 1024;

/// Dynamic shared memory the tensor-core affine GEMV may use.
const AFFINE_MMA_MAX_SHARED: usize = 200 * 1024;
/// At most this much, two of its blocks fit on an SM (228 KiB, less 1 KiB
/// reserved and 4 KiB static per block).
const AFFINE_MMA_TWO_PER_SM: usize = 108 * 1024;

/// Shared memory of a tensor-core affine GEMV launch, None when the kernel
/// does not apply: per warp (8) a ring of `AFFINE_MMA_STAGES` stages, each 16 rows of 128
/// bytes of levels (4 units of 64 columns at 4 bits, 2 at 8) plus their
/// scales and biases; then each activation row staged as two signed bytes
/// per column and 12 bytes per 64 columns (its sum and scale, and its Σx²
/// when the kernel folds an RMSNorm; 20 with groups of 32, a sum per half),
/// for one row 12 bytes per 16 columns (a row handed on quantized).
/// Groups of 32 take at most 2 activation rows.
fn affine_mma_shared_size(w: &AffineWeight, act_rows: usize) -> Option<usize> {
    let (bits, group) = (w.params.bits as usize, w.params.group_size);
    let has_kernel =
        AFFINE_MMA_KERNELS.iter().any(|(f, b, groups)| *f == w.format() && *b == bits && groups.contains(&group));
    if !has_kernel {
        return None;
    }
    let units = if bits == 4 { 4 } else { 2 };
    let (scales, biases) = w.side_bytes(units * 64);
    let stage = 16 * 128 + 16 * (scales + biases);
    let unit_stats = if group == 32 { 20 } else { 12 };
    // One row may come quantized by slices of 16 ([`QuantizedRow`]): 12 bytes each.
    let stats = if act_rows == 1 { w.cols / 16 * 12 } else { act_rows * (w.cols / 64 * unit_stats) };
    let shared = 8 * AFFINE_MMA_STAGES * stage + act_rows * 2 * w.cols + stats;
    let max_act = if group == 32 { 2 } else { AFFINE_MMA_MAX_ACT };
    let applies =
        w.cols.is_multiple_of(units * 64) && (1..=max_act).contains(&act_rows) && shared <= AFFINE_MMA_MAX_SHARED;
    applies.then_some(shared)
}

/// Word-aligned affine formats, which have `gemv_{format}_rows` kernels.
const AFFINE_ROWS_FORMATS: &[&str] = &["affine2", "affine4", "affine8"];

/// Weight rows per block of `gemv_affine*_rows` (`AFFINE_BLOCK_ROWS`).
const AFFINE_BLOCK_ROWS: usize = 8;

/// The GEMV kernels compiled: (weight rows per block, activation-row bound).
const GEMV_SHAPES: &[(usize, usize)] = &[(1, 1), (2, 1), (4, 1), (1, 8), (2, 8)];
/// The shapes of the float GEMVs' gate|up → silu·up form (`{kernel}_swiglu`).
const GEMV_SWIGLU_SHAPES: &[(usize, usize)] = &[(2, 1), (4, 1), (2, 8)];

fn gemv_kernel(ty: &str, rows_per_block: usize, act: usize) -> String {
    format!("gemv_{ty}_r{rows_per_block}a{act}")
}

/// How a GEMV is launched: output rows per block and threads per block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemvShape {
    rows_per_block: usize,
    threads: u32,
}

impl GemvShape {
    /// 1, 2 or 4 rows per block (at most 2 for several activation rows);
    /// whole warps, at most 256 threads (the kernels' launch bound).
    pub fn new(rows_per_block: usize, threads: u32) -> Result<Self> {
        if !matches!(rows_per_block, 1 | 2 | 4) || !threads.is_multiple_of(32) || !(32..=256).contains(&threads) {
            return Err(Error::Invalid(format!(
                "GEMV launch shape {rows_per_block} rows × {threads} threads: rows must be 1, 2 or 4, threads \
                 a multiple of 32 from 32 to 256"
            )));
        }
        Ok(GemvShape { rows_per_block, threads })
    }

    /// The shape for `out_dim × in_dim` weights of 16-byte chunks of `vec`
    /// values and `act` activation rows.
    pub(crate) fn choose(out_dim: usize, in_dim: usize, vec: usize, act: usize) -> Self {
        let chunks = in_dim.div_ceil(vec);
        // Every thread takes at least two chunks of each row; at most 256 threads.
        let threads = (chunks.div_ceil(2).div_ceil(32) * 32).clamp(32, 256) as u32;
        let rows_per_block = if act > 1 {
            2
        } else if out_dim >= 4096 {
            4
        } else {
            2
        };
        GemvShape { rows_per_block, threads }
    }
}

/// The kernels' name suffix for matrices stored as `dtype`, and the values
/// in one 16-byte load. `upload` keeps matrices as bf16, f16 or f32 only.
fn float_format(dtype: DType) -> (&'static str, usize) {
    match dtype {
        DType::BF16 => ("bf16", 8),
        DType::F16 => ("f16", 8),
        _ => ("f32", 4),
    }
}

/// Key chunks of `attention_split`'s split-K attention over `n_keys` keys: a
/// power of two, so one recorded step serves every cache length up to it.
fn split_count(n_keys: usize) -> usize {
    n_keys.div_ceil(ATTENTION_CHUNK).next_power_of_two()
}

/// The recorded decode step that serves `n_keys` keys: every layer's
/// attention plan (`decode_plan`, `split_count`) changes only where
/// n_keys / 32 crosses a power of two.
fn decode_step_key(n_keys: usize) -> usize {
    n_keys.div_ceil(DECODE_ONE_BLOCK / 512).next_power_of_two()
}

pub struct CudaBackend {
    ordinal: usize,
    device_name: String,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    kernels: HashMap<String, CudaFunction>,
    error: Mutex<Option<String>>,
    /// Fill every new activation with NaN (kernel tests: unwritten outputs show).
    poison: bool,
    /// Multi-row GEMMs see activations as two bf16/f16 halves (two GEMMs)
    /// instead of one rounding: twice the FLOPs, ~16-bit activations.
    split_activations: bool,
    /// MoE prefill: the most rows a chosen expert may average for the
    /// grouped expert GEMM, for every storage (moe_prefill.rs); None for the
    /// measured default (`grouped_rows_default`).
    grouped_moe_rows: Option<usize>,
    /// Whether one-row decode steps over a split cache fold the q|k|v
    /// prologue into the decode attention where its blocks fit one wave.
    fold_split_prologue: bool,
    /// How new KV caches store keys and values.
    kv_precision: KvPrecision,
    /// Record decode steps as CUDA graphs and replay them.
    graphs: bool,
    /// Launch kernels with programmatic stream serialization (compute
    /// capability 9.0 and later): each may be scheduled, and read weights,
    /// while the one before it finishes (see `grid_dependency_wait`).
    overlap_launches: bool,
    /// A fixed GEMV launch shape instead of the per-shape choice (profiling).
    gemv_shape: Option<GemvShape>,
    /// Decode steps replayed so far (shared with whoever asked to watch).
    replays: Arc<AtomicUsize>,
    /// Keys the attention kernel's shared memory holds.
    max_attention_keys: usize,
    /// Per cache precision ([`kv_slot`]) and head dim 64, 128, 256: the keys
    /// one decode attention block holds ([`decode_whole_keys`]); per head
    /// dim, whether the prefill's tensor-core tiles fit a block.
    decode_whole: [[Option<usize>; 3]; 2],
    flash: [bool; 3],
    /// Dynamic shared memory a tensor-core affine GEMV block may take here.
    affine_mma_max_shared: usize,
    /// Dynamic shared memory any block may opt into on this device.
    max_block_shared: usize,
    /// Streaming multiprocessors: grid size of the kernels that loop over
    /// their work (the tensor-core affine GEMV).
    sm_count: usize,
    /// RoPE inverse frequencies on the device, by their bits: uploaded once,
    /// not on every call (a host-to-device copy would stall the stream).
    rope_tables: Mutex<HashMap<Vec<u32>, CudaSlice<f32>>>,
    /// Activation buffers for reuse (see [`BufferPool`]).
    pool: Arc<BufferPool>,
    /// The pass's first position and one-token id on the device (`set_step`
    /// in kernels.cu), and the host's record of what was last written there.
    step: CudaSlice<i32>,
    step_written: Mutex<Option<[i32; 2]>>,
    /// Set when `set_step` was the last launch: the next kernel is launched
    /// without overlap, so every kernel may read the step inputs before its
    /// wait (they were written at least two launches before it, or the
    /// launch before it had finished when it started).
    after_step_write: std::sync::atomic::AtomicBool,
    /// Whether the last kernel launched was an attention kernel.
    after_attention: std::sync::atomic::AtomicBool,
    /// While a decode step is recorded: the arena its buffers come from, and
    /// whether the stream is capturing (nothing may be allocated then).
    recording: Mutex<Option<(Arc<BufferPool>, bool)>>,
    /// Held for the length of each [`Backend::run_step`].
    pass: Mutex<()>,
    /// The sampling kernels' buffers (see sampling.rs).
    sampling: Mutex<sampling::SampleScratch>,
    /// Device pointer tables of MoE layers' experts (see moe.rs).
    moe_tables: Mutex<HashMap<Vec<u64>, Arc<moe::ExpertTables>>>,
}

/// A raw device pointer for a kernel argument (one stream, no event tracking).
fn ptr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    let (p, _sync) = s.device_ptr(stream);
    p
}

fn blocks(n: usize, threads: u32) -> (u32, u32, u32) {
    (n.div_ceil(threads as usize).max(1) as u32, 1, 1)
}

pub(crate) fn cfg(grid: (u32, u32, u32), threads: u32, shared: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: grid, block_dim: (threads, 1, 1), shared_mem_bytes: shared }
}

/// Device pointers of a q|k|v prologue ([`CudaBackend::prologue_inputs`]).
struct PrologueInputs {
    kv: KvRows,
    q_norm: u64,
    k_norm: u64,
    inv_freq: u64,
}

/// A layer's key and value rows on the device, and how they are stored.
#[derive(Clone, Copy)]
struct KvRows {
    keys: u64,
    values: u64,
    precision: KvPrecision,
}

/// A kernel argument: a device pointer or a scalar.
#[derive(Clone, Copy)]
pub(crate) enum Arg {
    Ptr(u64),
    I32(i32),
    I64(i64),
    F32(f32),
}

impl From<u64> for Arg {
    fn from(v: u64) -> Self {
        Arg::Ptr(v)
    }
}
impl From<i32> for Arg {
    fn from(v: i32) -> Self {
        Arg::I32(v)
    }
}
impl From<i64> for Arg {
    fn from(v: i64) -> Self {
        Arg::I64(v)
    }
}
impl From<f32> for Arg {
    fn from(v: f32) -> Self {
        Arg::F32(v)
    }
}

impl CudaBackend {
    /// A K-quant matrix `t` (Q2_K … Q6_K): its affine levels, and one
    /// record per 256 values of a row (formats/gguf/as_affine.rs
    /// `superblock_records`) for its scales and biases. The f32 scales and
    /// biases of the full affine form are never built.
    fn upload_superblocks(&self, t: &Tensor) -> Result<CudaWeight> {
        use crate::quant::gguf_affine::{affine_levels, superblock_records};
        let no_form = || Error::tensor(&t.name, format!("{} has no super-block records", t.dtype.name()));
        let levels = affine_levels(t).ok_or_else(no_form)??;
        let records = superblock_records(t).ok_or_else(no_form)??;
        // Every K-quant is one of these, with rows of whole 256-value blocks.
        let takes_records = matches!((levels.params.bits, levels.params.group_size), (4 | 5, 32) | (2 | 3 | 6, 16));
        if !takes_records || !levels.cols.is_multiple_of(256) {
            return Err(Error::tensor(
                &t.name,
                format!("{} bits in groups of {}: no record kernels", levels.params.bits, levels.params.group_size),
            ));
        }
        Ok(CudaWeight::Affine(AffineWeight {
            params: levels.params,
            rows: levels.rows,
            cols: levels.cols,
            packed: self.upload_slice(&levels.packed),
            scales: self.upload_slice(&records),
            // Not read (records hold the biases too); one word so the pointer is a real one.
            biases: self.upload_slice(&[0u8; 4]),
            side: AffineSide::Records,
        }))
    }

    /// True when the CUDA libraries load and at least one device is visible:
    /// callers that may skip GPU work (tests) ask this, then treat any
    /// failure of [`CudaBackend::new`] as an error.
    pub fn available() -> bool {
        // SAFETY: only tries to open the shared libraries.
        let libs = unsafe {
            cudarc::driver::sys::is_culib_present()
                && cudarc::nvrtc::sys::is_culib_present()
                && cudarc::cublas::sys::is_culib_present()
        };
        libs && CudaContext::device_count().map(|n| n > 0).unwrap_or(false)
    }

    /// Opens device `ordinal` and compiles (or loads cached) kernels for it.
    pub fn new(ordinal: usize) -> Result<Self> {
        let err = |what: &str, e: &dyn std::fmt::Display| Error::Invalid(format!("cuda:{ordinal}: {what}: {e}"));
        // cudarc panics on first use of a library it cannot load: look first.
        // SAFETY: only tries to open the shared libraries.
        let present = unsafe {
            [
                ("the CUDA driver (libcuda)", cudarc::driver::sys::is_culib_present()),
                ("NVRTC (libnvrtc)", cudarc::nvrtc::sys::is_culib_present()),
                ("cuBLAS (libcublas)", cudarc::cublas::sys::is_culib_present()),
            ]
        };
        if let Some((lib, _)) = present.iter().find(|(_, ok)| !ok) {
            return Err(Error::Invalid(format!("cuda:{ordinal}: {lib} is not installed or not on the library path")));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| err("cannot open the device", &e))?;
        // One stream: no cross-stream events needed on every launch.
        // SAFETY: called before any allocation on this context.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx.compute_capability().map_err(|e| err("compute capability", &e))?;
        let device_name = ctx.name().map_err(|e| err("device name", &e))?;
        // Hopper's architecture-specific features need the `a` target.
        let suffix = if major >= 9 { "a" } else { "" };
        let arch = format!("compute_{major}{minor}{suffix}");
        let modules = compile::ptx(&arch)?
            .into_iter()
            .zip(compile::UNITS)
            .map(|(ptx, unit)| ctx.load_module(ptx).map_err(|e| err(&format!("loading {}", unit.name), &e)))
            .collect::<Result<Vec<_>>>()?;
        let mut kernels = HashMap::new();
        let gemv_names = GEMV_WEIGHTS.iter().flat_map(|t| GEMV_SHAPES.iter().map(move |(r, a)| gemv_kernel(t, *r, *a)));
        let swiglu_names = ["bf16", "f16", "f32"]
            .iter()
            .flat_map(|t| GEMV_SWIGLU_SHAPES.iter().map(move |(r, a)| format!("{}_swiglu", gemv_kernel(t, *r, *a))));
        let names = KERNEL_NAMES.iter().map(|n| n.to_string()).chain(gemv_names).chain(swiglu_names);
        for name in names.chain(affine_kernel_names()) {
            let f = modules
                .iter()
                .find_map(|m| m.load_function(&name).ok())
                .ok_or_else(|| err(&name, &"no kernel of this name in any .cu file"))?;
            kernels.insert(name, f);
        }
        // The simple attention kernel keeps one score per key in shared memory:
        // let it use all the device allows per block.
        let max_shared = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .unwrap_or(48 * 1024);
        // What a kernel's dynamic shared memory may take.
        let block_shared = max_shared as usize - STATIC_SHARED_ROOM;
        // Dynamic shared memory beyond the default 48 KB, per kernel.
        let allow_shared = |name: &str, bytes: i32, what: &str| {
            kernels[name]
                .set_attribute(
                    cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    bytes,
                )
                .map_err(|e| err(what, &e))
        };
        allow_shared("attention", block_shared as i32, "attention shared memory")?;
        allow_shared("attention_f16", block_shared as i32, "attention shared memory")?;
        allow_shared("attention_combine", block_shared as i32, "attention combine shared memory")?;
        allow_shared("gdn_chunk_prep", block_shared as i32, "chunked delta rule shared memory")?;
        allow_shared(
            "gdn_chunk_state",
            GDN_CHUNK_STATE_SHARED.min(block_shared) as i32,
            "chunked delta rule shared memory",
        )?;
        allow_shared("sample_top_k", sampling::TOP_K_SHARED as i32, "top-k sampling shared memory")?;
        // The tensor-core affine GEMV takes what the device allows up to its
        // own cap; launches needing more take the CUDA-core kernel.
        let affine_mma_max_shared = AFFINE_MMA_MAX_SHARED.min(block_shared);
        // The one-row decode chain of affine models (the tensor-core GEMVs
        // and the decode attention between them) asks for one split of an
        // SM's L1 and shared memory: all of it shared. An SM changes its
        // split only when idle, so a kernel launched to overlap one whose
        // split differs finds no room beside it. With the driver's choice
        // (the least that fits each launch) the 8 blocks of the 8B decode
        // attention held their SMs alone, and as many blocks of the o
        // projection after it started only once it ended. Kernels that read
        // through L1 (the bf16 GEMV takes x from it) keep the driver's
        // choice: all of them at this split made 8B bf16 decode 10% slower.
        let prefer_shared = |name: &str| {
            kernels[name]
                .set_attribute(
                    cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                    100,
                )
                .map_err(|e| err(name, &e))
        };
        for name in affine_mma_kernels() {
            allow_shared(&name, affine_mma_max_shared as i32, "affine GEMV shared memory")?;
            prefer_shared(&name)?;
        }
        for name in kernels.keys().filter(|n| n.starts_with("moe_gemm_")) {
            allow_shared(name, moe_prefill::GROUPED_SHARED as i32, "grouped MoE GEMM shared memory")?;
            prefer_shared(name)?;
        }
        let sm_count = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| err("multiprocessor count", &e))? as usize;
        // Not the legacy default stream: CUDA graphs cannot be captured from it.
        // Per head dim, what the device's shared memory allows: the decode
        // attention's rows (else the plain split kernel) and the prefill's
        // tensor-core tiles (else the exact attention kernel).
        let mut decode_whole = [[None; 3]; 2];
        let mut flash = [false; 3];
        for (i, hd) in [64, 128, 256].into_iter().enumerate() {
            for kv in [KvPrecision::F16, KvPrecision::F32] {
                let whole = decode_whole_keys(hd, max_shared as usize, kv);
                decode_whole[kv_slot(kv)][i] = whole;
                let Some(whole) = whole else { continue };
                let suffix = kv_suffix(kv);
                for name in [format!("attention_decode{hd}{suffix}"), format!("attention_decode{hd}_prologue{suffix}")]
                {
                    prefer_shared(&name)?;
                    kernels[&name]
                        .set_attribute(
                            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                            decode_whole_shared(whole, hd, kv, max_shared as usize) as i32,
                        )
                        .map_err(|e| err("decode attention shared memory", &e))?;
                }
            }
            flash[i] = flash_tile(hd).shared <= block_shared;
            if flash[i] {
                kernels[&format!("flash_prefill{hd}")]
                    .set_attribute(
                        cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        flash_tile(hd).shared as i32,
                    )
                    .map_err(|e| err("flash attention shared memory", &e))?;
            }
        }
        let stream = ctx.new_stream().map_err(|e| err("creating a stream", &e))?;
        let blas = CudaBlas::new(stream.clone()).map_err(|e| err("cuBLAS", &e))?;
        let step = stream.alloc_zeros::<i32>(2).map_err(|e| err("allocating the step inputs", &e))?;
        let sampling = sampling::SampleScratch::new(&stream).map_err(|e| err("allocating the sampling buffers", &e))?;
        Ok(CudaBackend {
            ordinal,
            device_name,
            stream,
            blas,
            kernels,
            error: Mutex::new(None),
            poison: false,
            split_activations: false,
            grouped_moe_rows: None,
            fold_split_prologue: true,
            kv_precision: KvPrecision::default(),
            graphs: true,
            overlap_launches: major >= 9,
            gemv_shape: None,
            replays: Arc::new(AtomicUsize::new(0)),
            max_attention_keys: block_shared / 4,
            decode_whole,
            flash,
            affine_mma_max_shared,
            max_block_shared: block_shared,
            sm_count,
            rope_tables: Mutex::new(HashMap::new()),
            pool: Arc::new(BufferPool::default()),
            step,
            step_written: Mutex::new(None),
            after_step_write: std::sync::atomic::AtomicBool::new(false),
            after_attention: std::sync::atomic::AtomicBool::new(false),
            recording: Mutex::new(None),
            pass: Mutex::new(()),
            sampling,
            moe_tables: Mutex::new(HashMap::new()),
        })
    }

    fn launch_args(&self, name: &str, cfg: LaunchConfig, args: &[Arg]) {
        if self.failed() {
            return;
        }
        let Some(f) = self.kernels.get(name) else {
            return self.record(Err("no such kernel in kernels.cu"), name);
        };
        self.after_attention.store(name.starts_with("attention_"), Ordering::Relaxed);
        // Each argument in an 8-byte slot, its value in the first bytes (as
        // the driver reads a parameter of that size through the slot's address).
        let mut slots: Vec<[u8; 8]> = args
            .iter()
            .map(|a| {
                let mut slot = [0u8; 8];
                match a {
                    Arg::Ptr(p) => slot.copy_from_slice(&p.to_ne_bytes()),
                    Arg::I32(v) => slot[..4].copy_from_slice(&v.to_ne_bytes()),
                    Arg::I64(v) => slot.copy_from_slice(&v.to_ne_bytes()),
                    Arg::F32(v) => slot[..4].copy_from_slice(&v.to_ne_bytes()),
                }
                slot
            })
            .collect();
        let mut params: Vec<*mut std::ffi::c_void> = slots.iter_mut().map(|s| s.as_mut_ptr().cast()).collect();
        // Programmatic stream serialization: the kernel may be scheduled while
        // the one before it finishes; it waits for it in `grid_dependency_wait`
        // (kernels.cu), which every kernel calls before touching activations.
        let mut attrs = [sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value: sys::CUlaunchAttributeValue { programmaticStreamSerializationAllowed: 1 },
        }];
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: attrs.as_mut_ptr(),
            numAttrs: u32::from(self.overlap_launches && !self.after_step_write.swap(false, Ordering::Relaxed)),
        };
        let bound = self.stream.context().bind_to_thread();
        self.record(bound, "binding the CUDA context");
        // SAFETY: every pointer argument points into a live allocation of at
        // least the size the kernel indexes, which the calling op's shapes
        // ensure; `params` holds one pointer per kernel parameter, each to a
        // slot that outlives the call, and the function belongs to this
        // stream's context.
        let r = unsafe { sys::cuLaunchKernelEx(&config, f.cu_function(), params.as_mut_ptr(), std::ptr::null_mut()) };
        self.record(r.result(), name);
    }

    /// The first failure recorded so far, without waiting for the device.
    fn recorded_error(&self) -> Result<()> {
        match self.error.lock().ok().and_then(|e| e.clone()) {
            Some(e) => Err(Error::Invalid(format!("cuda:{}: {e}", self.ordinal))),
            None => Ok(()),
        }
    }

    fn failed(&self) -> bool {
        self.error.lock().map(|e| e.is_some()).unwrap_or(true)
    }

    fn record<E: std::fmt::Display>(&self, r: std::result::Result<(), E>, what: &str) {
        if let Err(e) = r
            && let Ok(mut slot) = self.error.lock()
            && slot.is_none()
        {
            *slot = Some(format!("{what}: {e}"));
        }
    }

    /// A device buffer of `n` zeros (one element after a failure, never used then).
    fn zeros<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(&self, n: usize) -> CudaSlice<T> {
        match self.stream.alloc_zeros::<T>(n.max(1)) {
            Ok(s) => s,
            Err(e) => {
                self.record(Err(e), &format!("allocating {n} values"));
                self.stream.alloc_zeros::<T>(1).expect("CUDA cannot allocate even one value")
            }
        }
    }

    /// A device buffer of `n` values left as the allocator hands them over:
    /// for outputs a kernel writes whole (a zeroing memset per op would be one
    /// more launch on the decode path; the poisoned-output tests catch any
    /// element left unwritten).
    fn uninit<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(&self, n: usize) -> CudaSlice<T> {
        // SAFETY: callers write every element before it is read.
        match unsafe { self.stream.alloc::<T>(n.max(1)) } {
            Ok(s) => s,
            Err(e) => {
                self.record(Err(e), &format!("allocating {n} values"));
                self.zeros(1)
            }
        }
    }

    /// New activations are NaN-filled instead of zeroed, so a kernel that
    /// leaves an element unwritten fails its test.
    pub fn with_poisoned_outputs(mut self) -> Self {
        self.poison = true;
        self
    }

    /// Runs every decode step as it comes instead of replaying recorded graphs
    /// (for comparison and debugging; the results are the same).
    pub fn without_graphs(mut self) -> Self {
        self.graphs = false;
        self
    }

    /// Launches each kernel only after the one before it has finished (as
    /// without programmatic dependent launch; for measuring what it gains).
    pub fn without_overlapped_launches(mut self) -> Self {
        self.overlap_launches = false;
        self
    }

    /// Launches every GEMV with `shape` (profiling the choice of shapes).
    pub fn with_gemv_shape(mut self, shape: GemvShape) -> Self {
        self.gemv_shape = Some(shape);
        self
    }

    /// Counts the decode steps replayed from recordings (tests and benchmarks
    /// check that the fast path ran).
    pub fn replay_counter(&self) -> Arc<AtomicUsize> {
        self.replays.clone()
    }

    /// New KV caches store keys and values as `kv` (f16 unless set).
    pub fn with_kv_precision(mut self, kv: KvPrecision) -> Self {
        self.kv_precision = kv;
        self
    }

    /// Prefill GEMMs carry activations at about 16 bits (see `split_activations`).
    pub fn with_split_activations(mut self) -> Self {
        self.split_activations = true;
        self
    }

    /// MoE prefill takes the grouped expert GEMM where the chosen experts
    /// would average at most `rows` rows (0: never, `usize::MAX`: always),
    /// whatever the experts' storage, one cuBLAS GEMM per expert otherwise;
    /// for tests and for measuring the crossover (the results agree within
    /// the GEMMs' f32 summation order).
    pub fn with_grouped_moe_rows(mut self, rows: usize) -> Self {
        self.grouped_moe_rows = Some(rows);
        self
    }

    /// Decode steps over a split cache run the q|k|v prologue as its own
    /// kernel, as long caches do (for measuring what folding it gains; the
    /// results are the same).
    pub fn without_split_prologue_folding(mut self) -> Self {
        self.fold_split_prologue = false;
        self
    }

    fn act(&self, rows: usize, cols: usize) -> CudaAct {
        let n = (rows * cols).max(1);
        let (pool, capturing) =
            self.recording.lock().ok().and_then(|r| r.clone()).unwrap_or((self.pool.clone(), false));
        let buf = match pool.take(n) {
            Some(b) => b,
            None if capturing => {
                // The warm-up pass allocated every buffer this step uses; a new
                // one now would be a different program than the one that ran.
                self.record(Err(format!("{n} values")), "recording a decode step: a buffer the warm-up did not use");
                return CudaAct::new(rows, cols, self.zeros(1), None);
            }
            None => self.uninit::<f32>(n),
        };
        if self.poison && !self.failed() {
            // SAFETY: the range is exactly the allocation.
            let r = unsafe {
                cudarc::driver::result::memset_d8_async(self.p(&buf), 0xff, buf.len() * 4, self.stream.cu_stream())
            };
            self.record(r, "poisoning an output");
        }
        CudaAct::new(rows, cols, buf, Some(pool))
    }

    /// Makes the device step inputs hold `start` (and `id`, when given), with
    /// a `set_step` launch when they differ from what was last written.
    fn ensure_step(&self, start: usize, id: Option<u32>) {
        let Ok(mut written) = self.step_written.lock() else {
            return self.record(Err("step lock poisoned"), "step inputs");
        };
        if id == Some(DEVICE_PICK) {
            // Only a sampling kernel writes this token, and only the device knows it.
            if *written != Some([start as i32, PICK_ON_DEVICE]) {
                drop(written);
                let e = format!("no pick on the device feeds position {start}");
                self.record(Err(e), "feeding a pick made on the device");
            }
            return;
        }
        let old_id = written.map(|w| w[1]).unwrap_or(0);
        let want = [start as i32, id.map(|i| i as i32).unwrap_or(old_id)];
        if *written == Some(want) {
            return;
        }
        if self.capturing() {
            // A launch captured here would replay these values at every token.
            return self.record(Err("the step inputs changed inside the recorded pass"), "recording a decode step");
        }
        *written = Some(want);
        drop(written);
        launch!(self, "set_step", cfg((1, 1, 1), 1, 0), self.p(&self.step), want[0], want[1]);
        self.after_step_write.store(true, Ordering::Relaxed);
    }

    /// What the host last wrote (or knows) of the device step inputs.
    fn step_inputs(&self) -> Option<[i32; 2]> {
        self.step_written.lock().ok().and_then(|w| *w)
    }

    /// Sets what the host takes the device step inputs to hold, returning
    /// what it took before (no launch: for a capture, which does not run).
    fn set_step_inputs(&self, inputs: Option<[i32; 2]>) -> Option<[i32; 2]> {
        match self.step_written.lock() {
            Ok(mut written) => std::mem::replace(&mut *written, inputs),
            Err(_) => None,
        }
    }

    /// Notes that a sampling kernel has just written the step inputs of position
    /// `start` on the device.
    fn step_fed_on_device(&self, start: usize) {
        match self.step_written.lock() {
            Ok(mut written) => *written = Some([start as i32, PICK_ON_DEVICE]),
            Err(_) => self.record(Err("step lock poisoned"), "step inputs"),
        }
        self.after_step_write.store(true, Ordering::Relaxed);
    }

    fn upload_slice<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(&self, v: &[T]) -> CudaSlice<T> {
        match self.stream.clone_htod(v) {
            Ok(s) => s,
            Err(e) => {
                self.record(Err(e), "host-to-device copy");
                self.zeros(1)
            }
        }
    }

    fn p<T>(&self, s: &CudaSlice<T>) -> u64 {
        ptr(s, &self.stream)
    }

    fn elementwise_cfg(n: usize) -> LaunchConfig {
        cfg(blocks(n, 256), 256, 0)
    }

    /// cuBLAS: y[n, out] = x[n, in] · W[out, in]ᵀ with x converted to W's type
    /// (once, or as hi + lo halves), f32 accumulation and output.
    fn gemm(&self, x: &CudaAct, w: &CudaWeight, y: &mut CudaAct) {
        let CudaWeight::Matrix { dtype, rows: out_dim, cols: in_dim, buf } = w else {
            self.record(Err("expected a matrix weight"), "linear");
            return;
        };
        let inputs = self.gemm_inputs(x, *dtype);
        self.gemm_rows(x, &inputs, *dtype, self.p(buf), *out_dim, *in_dim, self.p(&y.buf), *out_dim, false);
    }

    /// The activations as the GEMM reads them for weights of `dtype`.
    fn gemm_inputs(&self, x: &CudaAct, dtype: DType) -> Vec<CudaSlice<u16>> {
        let count = x.rows * x.cols;
        let bf = match dtype {
            DType::BF16 => true,
            DType::F16 => false,
            _ => return vec![],
        };
        if self.split_activations {
            let (hi, lo) = (self.uninit::<u16>(count), self.uninit::<u16>(count));
            let kernel = if bf { "f32_split_bf16" } else { "f32_split_f16" };
            launch!(self, kernel, Self::elementwise_cfg(count), self.p(&x.buf), self.p(&hi), self.p(&lo), count as i64);
            vec![hi, lo]
        } else {
            let conv = self.uninit::<u16>(count);
            let kernel = if bf { "f32_to_bf16" } else { "f32_to_f16" };
            launch!(self, kernel, Self::elementwise_cfg(count), self.p(&x.buf), self.p(&conv), count as i64);
            vec![conv]
        }
    }

    /// Output columns `[0, rows)` of `y` (row stride `ldy`, at `y_ptr`) from a
    /// weight of `rows × in_dim` values of `dtype` at `w_ptr`; added to what
    /// `y` holds with `accumulate`.
    #[allow(clippy::too_many_arguments)]
    fn gemm_rows(
        &self,
        x: &CudaAct,
        inputs: &[CudaSlice<u16>],
        dtype: DType,
        w_ptr: u64,
        rows: usize,
        in_dim: usize,
        y_ptr: u64,
        ldy: usize,
        accumulate: bool,
    ) {
        let x_ptrs: Vec<u64> =
            if inputs.is_empty() { vec![self.p(&x.buf)] } else { inputs.iter().map(|p| self.p(p)).collect() };
        self.gemm_ptrs(dtype, w_ptr, rows, in_dim, &x_ptrs, x.rows, y_ptr, ldy, accumulate);
    }

    /// `y[n, rows] (+)= x[n, in_dim] · Wᵀ` with W `rows × in_dim` values of
    /// `dtype` at `w_ptr` and x at each of `x_ptrs` in turn (one, or the
    /// high and low halves of split activations, summed), f32 out with row
    /// stride `ldy`.
    #[allow(clippy::too_many_arguments)]
    fn gemm_ptrs(
        &self,
        dtype: DType,
        w_ptr: u64,
        rows: usize,
        in_dim: usize,
        x_ptrs: &[u64],
        n: usize,
        y_ptr: u64,
        ldy: usize,
        accumulate: bool,
    ) {
        let ty = match dtype {
            DType::BF16 => cudaDataType::CUDA_R_16BF,
            DType::F16 => cudaDataType::CUDA_R_16F,
            _ => cudaDataType::CUDA_R_32F,
        };
        let (m, n, k) = (rows as i32, n as i32, in_dim as i32);
        for (i, x_ptr) in x_ptrs.iter().enumerate() {
            if self.failed() {
                return;
            }
            let alpha = 1.0f32;
            let beta = if i == 0 && !accumulate { 0.0f32 } else { 1.0f32 };
            // Column-major view: Yᵀ[out, n] = W[out, in] (row-major = Wᵀ column-major) · Xᵀ.
            // SAFETY: the pointers hold the m×k, k×n and (ldy)×n values cuBLAS reads and writes.
            let r = unsafe {
                cudarc::cublas::result::gemm_ex(
                    *self.blas.handle(),
                    cublasOperation_t::CUBLAS_OP_T,
                    cublasOperation_t::CUBLAS_OP_N,
                    m,
                    n,
                    k,
                    (&alpha as *const f32).cast(),
                    w_ptr as *const _,
                    ty,
                    k,
                    *x_ptr as *const _,
                    ty,
                    k,
                    (&beta as *const f32).cast(),
                    y_ptr as *mut _,
                    cudaDataType::CUDA_R_32F,
                    ldy as i32,
                    cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            };
            self.record(r, "cuBLAS GEMM");
        }
    }

    /// Index of a head dim with its own kernels (64, 128, 256).
    fn head_dim_slot(head_dim: usize) -> Option<usize> {
        [64, 128, 256].iter().position(|&h| h == head_dim)
    }

    /// The keys one `attention_decode{head_dim}` block holds on this device;
    /// None where that kernel does not apply.
    fn decode_whole_keys(&self, head_dim: usize, kv: KvPrecision) -> Option<usize> {
        Self::head_dim_slot(head_dim).and_then(|i| self.decode_whole[kv_slot(kv)][i])
    }

    /// Whether `flash_prefill{head_dim}` exists and its tiles fit a block here.
    fn flash_fits(&self, head_dim: usize) -> bool {
        Self::head_dim_slot(head_dim).is_some_and(|i| self.flash[i])
    }

    /// What the q|k|v prologue of a pass needs, after checking that its
    /// positions continue the cache and reserving the cache's rows: the
    /// layer's key and value rows, the norm weights (0 when absent) and the
    /// rotation's frequencies. None (with the error recorded) when a check fails.
    #[allow(clippy::too_many_arguments)]
    fn prologue_inputs(
        &self,
        qkv: &CudaAct,
        shape: &QkvShape,
        norms: Option<(&CudaWeight, &CudaWeight)>,
        positions: &[usize],
        rope: &Rope,
        cache: &mut CudaKv,
        layer: usize,
    ) -> Option<PrologueInputs> {
        let q_rows = shape.num_heads * shape.head_dim * if shape.output_gate { 2 } else { 1 };
        if qkv.cols != q_rows + 2 * shape.num_kv_heads * shape.head_dim || positions.len() != qkv.rows {
            self.record(Err("q|k|v columns or positions do not match the shape"), "qkv_prologue");
            return None;
        }
        let start = positions.first().copied().unwrap_or(0);
        if start != cache.len() || positions.iter().enumerate().any(|(i, &p)| p != start + i) {
            self.record(Err("positions must continue the cache"), "qkv_prologue");
            return None;
        }
        let r = cache.reserve(&self.stream, layer, qkv.rows);
        self.record(r, "KV cache allocation");
        let (Some(kv), Some(inv_freq)) = (self.kv_rows(cache, layer), self.rope_table(rope)) else {
            return None;
        };
        let norm_ptr = |w: &CudaWeight| match w {
            CudaWeight::Vector(v) => self.p(v),
            _ => 0,
        };
        let (q_norm, k_norm) = norms.map(|(a, b)| (norm_ptr(a), norm_ptr(b))).unwrap_or((0, 0));
        self.ensure_step(start, None);
        Some(PrologueInputs { kv, q_norm, k_norm, inv_freq })
    }

    /// The device rows of `layer`'s keys and values in `cache`, None before
    /// the layer's first write.
    fn kv_rows(&self, cache: &CudaKv, layer: usize) -> Option<KvRows> {
        let (keys, values) = cache.layer(layer)?;
        Some(KvRows { keys: self.p(keys), values: self.p(values), precision: cache.precision() })
    }

    /// Decode attention split over chunks of keys so every SM has work, the
    /// chunks merged by `attention_combine` (with one chunk the kernel writes
    /// the output itself). Head dims of 64/128/256 take `attention_decode`,
    /// blocks over (row·KV head, chunk, group of query heads) sharing each
    /// key and value row; others `attention_split`, a block per (row·head,
    /// chunk).
    /// With `prologue`, `q` is a one-row stacked q|k|v projection and the
    /// decode kernel makes the queries and this pass's key and value rows
    /// itself (`attention_decode{head_dim}_prologue`; the caller checks that
    /// the head dim has a decode kernel here).
    #[allow(clippy::too_many_arguments)]
    fn attention_split(
        &self,
        q: &CudaAct,
        kv: KvRows,
        n_keys: usize,
        s: &AttentionShape,
        out: &CudaAct,
        prologue: Option<&[Arg]>,
    ) {
        let whole = self.decode_whole_keys(s.head_dim, kv.precision);
        let decode = whole.is_some();
        let (chunk, splits) = match whole {
            Some(whole) => decode_plan(n_keys, whole, kv.precision),
            None => (ATTENTION_CHUNK, split_count(n_keys)),
        };
        let row_heads = q.rows * s.num_heads;
        let parts = (splits > 1).then(|| (self.act(row_heads * splits, s.head_dim), self.act(row_heads * splits, 2)));
        let (po, pml, direct) = match &parts {
            Some((o, ml)) => (self.p(&o.buf), self.p(&ml.buf), 0u64),
            None => (0, 0, self.p(&out.buf)),
        };
        let (window, step) = (s.window.unwrap_or(0) as i32, self.p(&self.step));
        let (heads, kv_heads) = (s.num_heads as i32, s.num_kv_heads as i32);
        let (qp, kp, vp) = (self.p(&q.buf), kv.keys, kv.values);
        let kv_kind = kv_suffix(kv.precision);
        if decode {
            let group = s.num_heads / s.num_kv_heads;
            let per_block = if prologue.is_some() { DECODE_FUSED_HEADS } else { DECODE_HEADS };
            let grid = ((q.rows * s.num_kv_heads) as u32, splits as u32, group.div_ceil(per_block) as u32);
            let suffix = if prologue.is_some() { "_prologue" } else { "" };
            let name = format!("attention_decode{}{suffix}{kv_kind}", s.head_dim);
            let mut args: Vec<Arg> = vec![
                qp.into(),
                kp.into(),
                vp.into(),
                po.into(),
                pml.into(),
                direct.into(),
                step.into(),
                heads.into(),
                kv_heads.into(),
                window.into(),
                s.scale.into(),
                (splits as i32).into(),
                (chunk as i32).into(),
            ];
            args.extend_from_slice(prologue.unwrap_or(&[]));
            // One block a head (splits == 1: `chunk` is the whole-cache block's keys).
            let shared = if splits == 1 {
                // The device's opt-in maximum, as at the kernel's attribute.
                let max_shared = self.max_block_shared + STATIC_SHARED_ROOM;
                decode_whole_shared(chunk, s.head_dim, kv.precision, max_shared)
            } else {
                decode_shared(chunk, s.head_dim, kv.precision)
            };
            self.launch_args(&name, cfg(grid, 256, shared as u32), &args);
        } else {
            let grid = (row_heads as u32, splits as u32, 1);
            let hd = s.head_dim as i32;
            launch!(
                self,
                &format!("attention_split{kv_kind}"),
                cfg(grid, 128, 0),
                qp,
                kp,
                vp,
                po,
                pml,
                direct,
                step,
                heads,
                kv_heads,
                hd,
                window,
                s.scale,
                splits as i32
            );
        }
        if let Some((o, ml)) = &parts {
            launch!(
                self,
                "attention_combine",
                cfg(
                    (row_heads as u32, s.head_dim.div_ceil(COMBINE_DIMS) as u32, 1),
                    COMBINE_THREADS as u32,
                    combine_shared(splits) as u32
                ),
                self.p(&o.buf),
                self.p(&ml.buf),
                self.p(&out.buf),
                s.head_dim as i32,
                splits as i32
            );
        }
    }

    /// The GEMV launch for `out_dim × in_dim` weights read in chunks of `vec`
    /// values with `act` activation rows: the fixed shape when one is set.
    fn gemv_launch_shape(&self, out_dim: usize, in_dim: usize, vec: usize, act: usize) -> GemvShape {
        let mut shape = self.gemv_shape.unwrap_or_else(|| GemvShape::choose(out_dim, in_dim, vec, act));
        if act > 1 {
            shape.rows_per_block = shape.rows_per_block.min(2);
        }
        shape
    }

    /// Affine weights, decode: the GEMV unpacks levels in registers.
    /// With `hand_on` (a norm weight's pointer or 0), the tensor-core GEMV
    /// also hands y on quantized ([`QuantizedRow`]).
    fn affine_gemv(&self, x: &CudaAct, w: &AffineWeight, bias_ptr: u64, y: &mut CudaAct, hand_on: Option<u64>) {
        // 4- and 8-bit levels, up to four tokens: the tensor-core kernel.
        if let Some(shared) = self.affine_mma_shared(w, x.rows) {
            self.affine_mma(x, None, w, bias_ptr, y, false, shared, hand_on);
            return;
        }
        let chunks = w.cols / 32;
        let aligned = 32 % w.params.bits == 0;
        let mut args: Vec<Arg> = vec![
            self.p(&w.packed).into(),
            self.p(&w.scales).into(),
            self.p(&w.biases).into(),
            self.p(&x.buf).into(),
            bias_ptr.into(),
            self.p(&y.buf).into(),
            (w.rows as i32).into(),
            (w.cols as i32).into(),
            (w.params.group_size as i32).into(),
        ];
        // One token with word-aligned levels: x stays in registers, two
        // chunks per thread, from 64 to 256 threads. (Narrower rows do better
        // with the block-per-rows kernel: Qwen3-0.6B q4g64 decoded at 829
        // tok/s with its 3072-wide down projection here, 931 without.)
        // (Not for groups of 16, which that kernel does not split.)
        if x.rows == 1
            && aligned
            && w.params.group_size >= 32
            && (128..=512).contains(&chunks)
            && self.gemv_shape.is_none()
        {
            let threads = (chunks.div_ceil(2).div_ceil(32) * 32) as u32;
            let grid = (w.rows.div_ceil(AFFINE_BLOCK_ROWS) as u32, 1, 1);
            self.launch_args(&format!("gemv_{}_rows", w.format()), cfg(grid, threads, 0), &args);
            return;
        }
        let act = if x.rows == 1 { 1 } else { GEMV_MAX_ROWS };
        let shape = self.gemv_launch_shape(w.rows, w.cols, 32, act);
        let grid = (w.rows.div_ceil(shape.rows_per_block) as u32, 1, 1);
        // The block-per-rows kernels take the activation rows too.
        args.push((x.rows as i32).into());
        self.launch_args(&gemv_kernel(&w.gemv_format(), shape.rows_per_block, act), cfg(grid, shape.threads, 0), &args);
    }

    /// `h += linear(x, w, bias)`; with `next_norm` (the next op reads
    /// RMSNorm(h)·next_norm), a tensor-core affine GEMV also hands h on
    /// quantized times that weight ([`QuantizedRow`]).
    fn linear_add_into(
        &self,
        h: &mut CudaAct,
        x: &CudaAct,
        w: &CudaWeight,
        bias: Option<&CudaWeight>,
        next_norm: Option<u64>,
    ) {
        h.quantized = None;
        let (rows, cols) = match w {
            CudaWeight::Affine(a) => (a.rows, a.cols),
            CudaWeight::Matrix { rows, cols, .. } => (*rows, *cols),
            CudaWeight::Vector(_) => (0, 0),
        };
        let fits = rows > 0 && x.cols == cols && h.rows == x.rows && h.cols == rows;
        if fits && bias.is_none() && x.rows == 1 {
            // The GEMV's bias operand is h and its output h itself: each
            // output adds its own value just before writing it.
            let h_ptr = self.p(&h.buf);
            match w {
                CudaWeight::Affine(a) => self.affine_gemv(x, a, h_ptr, h, next_norm),
                CudaWeight::Matrix { dtype, buf, .. } => self.float_gemv(buf, *dtype, rows, cols, x, h_ptr, h, false),
                CudaWeight::Vector(_) => unreachable!("`fits` excludes vectors"),
            }
            return;
        }
        if fits && bias.is_none() && x.rows > GEMV_MAX_ROWS {
            // Prefill: cuBLAS accumulates into h (beta = 1).
            match w {
                CudaWeight::Affine(a) => self.affine_gemm(x, a, h, true),
                CudaWeight::Matrix { dtype, buf, .. } => {
                    let inputs = self.gemm_inputs(x, *dtype);
                    self.gemm_rows(x, &inputs, *dtype, self.p(buf), rows, cols, self.p(&h.buf), rows, true);
                }
                CudaWeight::Vector(_) => unreachable!("`fits` excludes vectors"),
            }
            return;
        }
        let y = self.linear(x, w, bias);
        self.add_assign(h, &y);
    }

    /// Blocks of a tensor-core affine GEMV: as many as fit on the device at
    /// once (each stages x once and loops over tiles of 16 rows), at most one
    /// per tile.
    fn affine_mma_grid(&self, tiles: usize, shared: usize) -> u32 {
        let per_sm = if shared <= AFFINE_MMA_TWO_PER_SM { 2 } else { 1 };
        // Every block loops the same number of times: 384 tiles on 264 slots
        // take two rounds either way, and 192 blocks stage x fewer times.
        // (Filling all 264 slots instead, so that no SM holds more than 3 of
        // the 8B's q|k|v tiles: 8B q4g64 decode +0.4%, 30B-A3B -1.2%; run 97.)
        let rounds = tiles.div_ceil(per_sm * self.sm_count);
        tiles.div_ceil(rounds) as u32
    }

    /// Shared memory of a tensor-core affine GEMV launch ([`affine_mma_shared_size`]),
    /// None where it does not apply or a fixed GEMV shape is set (profiling
    /// the CUDA-core kernels).
    fn affine_mma_shared(&self, w: &AffineWeight, act_rows: usize) -> Option<usize> {
        affine_mma_shared_size(w, act_rows)
            .filter(|&shared| self.gemv_shape.is_none() && shared <= self.affine_mma_max_shared)
    }

    /// The tensor-core affine GEMV into `y`: x·wᵀ (+ bias), or with `swiglu`
    /// silu(gate)·up of a stacked gate|up weight, rows/2 wide. A plain block
    /// takes tiles of 16 rows, a swiglu block pairs of tiles of 8 gate rows
    /// and their up rows. With `norm` (the norm weight's pointer and eps), x
    /// is RMSNorm(x)·weight. x quantized by its writer for this norm is
    /// copied, not quantized again; with `hand_on` (the next GEMV's norm
    /// weight pointer, or 0) y is handed on so, where it is one row of
    /// whole 16-value slices.
    #[allow(clippy::too_many_arguments)]
    fn affine_mma(
        &self,
        x: &CudaAct,
        norm: Option<(u64, f32)>,
        w: &AffineWeight,
        bias_ptr: u64,
        y: &mut CudaAct,
        swiglu: bool,
        shared: usize,
        hand_on: Option<u64>,
    ) {
        let (norm_ptr, eps) = norm.unwrap_or((0, 0.0));
        let row_in = match &x.quantized {
            Some(q) if x.rows == 1 && q.norm == norm_ptr => self.p(&q.buf.buf),
            _ => 0,
        };
        let out_cols = if swiglu { w.rows / 2 } else { w.rows };
        y.quantized = hand_on
            .filter(|_| x.rows == 1 && out_cols.is_multiple_of(16) && y.cols == out_cols)
            .map(|norm| Box::new(QuantizedRow { buf: self.act(1, QuantizedRow::words(out_cols)), norm }));
        let row_out = y.quantized.as_ref().map_or(0, |q| self.p(&q.buf.buf));
        let mut args: Vec<Arg> = vec![
            self.p(&w.packed).into(),
            self.p(&w.scales).into(),
            self.p(&w.biases).into(),
            self.p(&x.buf).into(),
            norm_ptr.into(),
            eps.into(),
        ];
        if !swiglu {
            args.push(bias_ptr.into());
        }
        args.extend([
            Arg::from(self.p(&y.buf)),
            (w.rows as i32).into(),
            (w.cols as i32).into(),
            (x.rows as i32).into(),
            row_in.into(),
            row_out.into(),
        ]);
        if !swiglu {
            args.push(y.quantized.as_ref().map_or(0, |q| q.norm).into());
        }
        // After a kernel that streams no weights (the decode attention) every
        // stage the ring holds goes out before the wait.
        let lead = if self.after_attention.load(Ordering::Relaxed) { AFFINE_MMA_STAGES - 1 } else { 1 };
        args.push((lead as i32).into());
        // Blocks loop over tiles, swiglu blocks over pairs of them.
        let tiles = if swiglu { (w.rows / 2).div_ceil(16) } else { w.rows.div_ceil(16) };
        let suffix = if swiglu { "_swiglu" } else { "" };
        let kernel = format!("gemv_{}_mma_g{}{suffix}", w.format(), w.params.group_size);
        self.launch_args(&kernel, cfg((self.affine_mma_grid(tiles, shared), 1, 1), 256, shared as u32), &args);
    }

    /// silu(gate)·up from a stacked affine gate|up weight in the tensor-core
    /// GEMV's epilogue; None where that kernel does not apply.
    fn affine_swiglu(&self, x: &CudaAct, norm: Option<(u64, f32)>, w: &AffineWeight) -> Option<CudaAct> {
        let shared = self.affine_mma_shared(w, x.rows)?;
        if !w.rows.is_multiple_of(2) || x.cols != w.cols {
            return None;
        }
        // One row hands silu(gate)·up on quantized: the down projection's x.
        let mut y = self.act(x.rows, w.rows / 2);
        self.affine_mma(x, norm, w, 0, &mut y, true, shared, Some(0));
        Some(y)
    }

    /// The affine weight and the norm weight's pointer and eps when `norm`
    /// (an f32 vector as wide as a row of `x`) can be folded into a
    /// tensor-core GEMV of `x` through `w`, if that kernel applies.
    fn foldable_norm<'w>(
        &self,
        x: &CudaAct,
        norm: &CudaWeight,
        eps: f32,
        w: &'w CudaWeight,
    ) -> Option<(&'w AffineWeight, (u64, f32))> {
        let (CudaWeight::Affine(a), CudaWeight::Vector(n)) = (w, norm) else { return None };
        (n.len() == x.cols && a.cols == x.cols).then(|| (a, (self.p(n), eps)))
    }

    /// Affine weights, prefill: tiles of rows are dequantized to bf16 in one
    /// transient buffer, each multiplied by cuBLAS into its output columns.
    fn affine_gemm(&self, x: &CudaAct, w: &AffineWeight, y: &mut CudaAct, accumulate: bool) {
        let tile_rows = (AFFINE_TILE_VALUES / w.cols).clamp(1, w.rows);
        let scratch = self.uninit::<u16>(tile_rows * w.cols);
        let inputs = self.gemm_inputs(x, DType::BF16);
        let kernel = format!("{}_to_bf16", w.format());
        for r0 in (0..w.rows).step_by(tile_rows) {
            let rows = tile_rows.min(w.rows - r0);
            let chunks = rows * w.cols / 32;
            launch!(
                self,
                &kernel,
                cfg(blocks(chunks, 256), 256, 0),
                self.p(&w.packed),
                self.p(&w.scales),
                self.p(&w.biases),
                self.p(&scratch),
                r0 as i32,
                rows as i32,
                w.cols as i32,
                w.params.group_size as i32
            );
            let y_ptr = self.p(&y.buf) + (r0 * 4) as u64;
            self.gemm_rows(x, &inputs, DType::BF16, self.p(&scratch), rows, w.cols, y_ptr, w.rows, accumulate);
        }
    }
}

impl Backend for CudaBackend {
    type Act = CudaAct;
    type Weight = CudaWeight;
    type Cache = CudaKv;
    type GdnState = CudaGdnState;
    type Step = CudaStep;

    fn name(&self) -> String {
        format!("cuda:{} ({})", self.ordinal, self.device_name)
    }

    fn run_step<R>(
        &self,
        step: &mut CudaStep,
        start: usize,
        tokens: &[u32],
        replayable: bool,
        body: &mut dyn FnMut() -> Result<CudaAct>,
        finish: &mut dyn FnMut(&CudaAct) -> Result<R>,
    ) -> Result<R> {
        // Passes share the step inputs and the recording state: one at a time.
        let _pass = self.pass.lock().map_err(|_| Error::Invalid("cuda: a pass panicked".into()))?;
        self.ensure_step(start, (tokens.len() == 1).then(|| tokens[0]));
        if !replayable || !self.graphs || self.failed() {
            let out = body()?;
            return finish(&out);
        }
        let key = decode_step_key(start + tokens.len());
        if let Some(rec) = step.recorded.get(&key) {
            let r = rec.graph.launch();
            self.record(r, "replaying a decode step");
            self.replays.fetch_add(1, Ordering::Relaxed);
            return finish(&rec.out);
        }
        // Warm-up: this token's pass runs for real, every buffer it takes from
        // a fresh arena; then the same pass is captured (not run) and finds
        // the same buffers free in the same order (so `finish`, which may
        // take buffers of its own, runs outside the arena). `finish` may also
        // set the next pass's step inputs (a pick fed on the device): the
        // capture sees this pass's, which its replays are given (above).
        let arena = Arc::new(BufferPool::arena());
        let pass_inputs = self.step_inputs();
        self.set_recording(Some((arena.clone(), false)));
        let warm = body();
        self.set_recording(None);
        let result = finish(&warm?)?;
        if self.failed() {
            return Ok(result);
        }
        let next_inputs = self.set_step_inputs(pass_inputs);
        self.set_recording(Some((arena.clone(), true)));
        let began = self.stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
        self.record(began, "starting a decode step capture");
        let out = body();
        let graph = self.stream.end_capture(CUgraphInstantiate_flags(0));
        self.set_recording(None);
        self.set_step_inputs(next_inputs);
        match (out, graph) {
            (Ok(out), Ok(Some(graph))) if !self.failed() => {
                step.recorded.insert(key, Recorded { graph, out, _arena: arena });
            }
            (out, graph) => {
                out?;
                self.record(graph.map(|_| ()), "capturing a decode step");
            }
        }
        Ok(result)
    }

    fn sample(&self, logits: &CudaAct, params: &SamplingParams, penalized: &[u32], u: f32) -> Result<u32> {
        self.sample_on_device(logits, params, penalized, u)
    }

    fn samples_ahead(&self) -> bool {
        true
    }

    fn sample_ahead(&self, logits: &CudaAct, params: &SamplingParams, u: f32, next_start: usize) -> Result<usize> {
        self.sample_ahead_on_device(logits, params, u, next_start)
    }

    fn picked(&self, ticket: usize) -> Result<u32> {
        self.picked_on_device(ticket)
    }

    fn check(&self) -> Result<()> {
        let sync = self.stream.synchronize();
        self.record(sync, "synchronize");
        self.recorded_error()
    }

    fn upload(&self, t: &Tensor) -> Result<CudaWeight> {
        match (t.shape.len(), t.dtype) {
            (1, _) => Ok(CudaWeight::Vector(self.upload_slice(&t.to_f32_vec()))),
            (2, DType::BF16 | DType::F16 | DType::F32) => Ok(CudaWeight::Matrix {
                dtype: t.dtype,
                rows: t.shape[0],
                cols: t.shape[1],
                buf: self.upload_slice(t.data.as_slice()),
            }),
            // ggml blocks become affine weights, with groups of 32 or (Q2_K,
            // Q3_K, Q6_K) 16 values: exact, see formats/gguf/as_affine.rs.
            // The K-quants keep their super-blocks' scales as records.
            (2, DType::Q2_K | DType::Q3_K | DType::Q4_K | DType::Q5_K | DType::Q6_K) => self.upload_superblocks(t),
            (2, DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 | DType::Q8_0) => {
                match crate::quant::gguf_affine::as_affine(t) {
                    Some(affine) => affine.and_then(|a| self.upload_affine(&a)),
                    None => Err(Error::tensor(&t.name, format!("{} has no affine form", t.dtype.name()))),
                }
            }
            (2, DType::U32) => Err(Error::tensor(
                &t.name,
                "u32 words are quantized weights only with their scales and biases (an affine weight)",
            )),
            _ => Err(Error::tensor(&t.name, format!("expected 1-D or 2-D, found shape {:?}", t.shape))),
        }
        .and_then(|w| self.check().map(|_| w))
    }

    fn upload_affine(&self, t: &crate::quant::affine::AffineTensor) -> Result<CudaWeight> {
        let &[rows, cols] = t.shape.as_slice() else {
            return Err(Error::tensor(&t.name, format!("expected a 2-D matrix, found shape {:?}", t.shape)));
        };
        // bf16 scales and biases stay bf16 (half the bytes, exact); any other
        // storage becomes f32, which holds f16 exactly too. Groups of 16 take
        // f32 ones only (their GEMVs have no bf16 form).
        let bf16_scales = t.scales.dtype == DType::BF16 && t.biases.dtype == DType::BF16 && t.params.group_size != 16;
        let side = |v: &Tensor| match bf16_scales {
            true => self.upload_slice(v.data.as_slice()),
            false => self.upload_slice(&v.to_f32_vec().iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>()),
        };
        Ok(CudaWeight::Affine(AffineWeight {
            params: t.params,
            rows,
            cols,
            packed: self.upload_slice(t.packed.data.as_slice()),
            scales: side(&t.scales),
            biases: side(&t.biases),
            side: if bf16_scales { AffineSide::Bf16 } else { AffineSide::F32 },
        }))
    }

    fn new_cache(&self, num_layers: usize, kv_dim: usize, capacity: usize) -> CudaKv {
        CudaKv::new(num_layers, kv_dim, capacity, self.kv_precision)
    }

    fn act_from_host(&self, rows: usize, cols: usize, data: &[f32]) -> CudaAct {
        assert_eq!(rows * cols, data.len());
        CudaAct::new(rows, cols, self.upload_slice(data), None)
    }

    fn embed(&self, table: &CudaWeight, ids: &[u32]) -> Result<CudaAct> {
        if let CudaWeight::Affine(w) = table {
            check_token_ids(ids, w.rows)?;
            let out = self.act(ids.len(), w.cols);
            let (d_ids, ids_ptr) = self.device_ids(ids);
            launch!(
                self,
                &format!("embed_{}", w.format()),
                cfg((ids.len() as u32, 1, 1), 128, 0),
                self.p(&w.packed),
                self.p(&w.scales),
                self.p(&w.biases),
                ids_ptr,
                self.p(&out.buf),
                w.cols as i32,
                w.params.group_size as i32
            );
            drop(d_ids);
            return Ok(out);
        }
        let CudaWeight::Matrix { dtype, rows, cols, buf } = table else {
            return Err(Error::Invalid("embedding table must be a matrix".into()));
        };
        check_token_ids(ids, *rows)?;
        let out = self.act(ids.len(), *cols);
        let (d_ids, ids_ptr) = self.device_ids(ids);
        launch!(
            self,
            &format!("embed_{}", float_format(*dtype).0),
            cfg((ids.len() as u32, 1, 1), 256, 0),
            self.p(buf),
            ids_ptr,
            self.p(&out.buf),
            *cols as i32
        );
        drop(d_ids);
        Ok(out)
    }

    fn linear(&self, x: &CudaAct, w: &CudaWeight, bias: Option<&CudaWeight>) -> CudaAct {
        let bias_ptr = match bias {
            Some(CudaWeight::Vector(b)) => self.p(b),
            _ => 0u64,
        };
        if let CudaWeight::Affine(a) = w {
            let mut y = self.act(x.rows, a.rows);
            if x.cols != a.cols {
                self.record(Err(format!("input width {} for a weight of {} columns", x.cols, a.cols)), "linear");
            } else if x.rows <= GEMV_MAX_ROWS {
                self.affine_gemv(x, a, bias_ptr, &mut y, None);
            } else {
                self.affine_gemm(x, a, &mut y, false);
                if bias_ptr != 0 {
                    let n = y.rows * y.cols;
                    launch!(
                        self,
                        "add_bias",
                        Self::elementwise_cfg(n),
                        self.p(&y.buf),
                        bias_ptr,
                        y.cols as i32,
                        n as i64
                    );
                }
            }
            return y;
        }
        let CudaWeight::Matrix { dtype, rows: out_dim, cols: in_dim, buf } = w else {
            self.record(Err("expected a matrix weight, found a vector"), "linear");
            return self.act(x.rows, 1);
        };
        let mut y = self.act(x.rows, *out_dim);
        if x.cols != *in_dim {
            self.record(Err(format!("input width {} for a weight of {in_dim} columns", x.cols)), "linear");
            return y;
        }
        if x.rows <= GEMV_MAX_ROWS {
            self.float_gemv(buf, *dtype, *out_dim, *in_dim, x, bias_ptr, &y, false);
        } else {
            self.gemm(x, w, &mut y);
            if bias_ptr != 0 {
                let n = y.rows * y.cols;
                launch!(self, "add_bias", Self::elementwise_cfg(n), self.p(&y.buf), bias_ptr, y.cols as i32, n as i64);
            }
        }
        y
    }

    fn rms_norm(&self, x: &CudaAct, w: &CudaWeight, eps: f32) -> CudaAct {
        self.norm(x, None, w, None, eps)
    }

    fn add_rms_norm(&self, h: &mut CudaAct, y: &CudaAct, w: &CudaWeight, eps: f32) -> CudaAct {
        h.quantized = None;
        self.norm(h, Some(y), w, None, eps)
    }

    fn rope(&self, x: &mut CudaAct, head_dim: usize, positions: &[usize], rope: &Rope) {
        x.quantized = None;
        // Positions are consecutive in every forward: pass the first, not a table.
        let start = positions.first().copied().unwrap_or(0);
        if positions.iter().enumerate().any(|(i, &p)| p != start + i) {
            self.record(Err("positions must be consecutive"), "rope");
            return;
        }
        let Some(freq_ptr) = self.rope_table(rope) else { return };
        self.ensure_step(start, None);
        let pairs = x.rows * (x.cols / head_dim) * (rope.rotary_dim / 2);
        let style = rope_style(rope);
        launch!(
            self,
            "rope",
            Self::elementwise_cfg(pairs),
            self.p(&x.buf),
            self.p(&self.step),
            freq_ptr,
            x.rows as i32,
            x.cols as i32,
            head_dim as i32,
            rope.rotary_dim as i32,
            style
        );
    }

    fn write_kv(&self, cache: &mut CudaKv, layer: usize, k: &CudaAct, v: &CudaAct) {
        let r = cache.reserve(&self.stream, layer, k.rows);
        self.record(r, "KV cache allocation");
        let Some(kv) = self.kv_rows(cache, layer) else { return };
        self.ensure_step(cache.len(), None);
        let n = k.rows * k.cols;
        launch!(
            self,
            &format!("kv_append{}", kv_suffix(kv.precision)),
            Self::elementwise_cfg(n),
            self.p(&k.buf),
            self.p(&v.buf),
            kv.keys,
            kv.values,
            self.p(&self.step),
            k.rows as i32,
            k.cols as i32
        );
    }

    fn attention(&self, q: &CudaAct, cache: &CudaKv, layer: usize, s: &AttentionShape) -> CudaAct {
        let out = self.act(q.rows, s.num_heads * s.head_dim);
        let Some(kv) = self.kv_rows(cache, layer) else {
            self.record(Err("attention before any KV write"), "attention");
            return out;
        };
        let n_keys = cache.len() + q.rows;
        self.ensure_step(cache.len(), None);
        if q.rows <= GEMV_MAX_ROWS {
            self.attention_split(q, kv, n_keys, s, &out, None);
            return out;
        }
        if !self.split_activations && self.flash_fits(s.head_dim) {
            // The kernel reads f16 keys and values: an f16 cache as it is,
            // an f32 one converted once per call.
            let kv_dim = s.num_kv_heads * s.head_dim;
            let converted = (kv.precision == KvPrecision::F32).then(|| {
                let (keys_half, values_half) = (self.act(n_keys, kv_dim / 2), self.act(n_keys, kv_dim / 2));
                let n = n_keys * kv_dim;
                launch!(
                    self,
                    "kv_to_half",
                    cfg(((n / 4).div_ceil(256).min(4096) as u32, 1, 1), 256, 0),
                    kv.keys,
                    kv.values,
                    self.p(&keys_half.buf),
                    self.p(&values_half.buf),
                    n as i64
                );
                (keys_half, values_half)
            });
            let (keys_half, values_half) =
                converted.as_ref().map_or((kv.keys, kv.values), |(k, v)| (self.p(&k.buf), self.p(&v.buf)));
            let tile = flash_tile(s.head_dim);
            let grid = (s.num_heads as u32, q.rows.div_ceil(tile.rows) as u32, 1);
            launch!(
                self,
                &format!("flash_prefill{}", s.head_dim),
                cfg(grid, tile.threads as u32, tile.shared as u32),
                self.p(&q.buf),
                keys_half,
                values_half,
                self.p(&out.buf),
                self.p(&self.step),
                q.rows as i32,
                s.num_heads as i32,
                s.num_kv_heads as i32,
                s.window.unwrap_or(0) as i32,
                s.scale
            );
            return out;
        }
        // f32 arithmetic on the cache as stored (the parity configuration,
        // and other head dims).
        let shared = (n_keys * 4) as u32;
        if n_keys > self.max_attention_keys {
            self.record(
                Err(format!("{n_keys} keys exceed this attention kernel's {}-key limit", self.max_attention_keys)),
                "attention",
            );
            return out;
        }
        launch!(
            self,
            &format!("attention{}", kv_suffix(kv.precision)),
            cfg(((q.rows * s.num_heads) as u32, 1, 1), 128, shared),
            self.p(&q.buf),
            kv.keys,
            kv.values,
            self.p(&out.buf),
            self.p(&self.step),
            s.num_heads as i32,
            s.num_kv_heads as i32,
            s.head_dim as i32,
            s.window.unwrap_or(0) as i32,
            s.scale
        );
        out
    }

    fn fuses_projections(&self) -> bool {
        true
    }

    fn linear_swiglu(&self, x: &CudaAct, gate_up: &CudaWeight) -> CudaAct {
        // Decode: the GEMV's epilogue forms silu(gate)·up from a block's gate
        // rows and the matching up rows (`gemv_*_swiglu`): no [T, 2·width]
        // intermediate and one launch fewer. Otherwise the two steps.
        let CudaWeight::Matrix { dtype, rows, cols: in_dim, buf } = gate_up else {
            if let CudaWeight::Affine(w) = gate_up
                && let Some(y) = self.affine_swiglu(x, None, w)
            {
                return y;
            }
            return self.swiglu(&self.linear(x, gate_up, None));
        };
        if x.rows > GEMV_MAX_ROWS || x.cols != *in_dim || rows % 2 != 0 {
            return self.swiglu(&self.linear(x, gate_up, None));
        }
        let y = self.act(x.rows, rows / 2);
        self.float_gemv(buf, *dtype, *rows, *in_dim, x, 0, &y, true);
        y
    }

    fn linear_normed(
        &self,
        h: &CudaAct,
        norm: &CudaWeight,
        eps: f32,
        w: &CudaWeight,
        bias: Option<&CudaWeight>,
    ) -> CudaAct {
        // Decode through the tensor-core affine GEMV: it stages RMSNorm(h)·norm
        // itself (see affine_mma.cu), so no norm kernel runs before it.
        if let Some((a, folded)) = self.foldable_norm(h, norm, eps, w)
            && let Some(shared) = self.affine_mma_shared(a, h.rows)
        {
            let bias_ptr = match bias {
                Some(CudaWeight::Vector(b)) => self.p(b),
                _ => 0u64,
            };
            let mut y = self.act(h.rows, a.rows);
            self.affine_mma(h, Some(folded), a, bias_ptr, &mut y, false, shared, None);
            return y;
        }
        self.linear(&self.rms_norm(h, norm, eps), w, bias)
    }

    fn linear_swiglu_normed(&self, h: &CudaAct, norm: &CudaWeight, eps: f32, gate_up: &CudaWeight) -> CudaAct {
        if let Some((a, folded)) = self.foldable_norm(h, norm, eps, gate_up)
            && let Some(y) = self.affine_swiglu(h, Some(folded), a)
        {
            return y;
        }
        self.linear_swiglu(&self.rms_norm(h, norm, eps), gate_up)
    }

    fn linear_add(&self, h: &mut CudaAct, x: &CudaAct, w: &CudaWeight, bias: Option<&CudaWeight>) {
        self.linear_add_into(h, x, w, bias, None);
    }

    fn linear_add_for_norm(
        &self,
        h: &mut CudaAct,
        x: &CudaAct,
        w: &CudaWeight,
        bias: Option<&CudaWeight>,
        next_norm: &CudaWeight,
    ) {
        let norm = match next_norm {
            CudaWeight::Vector(n) if n.len() == h.cols => Some(self.p(n)),
            _ => None,
        };
        self.linear_add_into(h, x, w, bias, norm);
    }

    fn swiglu(&self, gate_up: &CudaAct) -> CudaAct {
        let width = gate_up.cols / 2;
        let out = self.act(gate_up.rows, width);
        let n = gate_up.rows * width;
        launch!(
            self,
            "swiglu",
            Self::elementwise_cfg(n),
            self.p(&gate_up.buf),
            self.p(&out.buf),
            width as i32,
            n as i64
        );
        out
    }

    fn qkv_prologue(
        &self,
        qkv: &CudaAct,
        shape: &QkvShape,
        norms: Option<(&CudaWeight, &CudaWeight)>,
        eps: f32,
        positions: &[usize],
        rope: &Rope,
        cache: &mut CudaKv,
        layer: usize,
    ) -> (CudaAct, Option<CudaAct>) {
        let (nh, nkv, hd) = (shape.num_heads, shape.num_kv_heads, shape.head_dim);
        let q = self.act(qkv.rows, nh * hd);
        let gate = shape.output_gate.then(|| self.act(qkv.rows, nh * hd));
        let Some(p) = self.prologue_inputs(qkv, shape, norms, positions, rope, cache, layer) else {
            return (q, gate);
        };
        let threads = (hd.div_ceil(32) * 32).min(256) as u32;
        launch!(
            self,
            &format!("qkv_prologue{}", kv_suffix(p.kv.precision)),
            cfg((qkv.rows as u32, (nh + nkv) as u32, 1), threads, (hd * 4) as u32),
            self.p(&qkv.buf),
            self.p(&q.buf),
            gate.as_ref().map(|g| self.p(&g.buf)).unwrap_or(0),
            p.kv.keys,
            p.kv.values,
            p.q_norm,
            p.k_norm,
            p.inv_freq,
            self.p(&self.step),
            nh as i32,
            nkv as i32,
            hd as i32,
            shape.output_gate as i32,
            eps,
            rope.rotary_dim as i32,
            rope_style(rope)
        );
        (q, gate)
    }

    fn qkv_attention(
        &self,
        qkv: &CudaAct,
        shape: &QkvShape,
        norms: Option<(&CudaWeight, &CudaWeight)>,
        eps: f32,
        positions: &[usize],
        rope: &Rope,
        cache: &mut CudaKv,
        layer: usize,
        attention: &AttentionShape,
    ) -> (CudaAct, Option<CudaAct>) {
        let hd = shape.head_dim;
        let same_heads = (attention.num_heads, attention.num_kv_heads, attention.head_dim)
            == (shape.num_heads, shape.num_kv_heads, hd);
        let n_keys = cache.len() + 1;
        let fold = self.decode_whole_keys(hd, cache.precision()).is_some_and(|whole| {
            folds_prologue(n_keys, whole, cache.precision(), shape, self.sm_count, self.fold_split_prologue)
        });
        if qkv.rows != 1 || !same_heads || !fold {
            let (q, gate) = self.qkv_prologue(qkv, shape, norms, eps, positions, rope, cache, layer);
            return (self.attention(&q, cache, layer, attention), gate);
        }
        let out = self.act(1, shape.num_heads * hd);
        let gate = shape.output_gate.then(|| self.act(1, shape.num_heads * hd));
        let Some(p) = self.prologue_inputs(qkv, shape, norms, positions, rope, cache, layer) else {
            return (out, gate);
        };
        let prologue = [
            Arg::from(p.q_norm),
            p.k_norm.into(),
            p.inv_freq.into(),
            gate.as_ref().map(|g| self.p(&g.buf)).unwrap_or(0).into(),
            eps.into(),
            (shape.output_gate as i32).into(),
            (rope.rotary_dim as i32).into(),
            rope_style(rope).into(),
        ];
        self.attention_split(qkv, p.kv, n_keys, attention, &out, Some(&prologue));
        (out, gate)
    }

    fn silu_mul(&self, gate: &CudaAct, up: &CudaAct) -> CudaAct {
        let out = self.act(gate.rows, gate.cols);
        let n = gate.rows * gate.cols;
        launch!(
            self,
            "silu_mul",
            Self::elementwise_cfg(n),
            self.p(&gate.buf),
            self.p(&up.buf),
            self.p(&out.buf),
            n as i64
        );
        out
    }

    fn add_assign(&self, x: &mut CudaAct, y: &CudaAct) {
        x.quantized = None;
        let n = x.rows * x.cols;
        launch!(self, "add_assign", Self::elementwise_cfg(n), self.p(&x.buf), self.p(&y.buf), n as i64);
    }

    fn last_row(&self, x: &CudaAct) -> CudaAct {
        let out = self.act(1, x.cols);
        if !self.failed() {
            let src = self.p(&x.buf) + ((x.rows - 1) * x.cols * 4) as u64;
            // SAFETY: one row inside both allocations.
            let r = unsafe {
                cudarc::driver::result::memcpy_dtod_async(self.p(&out.buf), src, x.cols * 4, self.stream.cu_stream())
            };
            self.record(r, "last row");
        }
        out
    }

    fn rows(&self, x: &CudaAct) -> usize {
        x.rows
    }

    fn cols(&self, x: &CudaAct) -> usize {
        x.cols
    }

    fn to_host(&self, x: &CudaAct) -> Vec<f32> {
        if self.failed() {
            return vec![0.0; x.rows * x.cols];
        }
        match self.stream.clone_dtoh(&*x.buf) {
            Ok(mut v) => {
                v.truncate(x.rows * x.cols);
                v
            }
            Err(e) => {
                self.record(Err(e), "device-to-host copy");
                vec![0.0; x.rows * x.cols]
            }
        }
    }

    fn gather_columns(&self, x: &CudaAct, group: usize, offset: usize, len: usize) -> CudaAct {
        let groups = x.cols / group;
        let out = self.act(x.rows, groups * len);
        self.copy_columns(x, &out, group, offset, len, 0);
        out
    }

    fn concat_columns(&self, parts: &[&CudaAct]) -> CudaAct {
        let rows = parts[0].rows;
        let out = self.act(rows, parts.iter().map(|p| p.cols).sum());
        let mut off = 0;
        for p in parts {
            self.copy_columns(p, &out, p.cols, 0, p.cols, off);
            off += p.cols;
        }
        out
    }

    fn mul_sigmoid(&self, x: &mut CudaAct, gate: &CudaAct) {
        x.quantized = None;
        let n = x.rows * x.cols;
        launch!(
            self,
            "mul_sigmoid",
            Self::elementwise_cfg(n),
            self.p(&x.buf),
            self.p(&gate.buf),
            x.cols as i32,
            gate.cols as i32,
            n as i64
        );
    }

    fn rms_norm_gated(&self, x: &CudaAct, z: &CudaAct, w: &CudaWeight, eps: f32) -> CudaAct {
        self.norm(x, None, w, Some(z), eps)
    }

    fn new_gdn_state(&self, cfg: &GdnConfig) -> CudaGdnState {
        CudaGdnState {
            cfg: cfg.clone(),
            conv: self.zeros((cfg.conv_kernel - 1) * cfg.conv_dim()),
            recurrent: self.zeros(cfg.num_v_heads * cfg.k_head_dim * cfg.v_head_dim),
        }
    }

    fn clear_gdn_state(&self, state: &mut CudaGdnState) {
        let conv = self.stream.memset_zeros(&mut state.conv);
        self.record(conv, "clearing a Gated DeltaNet state");
        let recurrent = self.stream.memset_zeros(&mut state.recurrent);
        self.record(recurrent, "clearing a Gated DeltaNet state");
    }

    fn reuses_sequences(&self) -> bool {
        self.graphs
    }

    fn gdn_conv(&self, x: &CudaAct, weight: &CudaWeight, state: &mut CudaGdnState) -> CudaAct {
        let out = self.act(x.rows, x.cols);
        self.conv_columns(x, weight, state, &out);
        out
    }

    fn gated_delta_rule(
        &self,
        q: &CudaAct,
        k: &CudaAct,
        v: &CudaAct,
        a: &CudaAct,
        b: &CudaAct,
        a_log: &CudaWeight,
        dt_bias: &CudaWeight,
        state: &mut CudaGdnState,
    ) -> CudaAct {
        let c = state.cfg.clone();
        let t = v.rows;
        let out = self.act(t, c.value_dim());
        if c.v_head_dim > 1024 {
            self.record(Err("linear_value_head_dim above 1024"), "gated_delta_rule");
            return out;
        }
        let (CudaWeight::Vector(al), CudaWeight::Vector(dt)) = (a_log, dt_bias) else {
            self.record(Err("A_log and dt_bias must be vectors"), "gated_delta_rule");
            return out;
        };
        // Normalized copies of q and k (the rule normalizes them in place).
        let (qn, kn) = (self.copy(q), self.copy(k));
        let (kd, vd, nv) = (c.key_dim(), c.value_dim(), c.num_v_heads);
        let inputs = DeltaRuleInputs {
            q: self.p(&qn.buf),
            k: self.p(&kn.buf),
            v: self.p(&v.buf),
            a: self.p(&a.buf),
            b: self.p(&b.buf),
            qk_stride: kd,
            v_stride: vd,
            ab_stride: nv,
        };
        self.delta_rule(&inputs, t, al, dt, state, &out);
        out
    }

    fn gdn_mix(
        &self,
        mixed: &CudaAct,
        weights: &GdnWeights<'_, CudaWeight>,
        eps: f32,
        state: &mut CudaGdnState,
    ) -> Option<CudaAct> {
        let c = state.cfg.clone();
        let (t, cd, vd, nv) = (mixed.rows, c.conv_dim(), c.value_dim(), c.num_v_heads);
        // Key heads of 128: decode-sized steps with value heads of at most
        // 128 (one block of 8 warps per value head) in one fused kernel;
        // prompts through the conv, the rule and the gated norm, each reading
        // its columns of the stacked rows in place. Other shapes compose the
        // separate kernels.
        let prompt = t > GEMV_MAX_ROWS;
        if c.k_head_dim != 128 || (!prompt && c.v_head_dim > 128) {
            return None;
        }
        let (CudaWeight::Vector(al), CudaWeight::Vector(dt), CudaWeight::Vector(nw)) =
            (weights.a_log, weights.dt_bias, weights.norm)
        else {
            return None;
        };
        let out = self.act(t, vd);
        if mixed.cols != cd + vd + 2 * nv {
            self.record(Err(format!("{} columns, expected {}", mixed.cols, cd + vd + 2 * nv)), "gdn_mix");
            return Some(out);
        }
        let conv = self.act(t, cd);
        self.conv_columns(mixed, weights.conv, state, &conv);
        if prompt {
            let (at, kd, f32s) = (self.p(&mixed.buf), c.key_dim(), std::mem::size_of::<f32>() as u64);
            let conv_at = self.p(&conv.buf);
            let inputs = DeltaRuleInputs {
                q: conv_at,
                k: conv_at + (kd as u64) * f32s,
                v: conv_at + (2 * kd) as u64 * f32s,
                a: at + (cd + vd + nv) as u64 * f32s,
                b: at + (cd + vd) as u64 * f32s,
                qk_stride: cd,
                v_stride: cd,
                ab_stride: mixed.cols,
            };
            self.delta_rule(&inputs, t, al, dt, state, &out);
            let z = self.gather_columns(mixed, mixed.cols, cd, vd);
            return Some(self.norm(&out, None, weights.norm, Some(&z), eps));
        }
        launch!(
            self,
            "gdn_decode128",
            cfg((nv as u32, 1, 1), 32 * c.v_head_dim.div_ceil(16) as u32, 0),
            self.p(&conv.buf),
            self.p(&mixed.buf),
            mixed.cols as i32,
            cd as i32,
            (cd + vd) as i32,
            (cd + vd + nv) as i32,
            self.p(al),
            self.p(dt),
            self.p(nw),
            self.p(&state.recurrent),
            self.p(&out.buf),
            t as i32,
            c.num_k_heads as i32,
            nv as i32,
            c.v_head_dim as i32,
            c.v_heads_tiled as i32,
            eps
        );
        Some(out)
    }

    fn routes_on_device(&self) -> bool {
        true
    }

    fn moe(
        &self,
        x: &CudaAct,
        router_logits: &CudaAct,
        experts: &[ExpertWeights<CudaWeight>],
        routing: Routing,
    ) -> CudaAct {
        // Decode-sized batches route on the device; their steps can be recorded.
        if x.rows <= GEMV_MAX_ROWS
            && experts.len() <= moe::MAX_DEVICE_EXPERTS
            && routing.top_k <= experts.len()
            && let Some(tables) = self.expert_tables(experts)
        {
            return self.moe_on_device(x, router_logits, &tables, routing);
        }
        if self.capturing() {
            self.record(Err("experts that cannot be routed on the device"), "recording a decode step");
        } else if experts.len() <= moe::MAX_DEVICE_EXPERTS
            && routing.top_k <= experts.len()
            && let Some(tables) = self.expert_tables(experts)
            && let Some(out) = self.moe_prefill(x, router_logits, experts, &tables, routing)
        {
            return out;
        }
        // Otherwise routing is decided on the host (T×E floats cross the bus, one
        // sync per MoE layer); each routed expert then runs once over all its tokens.
        // An accumulator: zeroed even when outputs are poisoned.
        let out = CudaAct::new(x.rows, x.cols, self.zeros(x.rows * x.cols), None);
        let logits = self.to_host(router_logits);
        let routes = crate::backend::cpu::moe::route(&logits, experts.len(), routing);
        for (e, tokens) in crate::backend::cpu::moe::group_by_expert(&routes, experts.len()).iter().enumerate() {
            if tokens.is_empty() {
                continue;
            }
            let idx: Vec<i32> = tokens.iter().map(|t| t.0 as i32).collect();
            let weights: Vec<f32> = tokens.iter().map(|t| t.1).collect();
            let xs = self.gather_rows(x, &idx);
            let ex = &experts[e];
            let h = self.silu_mul(&self.linear(&xs, &ex.gate, None), &self.linear(&xs, &ex.up, None));
            let y = self.linear(&h, &ex.down, None);
            let (d_idx, d_w) = (self.upload_slice(&idx), self.upload_slice(&weights));
            launch!(
                self,
                "scatter_add_rows",
                cfg((idx.len() as u32, 1, 1), 256, 0),
                self.p(&y.buf),
                self.p(&d_idx),
                self.p(&d_w),
                self.p(&out.buf),
                x.cols as i32
            );
        }
        out
    }
}

/// One sequence's recorded decode steps, by the number of attention key
/// chunks they were recorded for (see [`decode_step_key`]).
#[derive(Default)]
pub struct CudaStep {
    recorded: HashMap<usize, Recorded>,
}

/// A captured decode step: the graph, the activations it leaves the logits in,
/// and the arena holding every buffer the graph addresses.
struct Recorded {
    graph: CudaGraph,
    out: CudaAct,
    _arena: Arc<BufferPool>,
}

// SAFETY: a graph is used only through its sequence's state, which one thread
// at a time holds (`&mut`), and only on the backend's one stream.
unsafe impl Send for CudaStep {}

fn rope_style(rope: &Rope) -> i32 {
    match rope.style {
        RopeStyle::Neox => 0,
        RopeStyle::Interleaved => 1,
    }
}

impl CudaBackend {
    /// The RoPE inverse frequencies on the device, uploaded on first use.
    fn rope_table(&self, rope: &Rope) -> Option<u64> {
        let key: Vec<u32> = rope.inv_freq.iter().map(|f| f.to_bits()).collect();
        let Ok(mut tables) = self.rope_tables.lock() else {
            self.record(Err("rope table lock poisoned"), "rope");
            return None;
        };
        if !tables.contains_key(&key) {
            tables.insert(key.clone(), self.upload_slice(&rope.inv_freq));
        }
        Some(self.p(&tables[&key]))
    }

    /// Whether the stream is capturing a decode step (nothing may be
    /// allocated, synchronized or changed on the host's side then).
    fn capturing(&self) -> bool {
        self.recording.lock().ok().and_then(|r| r.as_ref().map(|r| r.1)).unwrap_or(false)
    }

    fn set_recording(&self, to: Option<(Arc<BufferPool>, bool)>) {
        match self.recording.lock() {
            Ok(mut r) => *r = to,
            Err(_) => self.record(Err("recording lock poisoned"), "recording a decode step"),
        }
    }

    /// The token ids on the device: a one-token pass reads the step inputs
    /// (so a recorded step replays with the next token), longer ones a copy.
    fn device_ids(&self, ids: &[u32]) -> (Option<CudaSlice<u32>>, u64) {
        if let [id] = ids {
            let start = self.step_written.lock().ok().and_then(|w| *w).map(|w| w[0] as usize).unwrap_or(0);
            self.ensure_step(start, Some(*id));
            return (None, self.p(&self.step) + 4);
        }
        let d = self.upload_slice(ids);
        let p = self.p(&d);
        (Some(d), p)
    }

    /// A copy of `x` in a new activation buffer.
    fn copy(&self, x: &CudaAct) -> CudaAct {
        let out = self.act(x.rows, x.cols);
        if !self.failed() {
            // SAFETY: both buffers hold at least rows × cols values.
            let r = unsafe {
                cudarc::driver::result::memcpy_dtod_async(
                    self.p(&out.buf),
                    self.p(&x.buf),
                    x.rows * x.cols * 4,
                    self.stream.cu_stream(),
                )
            };
            self.record(r, "copy");
        }
        out
    }

    /// RMSNorm of `x` (after `x += y` when given, written back), gated by
    /// silu(`z`) when given.
    fn norm(&self, x: &CudaAct, y: Option<&CudaAct>, w: &CudaWeight, z: Option<&CudaAct>, eps: f32) -> CudaAct {
        let out = self.act(x.rows, x.cols);
        let CudaWeight::Vector(wv) = w else {
            self.record(Err("norm weight must be a vector"), "rms_norm");
            return out;
        };
        let group = wv.len();
        let groups = x.rows * x.cols / group;
        // About two float4 per thread, whole warps, at most 1024.
        let threads = (group.div_ceil(8).div_ceil(32) * 32).clamp(32, 1024) as u32;
        launch!(
            self,
            "rms_norm",
            cfg((groups as u32, 1, 1), threads, 0),
            self.p(&x.buf),
            y.map(|y| self.p(&y.buf)).unwrap_or(0),
            self.p(wv),
            z.map(|z| self.p(&z.buf)).unwrap_or(0),
            self.p(&out.buf),
            group as i32,
            eps
        );
        out
    }

    /// y = x·wᵀ (+ bias) for a float `[rows, in_dim]` weight and at most
    /// GEMV_MAX_ROWS activation rows. `swiglu`: the weight is a stacked
    /// gate|up and y = silu(gate)·up, rows/2 wide (`gemv_*_swiglu`, blocks of
    /// at least one gate row and its up row).
    #[allow(clippy::too_many_arguments)]
    fn float_gemv(
        &self,
        buf: &CudaSlice<u8>,
        dtype: DType,
        rows: usize,
        in_dim: usize,
        x: &CudaAct,
        bias_ptr: u64,
        y: &CudaAct,
        swiglu: bool,
    ) {
        let (ty, vec) = float_format(dtype);
        let act = if x.rows == 1 { 1 } else { GEMV_MAX_ROWS };
        let mut shape = self.gemv_launch_shape(rows, in_dim, vec, act);
        let (outputs, per_block, suffix) = if swiglu {
            shape.rows_per_block = shape.rows_per_block.max(2);
            (rows / 2, shape.rows_per_block / 2, "_swiglu")
        } else {
            (rows, shape.rows_per_block, "")
        };
        launch!(
            self,
            &format!("{}{suffix}", gemv_kernel(ty, shape.rows_per_block, act)),
            cfg((outputs.div_ceil(per_block) as u32, 1, 1), shape.threads, 0),
            self.p(buf),
            self.p(&x.buf),
            bias_ptr,
            self.p(&y.buf),
            outputs as i32,
            in_dim as i32,
            x.rows as i32
        );
    }

    /// The depthwise conv + SiLU over the first `out.cols` columns of `x`
    /// (all of them, or the conv channels of a stacked projection) into `out`.
    fn conv_columns(&self, x: &CudaAct, weight: &CudaWeight, state: &mut CudaGdnState, out: &CudaAct) {
        let kernel = state.cfg.conv_kernel;
        if kernel > 9 {
            self.record(Err(format!("conv kernel {kernel} > 9 is not supported on CUDA")), "gdn_conv");
            return;
        }
        let (ty, w) = match weight {
            CudaWeight::Matrix { dtype, buf, .. } => (float_format(*dtype).0, self.p(buf)),
            CudaWeight::Vector(v) => ("f32", self.p(v)),
            CudaWeight::Affine(_) => {
                self.record(Err("conv weights must be bf16, f16 or f32"), "gdn_conv");
                return;
            }
        };
        let (rows, channels, stride) = (x.rows as i32, out.cols as i32, x.cols as i32);
        // Decode: one launch walks the rows. A prompt: every run of rows at
        // once, then the window advanced.
        let walked = x.rows <= GDN_CONV_WALKED_ROWS;
        let (name, grid) = match walked {
            true => (format!("gdn_conv_{ty}"), blocks(out.cols, 128)),
            false => (
                format!("gdn_conv_rows_{ty}"),
                (out.cols.div_ceil(128) as u32, x.rows.div_ceil(GDN_CONV_RUN) as u32, 1),
            ),
        };
        launch!(
            self,
            &name,
            cfg(grid, 128, 0),
            self.p(&x.buf),
            w,
            self.p(&state.conv),
            self.p(&out.buf),
            rows,
            channels,
            kernel as i32,
            stride
        );
        if walked {
            return;
        }
        launch!(
            self,
            "gdn_conv_window",
            cfg(blocks(out.cols, 128), 128, 0),
            self.p(&x.buf),
            self.p(&state.conv),
            rows,
            channels,
            kernel as i32,
            stride
        );
    }

    /// The gated delta rule over `rows` tokens into `out` ([rows, value
    /// dim]): g and β from a and b, q and k L2-normalized in place, then the
    /// recurrence, advancing the state.
    fn delta_rule(
        &self,
        x: &DeltaRuleInputs,
        rows: usize,
        a_log: &CudaSlice<f32>,
        dt_bias: &CudaSlice<f32>,
        state: &mut CudaGdnState,
        out: &CudaAct,
    ) {
        let c = &state.cfg;
        let g = self.act(rows, c.num_v_heads);
        let beta = self.act(rows, c.num_v_heads);
        launch!(
            self,
            "gdn_prepare",
            cfg((rows as u32, 1, 1), 128, 0),
            x.q,
            x.k,
            x.a,
            x.b,
            self.p(a_log),
            self.p(dt_bias),
            self.p(&g.buf),
            self.p(&beta.buf),
            c.num_k_heads as i32,
            c.num_v_heads as i32,
            c.k_head_dim as i32,
            x.qk_stride as i32,
            x.ab_stride as i32
        );
        // The chunked form and gdn_scan128 copy q and k rows in 16-byte
        // pieces: rows must start 16-byte aligned (a stacked projection's
        // rows are, unless its width is not a multiple of 4).
        let aligned = x.qk_stride.is_multiple_of(4) && x.q.is_multiple_of(16) && x.k.is_multiple_of(16);
        let chunked = aligned
            && c.k_head_dim == 128
            && rows >= GDN_CHUNK
            && gdn_chunk_prep_shared(c.v_head_dim).max(GDN_CHUNK_STATE_SHARED) <= self.max_block_shared;
        if chunked {
            return self.delta_rule_chunked(x, rows, &g, &beta, state, out);
        }
        // Key heads of 128: the state held in registers (16 value columns per
        // block), the inputs staged ahead; other sizes: one thread per value
        // column, state in memory.
        let (name, grid, threads) = if c.k_head_dim == 128 && aligned {
            ("gdn_scan128", (c.num_v_heads as u32, c.v_head_dim.div_ceil(GDN_SCAN_COLS) as u32, 1), 128)
        } else {
            ("gdn_recurrent", (c.num_v_heads as u32, 1, 1), c.v_head_dim.div_ceil(32) as u32 * 32)
        };
        launch!(
            self,
            name,
            cfg(grid, threads, 0),
            x.q,
            x.k,
            x.v,
            self.p(&g.buf),
            self.p(&beta.buf),
            self.p(&state.recurrent),
            self.p(&out.buf),
            rows as i32,
            c.num_k_heads as i32,
            c.num_v_heads as i32,
            c.k_head_dim as i32,
            c.v_head_dim as i32,
            c.v_heads_tiled as i32,
            x.qk_stride as i32,
            x.v_stride as i32
        );
    }

    /// The recurrence of `delta_rule` in chunks of 64 tokens (gdn_chunked.cu):
    /// per slice of up to `GDN_CHUNK_SLICE` tokens, the chunks' operands in
    /// parallel, then the state through them in order.
    fn delta_rule_chunked(
        &self,
        x: &DeltaRuleInputs,
        rows: usize,
        g: &CudaAct,
        beta: &CudaAct,
        state: &mut CudaGdnState,
        out: &CudaAct,
    ) {
        let c = &state.cfg;
        let (nv, dv) = (c.num_v_heads, c.v_head_dim);
        let slots = rows.min(GDN_CHUNK_SLICE).div_ceil(GDN_CHUNK) * nv;
        // A-fragment operands: 64×128 f32 each per chunk and head.
        let (wf, qf, kf) = (self.act(slots, 8192), self.act(slots, 8192), self.act(slots, 8192));
        let (u, o0, last) = (self.act(slots, GDN_CHUNK * dv), self.act(slots, GDN_CHUNK * dv), self.act(slots, 1));
        for t0 in (0..rows).step_by(GDN_CHUNK_SLICE) {
            let n = (rows - t0).min(GDN_CHUNK_SLICE);
            let at = |base: u64, stride: usize| base + (t0 * stride * 4) as u64;
            launch!(
                self,
                "gdn_chunk_prep",
                cfg((n.div_ceil(GDN_CHUNK) as u32, nv as u32, 1), 256, gdn_chunk_prep_shared(dv) as u32),
                at(x.q, x.qk_stride),
                at(x.k, x.qk_stride),
                at(x.v, x.v_stride),
                at(self.p(&g.buf), nv),
                at(self.p(&beta.buf), nv),
                self.p(&wf.buf),
                self.p(&qf.buf),
                self.p(&kf.buf),
                self.p(&u.buf),
                self.p(&o0.buf),
                self.p(&last.buf),
                n as i32,
                c.num_k_heads as i32,
                nv as i32,
                dv as i32,
                c.v_heads_tiled as i32,
                x.qk_stride as i32,
                x.v_stride as i32
            );
            launch!(
                self,
                "gdn_chunk_state",
                cfg((nv as u32, dv.div_ceil(GDN_CHUNK_COLS) as u32, 1), 512, GDN_CHUNK_STATE_SHARED as u32),
                self.p(&wf.buf),
                self.p(&qf.buf),
                self.p(&kf.buf),
                self.p(&u.buf),
                self.p(&o0.buf),
                self.p(&last.buf),
                self.p(&state.recurrent),
                at(self.p(&out.buf), nv * dv),
                n as i32,
                nv as i32,
                dv as i32
            );
        }
    }

    fn copy_columns(&self, src: &CudaAct, dst: &CudaAct, group: usize, offset: usize, len: usize, dst_off: usize) {
        let n = src.rows * (src.cols / group) * len;
        launch!(
            self,
            "copy_columns",
            Self::elementwise_cfg(n),
            self.p(&src.buf),
            self.p(&dst.buf),
            src.rows as i32,
            src.cols as i32,
            group as i32,
            offset as i32,
            len as i32,
            dst.cols as i32,
            dst_off as i32
        );
    }

    fn gather_rows(&self, x: &CudaAct, idx: &[i32]) -> CudaAct {
        let out = self.act(idx.len(), x.cols);
        let d_idx = self.upload_slice(idx);
        launch!(
            self,
            "gather_rows",
            cfg((idx.len() as u32, 1, 1), 256, 0),
            self.p(&x.buf),
            self.p(&d_idx),
            self.p(&out.buf),
            x.cols as i32
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_attention_holds_what_the_device_gives_a_block() {
        // H100/H200 (227 KB a block): 128 KB of rows whatever the head dim.
        let hopper = 227 * 1024;
        let f32_keys = |hd, max| decode_whole_keys(hd, max, KvPrecision::F32);
        assert_eq!([64, 128, 256].map(|hd| f32_keys(hd, hopper)), [Some(256), Some(128), Some(64)]);
        // Ada and consumer Ampere (99 KB): the largest power of two that fits.
        let ada = 99 * 1024;
        assert_eq!([64, 128, 256].map(|hd| f32_keys(hd, ada)), [Some(128), Some(64), Some(32)]);
        // Turing (64 KB): too few keys of 256 values for the kernel's sums.
        assert_eq!(f32_keys(256, 64 * 1024), None);
        assert_eq!(f32_keys(128, 64 * 1024), Some(32));
        // f16 rows: as many keys in half the bytes, so the same keys where
        // f32 rows fit, and whole caches on smaller devices.
        let f16_keys = |hd, max| decode_whole_keys(hd, max, KvPrecision::F16);
        assert_eq!([64, 128, 256].map(|hd| f16_keys(hd, hopper)), [Some(256), Some(128), Some(64)]);
        assert_eq!([64, 128, 256].map(|hd| f16_keys(hd, ada)), [Some(256), Some(128), Some(64)]);
        assert_eq!(f16_keys(256, 64 * 1024), Some(32));
        // Every chosen block fits with the kernel's static shared memory, and
        // its key space holds the warps' value sums (8 warps, 4 heads, f32).
        for kv in [KvPrecision::F16, KvPrecision::F32] {
            for max in [hopper, ada, 64 * 1024, 48 * 1024] {
                for hd in [64, 128, 256] {
                    if let Some(w) = decode_whole_keys(hd, max, kv) {
                        // A whole-cache block asks for at least its rows, at
                        // most what the device gives it.
                        let padded = decode_whole_shared(w, hd, kv, max);
                        assert!(padded >= decode_shared(w, hd, kv) && padded + DECODE_STATIC_SHARED <= max);
                        for chunk in [w, decode_plan(w + 1, w, kv).0] {
                            let shared = decode_shared(chunk, hd, kv);
                            assert!(shared + DECODE_STATIC_SHARED <= max, "{hd} at {max}");
                            assert!(shared - chunk * hd * kv.bytes() >= 8 * DECODE_HEADS * hd * 4, "{hd} {kv:?}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn split_caches_fold_the_prologue_while_one_wave_holds_them() {
        let h200 = 132;
        let heads = |num_heads, num_kv_heads| QkvShape { num_heads, num_kv_heads, head_dim: 128, output_gate: false };
        // Qwen3-8B (32 query heads, 8 KV heads, head dim 128, f16 cache): 128
        // keys a chunk, 16 blocks a chunk: up to 8 chunks (1024 keys).
        let whole = decode_whole_keys(128, 227 * 1024, KvPrecision::F16).unwrap();
        let folds = |n_keys, shape: &QkvShape| folds_prologue(n_keys, whole, KvPrecision::F16, shape, h200, true);
        assert!(folds(1024, &heads(32, 8)) && !folds(1025, &heads(32, 8)));
        assert!(!folds(8192, &heads(32, 8)));
        // 2 KV heads of 8 query heads (4 pairs): 8 blocks a chunk, so 16
        // chunks; 8 KV heads of one query head each: 8 blocks a chunk too.
        assert!(folds(2048, &heads(16, 2)) && !folds(2049, &heads(16, 2)));
        assert!(folds(2048, &heads(8, 8)) && !folds(2049, &heads(8, 8)));
        // 64 KV heads of 2: 64 blocks a chunk, 2 chunks.
        assert!(folds(256, &heads(128, 64)) && !folds(257, &heads(128, 64)));
        // A cache one block holds folds whatever the heads.
        assert!(folds(128, &heads(256, 256)) && !folds(129, &heads(256, 256)));
        // Without folding split caches, only a cache one block holds folds.
        let folds_whole = |n_keys| folds_prologue(n_keys, whole, KvPrecision::F16, &heads(32, 8), h200, false);
        assert!(folds_whole(128) && !folds_whole(129));
    }

    #[test]
    fn whole_cache_decode_blocks_ask_for_an_f32_blocks_shared_memory() {
        // Hopper, head dim 128: 128 keys, 64 KB of f16 rows, 128 KB asked.
        let hopper = 227 * 1024;
        assert_eq!(decode_shared(128, 128, KvPrecision::F16), 64 * 1024);
        assert_eq!(decode_whole_shared(128, 128, KvPrecision::F16, hopper), 128 * 1024);
        assert_eq!(decode_whole_shared(128, 128, KvPrecision::F32, hopper), 128 * 1024);
        // Ada (99 KB): f16 holds 128 keys of 128 (64 KB), f32 rows of as many
        // keys would not fit, so the block asks for what the device gives.
        let ada = 99 * 1024;
        assert_eq!(decode_whole_keys(128, ada, KvPrecision::F16), Some(128));
        assert_eq!(decode_whole_shared(128, 128, KvPrecision::F16, ada), ada - DECODE_STATIC_SHARED);
    }

    #[test]
    fn decode_plans_change_only_where_the_recorded_step_does() {
        for (kv, half) in [(KvPrecision::F32, true), (KvPrecision::F16, false)] {
            for whole in [32, 64, 128, 256] {
                assert_eq!(decode_plan(whole, whole, kv), (whole, 1));
                let (chunk, splits) = decode_plan(whole + 1, whole, kv);
                assert_eq!(chunk, if half { (whole / 2).max(32) } else { whole });
                assert!(splits * chunk > whole && splits.is_power_of_two());
                // Between consecutive keys of a recorded step, the plan is fixed.
                for n in 1..5000 {
                    if decode_step_key(n) == decode_step_key(n + 1) {
                        let (a, b) = (decode_plan(n, whole, kv), decode_plan(n + 1, whole, kv));
                        assert_eq!(a, b, "{n} keys, {whole} a block, {kv:?}");
                        assert_eq!(split_count(n), split_count(n + 1));
                    }
                }
            }
        }
    }
}
