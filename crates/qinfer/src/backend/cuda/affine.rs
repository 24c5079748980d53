//! Affine-quantized linear layers: the CUDA-core GEMVs (affine_gemv.cu, any
//! bit width), the tensor-core GEMVs of 4- and 8-bit levels (affine_mma.cu,
//! with the folded RMSNorm and the quantized row handed on), the choice
//! between them, the tensor-core GEMM of a batch's rows (affine_gemm.rs) and
//! the prefill's bf16 tiles for cuBLAS, and embedding rows from an affine
//! table.

use std::sync::atomic::Ordering;

use super::kernels::{Resolve, blocks, cfg, kernel_args, resolve_n};
use super::linear::{GEMV_MAX_ROWS, GEMV_SHAPES, gemv_shape_suffix};
use super::{AffineSide, AffineWeight, CudaAct, CudaBackend, CudaWeight, QuantizedRow};
use crate::Result;
use crate::tensor::DType;

/// The bit widths with affine kernels (`FOR_AFFINE_BITS` in affine.cuh).
pub(super) const AFFINE_BITS: [u32; 6] = [2, 3, 4, 5, 6, 8];

const SIDES: [AffineSide; 3] = [AffineSide::F32, AffineSide::Bf16, AffineSide::Records];

/// Slots of per-storage tables: every bit width with every side.
pub(super) const STORAGES: usize = AFFINE_BITS.len() * SIDES.len();

/// The slot of affine storage (`bits`, `side`) in per-storage tables.
pub(super) fn storage_slot(bits: u32, side: AffineSide) -> Option<usize> {
    let b = AFFINE_BITS.iter().position(|&x| x == bits)?;
    Some(b * SIDES.len() + side as usize)
}

/// The kernels' name for affine storage: `affine{bits}`, with `_bf16` for
/// bf16 scales and biases and `_k` for super-block records.
pub(super) fn storage_name(bits: u32, side: AffineSide) -> String {
    let suffix = match side {
        AffineSide::F32 => "",
        AffineSide::Bf16 => "_bf16",
        AffineSide::Records => "_k",
    };
    format!("affine{bits}{suffix}")
}

/// Whether a storage has kernels for groups of 32 and more, and for groups
/// of 16 (`_g16`): f32 and bf16 sides every group size (bf16 ones none of
/// 16: the backend widens those at upload); records Q4_K and Q5_K's groups
/// of 32, Q2_K, Q3_K and Q6_K's of 16.
pub(super) fn storage_groups(bits: u32, side: AffineSide) -> (bool, bool) {
    match side {
        AffineSide::F32 => (true, true),
        AffineSide::Bf16 => (true, false),
        AffineSide::Records => (matches!(bits, 4 | 5), matches!(bits, 2 | 3 | 6)),
    }
}

/// Every storage with kernels: (slot, bits, side).
pub(super) fn storages() -> impl Iterator<Item = (usize, u32, AffineSide)> {
    AFFINE_BITS.into_iter().flat_map(|bits| SIDES.map(|side| (bits, side))).filter_map(|(bits, side)| {
        let (g32, g16) = storage_groups(bits, side);
        (g32 || g16).then(|| (storage_slot(bits, side).expect("a listed width"), bits, side))
    })
}

/// The tensor-core affine decode GEMVs (affine_mma.cu), `gemv_{format}_mma_g{group}`
/// and their `_swiglu` forms: (bits, side, groups).
const AFFINE_MMA_KERNELS: &[(u32, AffineSide, &[usize])] = &[
    (4, AffineSide::F32, &[32, 64, 128]),
    (4, AffineSide::Bf16, &[32, 64, 128]),
    (8, AffineSide::F32, &[32, 64]),
    (8, AffineSide::Bf16, &[32, 64]),
    (4, AffineSide::Records, &[32]),
];

/// Group sizes of the tensor-core kernels.
const MMA_GROUPS: [usize; 3] = [32, 64, 128];

/// Word-aligned affine bit widths, which have `gemv_{format}_rows` kernels
/// (f32 and bf16 sides, and Q4_K's records).
const AFFINE_ROWS_BITS: [u32; 3] = [2, 4, 8];

/// One affine storage's kernels.
pub(super) struct StorageKernels<K> {
    /// `gemv_{format}_r{R}a{A}` by [`GEMV_SHAPES`] (groups of 32 and more).
    gemv: Option<[K; GEMV_SHAPES.len()]>,
    /// `gemv_{format}_g16_r{R}a{A}` (groups of 16).
    gemv_g16: Option<[K; GEMV_SHAPES.len()]>,
    /// `gemv_{format}_rows`.
    rows: Option<K>,
    /// `{format}_to_bf16`, `moe_{format}_to_bf16`, `embed_{format}`.
    to_bf16: K,
    pub(super) moe_to_bf16: K,
    embed: K,
    /// `gemv_{format}_mma_g{group}` and its `_swiglu` by [`MMA_GROUPS`].
    mma: [Option<[K; 2]>; MMA_GROUPS.len()],
}

/// The kernels of affine_gemv.cu and affine_mma.cu, by storage.
pub(super) struct AffineKernels<K> {
    storages: Vec<Option<StorageKernels<K>>>,
}

impl<K> AffineKernels<K> {
    pub(super) fn load(get: &mut Resolve<'_, K>) -> Result<Self> {
        const U: &str = "affine_gemv.cu";
        let mut table: Vec<Option<StorageKernels<K>>> = (0..STORAGES).map(|_| None).collect();
        for (slot, bits, side) in storages() {
            let f = storage_name(bits, side);
            let (g32, g16) = storage_groups(bits, side);
            let gemv = |get: &mut Resolve<'_, K>, infix: &str| {
                resolve_n(get, U, |s| format!("gemv_{f}{infix}{}", gemv_shape_suffix(GEMV_SHAPES[s])))
            };
            let mut mma: [Option<[K; 2]>; MMA_GROUPS.len()] = Default::default();
            for (i, group) in MMA_GROUPS.into_iter().enumerate() {
                let has =
                    AFFINE_MMA_KERNELS.iter().any(|(b, s, groups)| (*b, *s) == (bits, side) && groups.contains(&group));
                if has {
                    let base = format!("gemv_{f}_mma_g{group}");
                    mma[i] = Some(resolve_n(get, "affine_mma.cu", |k| format!("{base}{}", ["", "_swiglu"][k]))?);
                }
            }
            let rows = AFFINE_ROWS_BITS.contains(&bits) && (side != AffineSide::Records || bits == 4);
            table[slot] = Some(StorageKernels {
                gemv: if g32 { Some(gemv(get, "")?) } else { None },
                gemv_g16: if g16 { Some(gemv(get, "_g16")?) } else { None },
                rows: if rows { Some(get(U, format!("gemv_{f}_rows"))?) } else { None },
                to_bf16: get(U, format!("{f}_to_bf16"))?,
                moe_to_bf16: get(U, format!("moe_{f}_to_bf16"))?,
                embed: get(U, format!("embed_{f}"))?,
                mma,
            });
        }
        Ok(AffineKernels { storages: table })
    }

    /// The kernels of `w`'s storage.
    pub(super) fn of(&self, w: &AffineWeight) -> Option<&StorageKernels<K>> {
        self.storage(w.params.bits, w.side)
    }

    /// Every tensor-core affine GEMV: what takes the device's shared memory
    /// and its split of L1 (see [`CudaBackend::new`]).
    pub(super) fn mma_kernels(&self) -> impl Iterator<Item = &K> {
        self.storages.iter().flatten().flat_map(|s| s.mma.iter().flatten().flatten())
    }

    pub(super) fn storage(&self, bits: u32, side: AffineSide) -> Option<&StorageKernels<K>> {
        self.storages.get(storage_slot(bits, side)?)?.as_ref()
    }
}

kernel_args! {
    /// `gemv_{format}_rows`.
    AffineRowsArgs { w: u64, scales: u64, biases: u64, x: u64, bias: u64, y: u64, out_dim: i32, in_dim: i32, group: i32 }
}
kernel_args! {
    /// `gemv_{format}[_g16]_r{R}a{A}`.
    AffineGemvArgs {
        w: u64, scales: u64, biases: u64, x: u64, bias: u64, y: u64, out_dim: i32, in_dim: i32, group: i32, n_act: i32,
    }
}
kernel_args! {
    /// `gemv_{format}_mma_g{group}`.
    AffineMmaArgs {
        w: u64, scales: u64, biases: u64, x: u64, norm_w: u64, eps: f32, bias: u64, y: u64, out_dim: i32, in_dim: i32,
        n_act: i32, row_in: u64, row_out: u64, row_out_norm: u64, lead: i32,
    }
}
kernel_args! {
    /// `gemv_{format}_mma_g{group}_swiglu`.
    AffineMmaSwigluArgs {
        w: u64, scales: u64, biases: u64, x: u64, norm_w: u64, eps: f32, y: u64, out_dim: i32, in_dim: i32,
        n_act: i32, row_in: u64, row_out: u64, lead: i32,
    }
}
kernel_args! {
    /// `{format}_to_bf16`.
    AffineToBf16Args { w: u64, scales: u64, biases: u64, out: u64, row0: i32, rows: i32, in_dim: i32, group: i32 }
}
kernel_args! {
    /// `embed_{format}`.
    AffineEmbedArgs { w: u64, scales: u64, biases: u64, ids: u64, out: u64, cols: i32, group: i32 }
}

/// Values per prefill tile of dequantized affine weights (bf16 scratch of 128 MiB).
const AFFINE_TILE_VALUES: usize = 64 << 20;

/// Warps of a tensor-core affine GEMV block (`AMMA_WARPS`).
pub(super) const AFFINE_MMA_WARPS: usize = 8;

/// Activation rows the tensor-core affine GEMV takes (`AMMA_MAX_ACT`).
pub(super) const AFFINE_MMA_MAX_ACT: usize = 4;

/// Stages of each warp's ring in the tensor-core affine GEMV (`AMMA_STAGES`).
pub(super) const AFFINE_MMA_STAGES: usize = 3;

/// Launches of the tensor-core affine GEMV one call may take, each over the
/// next rows it holds (each launch reads the weights again): four launches
/// of 4-bit levels read about 2 bytes a weight, against 4.5 for the prefill
/// path (levels read, a bf16 copy written, then read by cuBLAS).
pub(super) const AFFINE_MMA_MAX_LAUNCHES: usize = 4;

/// Dynamic shared memory the tensor-core affine GEMV may use.
pub(super) const AFFINE_MMA_MAX_SHARED: usize = 200 * 1024;
/// At most this much, two of its blocks fit on an SM (228 KiB, less 1 KiB
/// reserved and 4 KiB static per block).
const AFFINE_MMA_TWO_PER_SM: usize = 108 * 1024;

/// Weight rows per block of `gemv_affine*_rows` (`AFFINE_BLOCK_ROWS`).
pub(super) const AFFINE_BLOCK_ROWS: usize = 8;

/// Shared memory of a tensor-core affine GEMV launch, None when the kernel
/// does not apply: per warp (`AFFINE_MMA_WARPS`) a ring of `AFFINE_MMA_STAGES` stages, each 16 rows of 128
/// bytes of levels (4 units of 64 columns at 4 bits, 2 at 8) plus their
/// scales and biases; then each activation row staged as two signed bytes
/// per column and 12 bytes per 64 columns (its sum and scale, and its Σx²
/// when the kernel folds an RMSNorm; 20 with groups of 32, a sum per half),
/// for one row 12 bytes per 16 columns (a row handed on quantized).
/// Groups of 32 take at most 2 activation rows.
fn affine_mma_shared_size(w: &AffineWeight, act_rows: usize) -> Option<usize> {
    let (bits, group) = (w.params.bits as usize, w.params.group_size);
    let has_kernel = AFFINE_MMA_KERNELS
        .iter()
        .any(|(b, side, groups)| (*b, *side) == (w.params.bits, w.side) && groups.contains(&group));
    if !has_kernel {
        return None;
    }
    let units = if bits == 4 { 4 } else { 2 };
    let (scales, biases) = w.side_bytes(units * 64);
    let stage = 16 * 128 + 16 * (scales + biases);
    let unit_stats = if group == 32 { 20 } else { 12 };
    // One row may come quantized by slices of 16 ([`QuantizedRow`]): 12 bytes each.
    let stats = if act_rows == 1 { w.cols / 16 * 12 } else { act_rows * (w.cols / 64 * unit_stats) };
    let shared = AFFINE_MMA_WARPS * AFFINE_MMA_STAGES * stage + act_rows * 2 * w.cols + stats;
    let applies = w.cols.is_multiple_of(units * 64)
        && (1..=affine_mma_act_rows(w)).contains(&act_rows)
        && shared <= AFFINE_MMA_MAX_SHARED;
    applies.then_some(shared)
}

/// Activation rows one launch of the tensor-core affine GEMV takes: groups
/// of 32 keep a sum per half of each unit, so they take fewer.
fn affine_mma_act_rows(w: &AffineWeight) -> usize {
    if w.params.group_size == 32 { 2 } else { AFFINE_MMA_MAX_ACT }
}

impl CudaBackend {
    /// Affine weights, decode: the GEMV unpacks levels in registers.
    /// With `hand_on` (a norm weight's pointer or 0), the tensor-core GEMV
    /// also hands y on quantized ([`QuantizedRow`]).
    pub(super) fn affine_gemv(
        &self,
        x: &CudaAct,
        w: &AffineWeight,
        bias_ptr: u64,
        y: &mut CudaAct,
        hand_on: Option<u64>,
    ) {
        // 4- and 8-bit levels, up to four tokens a launch: the tensor-core kernel.
        if let Some(shared) = self.affine_mma_shared(w, x.rows) {
            self.affine_mma(x, None, w, bias_ptr, y, false, shared, hand_on);
            return;
        }
        let kernels = self.k.affine.of(w);
        let chunks = w.cols / 32;
        let aligned = 32 % w.params.bits == 0;
        let (wp, scales, biases) = (self.p(&w.packed), self.p(&w.scales), self.p(&w.biases));
        let (xp, yp) = (self.p(&x.buf), self.p(&y.buf));
        let (out_dim, in_dim, group) = (w.rows as i32, w.cols as i32, w.params.group_size as i32);
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
            let args = AffineRowsArgs { w: wp, scales, biases, x: xp, bias: bias_ptr, y: yp, out_dim, in_dim, group };
            self.launch_opt(kernels.and_then(|k| k.rows.as_ref()), "affine GEMV", cfg(grid, threads, 0), &args);
            return;
        }
        let act = if x.rows == 1 { 1 } else { GEMV_MAX_ROWS };
        let shape = self.gemv_launch_shape(w.rows, w.cols, 32, act);
        let grid = (w.rows.div_ceil(shape.rows_per_block) as u32, 1, 1);
        let table = kernels.and_then(|k| if w.params.group_size == 16 { k.gemv_g16.as_ref() } else { k.gemv.as_ref() });
        let kernel = GEMV_SHAPES.iter().position(|&s| s == (shape.rows_per_block, act)).and_then(|i| Some(&table?[i]));
        // The block-per-rows kernels take the activation rows too.
        let n_act = x.rows as i32;
        let args =
            AffineGemvArgs { w: wp, scales, biases, x: xp, bias: bias_ptr, y: yp, out_dim, in_dim, group, n_act };
        self.launch_opt(kernel, "affine GEMV", cfg(grid, shape.threads, 0), &args);
    }

    /// Blocks of a tensor-core affine GEMV: as many as fit on the device at
    /// once (each stages x once and loops over tiles of 16 rows), at most one
    /// per tile.
    fn affine_mma_grid(&self, tiles: usize, shared: usize) -> u32 {
        let per_sm = if shared <= AFFINE_MMA_TWO_PER_SM { 2 } else { 1 };
        // Every block loops the same number of times: 384 tiles on 264 slots
        // take two rounds either way, and 192 blocks stage x fewer times.
        // (Filling all 264 slots instead, so that no SM holds more than 3 of
        // the 8B's q|k|v tiles, measured 8B q4g64 decode +0.4% and 30B-A3B
        // -1.2%.)
        let rounds = tiles.div_ceil(per_sm * self.sm_count);
        tiles.div_ceil(rounds) as u32
    }

    /// Shared memory of each launch of a tensor-core affine GEMV over `rows`
    /// activation rows ([`affine_mma_shared_size`]; more rows than one launch
    /// takes go in up to [`AFFINE_MMA_MAX_LAUNCHES`] launches), None where it
    /// does not apply, a fixed GEMV shape is set (profiling the CUDA-core
    /// kernels) or the tensor-core GEMM takes the rows
    /// ([`Self::affine_gemm_takes`]).
    pub(super) fn affine_mma_shared(&self, w: &AffineWeight, rows: usize) -> Option<usize> {
        let per_launch = affine_mma_act_rows(w);
        if rows > per_launch * AFFINE_MMA_MAX_LAUNCHES || self.affine_gemm_takes(w, rows) {
            return None;
        }
        self.affine_mma_launch_shared(w, rows.min(per_launch))
    }

    /// The rows each launch of the tensor-core affine GEMV takes for `w` when
    /// a call has more, None where that does not apply (no kernel, so many
    /// rows of x too wide for shared memory, or a fixed GEMV shape).
    pub(super) fn affine_mma_rows(&self, w: &AffineWeight) -> Option<usize> {
        let per_launch = affine_mma_act_rows(w);
        self.affine_mma_launch_shared(w, per_launch).map(|_| per_launch)
    }

    fn affine_mma_launch_shared(&self, w: &AffineWeight, act_rows: usize) -> Option<usize> {
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
    pub(super) fn affine_mma(
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
        let (norm_w, eps) = norm.unwrap_or((0, 0.0));
        let row_in = match &x.quantized {
            Some(q) if x.rows == 1 && q.norm == norm_w => self.p(&q.buf.buf),
            _ => 0,
        };
        let out_cols = if swiglu { w.rows / 2 } else { w.rows };
        y.quantized = hand_on
            .filter(|_| x.rows == 1 && out_cols.is_multiple_of(16) && y.cols == out_cols)
            .map(|norm| Box::new(QuantizedRow { buf: self.act(1, QuantizedRow::words(out_cols)), norm }));
        let row_out = y.quantized.as_ref().map_or(0, |q| self.p(&q.buf.buf));
        // After a kernel that streams no weights (the decode attention) every
        // stage the ring holds goes out before the wait.
        let lead = if self.after_attention.load(Ordering::Relaxed) { AFFINE_MMA_STAGES - 1 } else { 1 } as i32;
        // Blocks loop over tiles, swiglu blocks over pairs of them.
        let tiles = if swiglu { (w.rows / 2).div_ceil(16) } else { w.rows.div_ceil(16) };
        let threads = (32 * AFFINE_MMA_WARPS) as u32;
        let c = cfg((self.affine_mma_grid(tiles, shared), 1, 1), threads, shared as u32);
        let kernel = MMA_GROUPS
            .iter()
            .position(|&g| g == w.params.group_size)
            .and_then(|i| self.k.affine.of(w)?.mma[i].as_ref())
            .map(|k| &k[swiglu as usize]);
        let (wp, scales, biases) = (self.p(&w.packed), self.p(&w.scales), self.p(&w.biases));
        let (x0, y0) = (self.p(&x.buf), self.p(&y.buf));
        let (out_dim, in_dim) = (w.rows as i32, w.cols as i32);
        let row_out_norm = y.quantized.as_ref().map_or(0, |q| q.norm);
        // Rows past what one launch takes: one launch per slice of them.
        let per_launch = affine_mma_act_rows(w);
        for t0 in (0..x.rows).step_by(per_launch) {
            let n_act = per_launch.min(x.rows - t0) as i32;
            let xp = x0 + (t0 * x.cols * 4) as u64;
            let yp = y0 + (t0 * y.cols * 4) as u64;
            if swiglu {
                let args = AffineMmaSwigluArgs {
                    w: wp,
                    scales,
                    biases,
                    x: xp,
                    norm_w,
                    eps,
                    y: yp,
                    out_dim,
                    in_dim,
                    n_act,
                    row_in,
                    row_out,
                    lead,
                };
                self.launch_opt(kernel, "tensor-core affine GEMV", c, &args);
            } else {
                let args = AffineMmaArgs {
                    w: wp,
                    scales,
                    biases,
                    x: xp,
                    norm_w,
                    eps,
                    bias: bias_ptr,
                    y: yp,
                    out_dim,
                    in_dim,
                    n_act,
                    row_in,
                    row_out,
                    row_out_norm,
                    lead,
                };
                self.launch_opt(kernel, "tensor-core affine GEMV", c, &args);
            }
        }
    }

    /// silu(gate)·up from a stacked affine gate|up weight in the tensor-core
    /// GEMV's epilogue; None where that kernel does not apply.
    pub(super) fn affine_swiglu(&self, x: &CudaAct, norm: Option<(u64, f32)>, w: &AffineWeight) -> Option<CudaAct> {
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
    pub(super) fn foldable_norm<'w>(
        &self,
        x: &CudaAct,
        norm: &CudaWeight,
        eps: f32,
        w: &'w CudaWeight,
    ) -> Option<(&'w AffineWeight, (u64, f32))> {
        let (CudaWeight::Affine(a), CudaWeight::Vector(n)) = (w, norm) else { return None };
        (n.len() == x.cols && a.cols == x.cols).then(|| (a, (self.p(n), eps)))
    }

    /// Affine weights, many rows: a batch's decode rows take the tensor-core
    /// GEMM ([`Self::affine_gemm_takes`]); a prefill's dequantizes tiles of
    /// rows to bf16 in one transient buffer, each multiplied by cuBLAS into
    /// its output columns. The bias (a pointer of 0: none) is added in the
    /// tensor-core GEMM's epilogue, or after the prefill path's tiles.
    pub(super) fn affine_gemm(&self, x: &CudaAct, w: &AffineWeight, bias_ptr: u64, y: &mut CudaAct, accumulate: bool) {
        if self.affine_gemm_takes(w, x.rows) {
            self.affine_tc_gemm(x, w, bias_ptr, y, accumulate);
            return;
        }
        let tile_rows = (AFFINE_TILE_VALUES / w.cols).clamp(1, w.rows);
        let scratch = self.uninit::<u16>(tile_rows * w.cols);
        let inputs = self.gemm_inputs(x, DType::BF16);
        let kernel = self.k.affine.of(w).map(|k| &k.to_bf16);
        for r0 in (0..w.rows).step_by(tile_rows) {
            let rows = tile_rows.min(w.rows - r0);
            let chunks = rows * w.cols / 32;
            let args = AffineToBf16Args {
                w: self.p(&w.packed),
                scales: self.p(&w.scales),
                biases: self.p(&w.biases),
                out: self.p(&scratch),
                row0: r0 as i32,
                rows: rows as i32,
                in_dim: w.cols as i32,
                group: w.params.group_size as i32,
            };
            self.launch_opt(kernel, "affine dequantization", cfg(blocks(chunks, 256), 256, 0), &args);
            let y_ptr = self.p(&y.buf) + (r0 * 4) as u64;
            self.gemm_rows(x, &inputs, DType::BF16, self.p(&scratch), rows, w.cols, y_ptr, w.rows, accumulate);
        }
        self.add_bias(y, bias_ptr);
    }

    /// Embedding rows `ids` (on the device at `ids_ptr`) of an affine table.
    pub(super) fn affine_embed(&self, w: &AffineWeight, ids: usize, ids_ptr: u64, out: &CudaAct) {
        let args = AffineEmbedArgs {
            w: self.p(&w.packed),
            scales: self.p(&w.scales),
            biases: self.p(&w.biases),
            ids: ids_ptr,
            out: self.p(&out.buf),
            cols: w.cols as i32,
            group: w.params.group_size as i32,
        };
        let kernel = self.k.affine.of(w).map(|k| &k.embed);
        self.launch_opt(kernel, "affine embedding", cfg((ids as u32, 1, 1), 128, 0), &args);
    }
}
