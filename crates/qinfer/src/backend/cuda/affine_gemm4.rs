//! The tensor-core GEMM for 4-bit affine weights (affine_gemm4.cu): levels
//! become MMA operands in half an instruction each, and each span of one
//! scale takes its scale and bias in f32 after the MMA, where the general
//! kernel (affine_gemm.rs) spends about six instructions on every weight.

use super::kernels::{Resolve, cfg, kernel_args, resolve_n};
use super::{AffineSide, AffineWeight, CudaAct, CudaBackend};
use crate::Result;

/// Warps of a block (`AG4_ROW_WARPS`): 16 weight rows each, every one of
/// the block's activation rows.
pub(super) const AG4_ROW_WARPS: usize = 4;

/// Stages of a block's ring of 256-column stages (`AG4_STAGES`).
pub(super) const AG4_STAGES: usize = 4;

/// Activation rows of a block, one kernel each (`gemm4_{format}_a{rows}`),
/// and so the most rows these kernels take. Past 16 rows the general kernel
/// is faster: this one's stages hold 256 columns of every activation row,
/// so fewer blocks fit an SM (H100, the 8B's q4g64 q|k|v, gate|up and down
/// at 32 rows: 29 / 99 / 58 µs here against 26 / 84 / 43 there; at 64, 50 /
/// 144 / 91 against 38 / 110 / 64).
pub(super) const ACT_TILES: [usize; 1] = [16];

/// Columns of a stage (`AG4_COLS`): 128 bytes of each weight row's levels.
/// The split of K keeps whole stages.
pub(super) const STAGE_COLS: usize = 256;

/// The most spans of one scale a stage holds (spans are 32 columns at least).
const STAGE_SPANS: usize = STAGE_COLS / 32;

/// The 4-bit storages with these kernels, by side. Not GGUF's Q4_K
/// records: their scales, decoded per row and span a stage ahead, left the
/// general kernel faster (H100, the 8B's q|k|v, gate|up and down at 16 rows:
/// 30 / 100 / 67 µs here against 25 / 82 / 43 there).
const SIDES: [(AffineSide, &str); 2] = [(AffineSide::F32, "affine4"), (AffineSide::Bf16, "affine4_bf16")];

kernel_args! {
    /// `gemm4_{format}_a{rows}`.
    AffineGemm4Args {
        w: u64, scales: u64, biases: u64, xq: u64, sums: u64, bias: u64, y: u64, part: u64, out_dim: i32,
        in_dim: i32, group: i32, span: i32, n_act: i32, per_split: i32, accumulate: i32,
    }
}
kernel_args! {
    /// `affine_gemm4_prep`.
    AffineGemm4PrepArgs { x: u64, xq: u64, sums: u64, n_act: i32, in_dim: i32, span: i32, sums_row: i32 }
}

/// The 4-bit GEMM kernels, by side, and the activations' prep.
pub(super) struct AffineGemm4Kernels<K> {
    by_side: [[K; ACT_TILES.len()]; SIDES.len()],
    prep: K,
}

impl<K> AffineGemm4Kernels<K> {
    pub(super) fn load(get: &mut Resolve<'_, K>) -> Result<Self> {
        const U: &str = "affine_gemm4.cu";
        let mut side = |i: usize| resolve_n(get, U, |t| format!("gemm4_{}_a{}", SIDES[i].1, ACT_TILES[t]));
        let by_side = [side(0)?, side(1)?];
        Ok(AffineGemm4Kernels { by_side, prep: get(U, "affine_gemm4_prep".into())? })
    }

    fn of(&self, side: AffineSide) -> Option<&[K; ACT_TILES.len()]> {
        SIDES.iter().position(|&(s, _)| s == side).map(|i| &self.by_side[i])
    }

    /// Every GEMM kernel with its shared memory.
    pub(super) fn gemms(&self) -> impl Iterator<Item = (&K, usize)> {
        self.by_side.iter().flat_map(|tiles| tiles.iter().zip(ACT_TILES).map(|(k, act)| (k, most_shared_bytes(act))))
    }
}

/// Threads of a block.
const THREADS: usize = AG4_ROW_WARPS * 32;

/// Bytes of one scale (or bias) of `side`.
fn side_size(side: AffineSide) -> usize {
    match side {
        AffineSide::F32 => 4,
        _ => 2,
    }
}

/// The 4-byte words of global memory a stage copies for one weight row's
/// scales (as many again for its biases): the values of the stage's spans,
/// whose first need not start a word (2-byte values at an odd index). The
/// kernel's `ag4_side_words` is the same function.
fn side_words(group: usize, size: usize) -> usize {
    let values = if group < STAGE_COLS { STAGE_COLS / group } else { 1 };
    (values * size).div_ceil(4) + usize::from(size == 2)
}

/// Shared memory of a block: its ring of stages, each with the levels, the
/// activations, their span sums and the weight rows' scales and biases.
fn shared_bytes(act: usize, group: usize, side: AffineSide) -> usize {
    let rows = AG4_ROW_WARPS * 16;
    let side = rows * 2 * side_words(group, side_size(side)) * 4;
    AG4_STAGES * (rows * 128 + act * 512 + STAGE_SPANS * act * 4 + side)
}

/// The most shared memory a block of `act` rows takes (groups of 32 and f32
/// scales).
fn most_shared_bytes(act: usize) -> usize {
    shared_bytes(act, 32, AffineSide::F32)
}

/// The columns one scale covers within a stage, where the kernel takes
/// `group`: groups of 32, 64, 128 or 256, or multiples of 256 (a stage then
/// lies in one group).
fn span(group: usize) -> Option<usize> {
    match group {
        32 | 64 | 128 | 256 => Some(group),
        g if g % STAGE_COLS == 0 => Some(STAGE_COLS),
        _ => None,
    }
}

impl CudaBackend {
    /// Whether `rows` activation rows through `w` take the 4-bit kernels
    /// (of the rows the tensor-core GEMM takes): up to 16 rows, where they
    /// beat the general kernel (H100, the 8B's q4g64 q|k|v, gate|up and
    /// down at 16 rows: 20 / 58 / 39 µs against 23 / 77 / 39).
    pub(super) fn affine_gemm4_takes(&self, w: &AffineWeight, rows: usize) -> bool {
        self.affine_gemm4
            && rows <= *ACT_TILES.last().expect("tiles")
            && w.params.bits == 4
            && span(w.params.group_size).is_some()
            && self.k.affine_gemm4.of(w.side).is_some()
            && most_shared_bytes(*ACT_TILES.last().expect("tiles")) <= self.max_block_shared
    }

    /// `y (+)= x·wᵀ (+ bias)` through the 4-bit kernels
    /// ([`Self::affine_gemm4_takes`]): x is narrowed and its span sums taken
    /// by the prep kernel, then one GEMM launch (and the splits' sum).
    pub(super) fn affine_gemm4(&self, x: &CudaAct, w: &AffineWeight, bias_ptr: u64, y: &CudaAct, accumulate: bool) {
        let (Some(kernels), Some(span)) = (self.k.affine_gemm4.of(w.side), span(w.params.group_size)) else {
            self.record(Err("no 4-bit GEMM for this weight"), "tensor-core affine GEMM");
            return;
        };
        let tile = ACT_TILES.iter().position(|&t| x.rows <= t).unwrap_or(ACT_TILES.len() - 1);
        let act = ACT_TILES[tile];
        let units = w.cols / 64;
        let stages = units.div_ceil(STAGE_COLS / 64);
        let sums_row = stages * (STAGE_COLS / span);
        let xq = self.uninit::<u16>(x.rows * w.cols);
        let sums = self.uninit::<f32>(x.rows * sums_row);
        let prep = AffineGemm4PrepArgs {
            x: self.p(&x.buf),
            xq: self.p(&xq),
            sums: self.p(&sums),
            n_act: x.rows as i32,
            in_dim: w.cols as i32,
            span: span as i32,
            sums_row: sums_row as i32,
        };
        let threads_prep = x.rows * w.cols / 8;
        self.launch(&self.k.affine_gemm4.prep, cfg(super::kernels::blocks(threads_prep, 256), 256, 0), &prep);
        let row_blocks = w.rows.div_ceil(AG4_ROW_WARPS * 16);
        let act_blocks = x.rows.div_ceil(act);
        // As many blocks an SM as its shared memory holds; each split at
        // least two stages long.
        let shared = shared_bytes(act, w.params.group_size, w.side);
        let per_sm = (self.max_block_shared / shared).max(1);
        let per_split = self.affine_gemm_split(row_blocks * act_blocks, per_sm, stages, 2) * (STAGE_COLS / 64);
        let splits = units.div_ceil(per_split);
        let part = (splits > 1).then(|| self.uninit::<f32>(splits * x.rows * w.rows));
        let args = AffineGemm4Args {
            w: self.p(&w.packed),
            scales: self.p(&w.scales),
            biases: self.p(&w.biases),
            xq: self.p(&xq),
            sums: self.p(&sums),
            bias: if part.is_some() { 0 } else { bias_ptr },
            y: self.p(&y.buf),
            part: part.as_ref().map_or(0, |p| self.p(p)),
            out_dim: w.rows as i32,
            in_dim: w.cols as i32,
            group: w.params.group_size as i32,
            span: span as i32,
            n_act: x.rows as i32,
            per_split: per_split as i32,
            accumulate: accumulate as i32,
        };
        let grid = (row_blocks as u32, act_blocks as u32, splits as u32);
        let launch = cfg(grid, THREADS as u32, shared as u32);
        self.launch(&kernels[tile], launch, &args);
        if let Some(part) = &part {
            self.affine_gemm_reduce(part, splits, x.rows, w.rows, bias_ptr, y, accumulate);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every tile's block fits the shared memory an H100 or H200 gives one
    /// block (227 KiB), and the stage copies divide among its threads.
    #[test]
    fn blocks_fit_hopper() {
        for act in ACT_TILES {
            assert!(most_shared_bytes(act) <= 227 * 1024, "{act} rows: {} bytes", most_shared_bytes(act));
            let t = THREADS;
            assert_eq!((AG4_ROW_WARPS * 16 * 8) % t, 0, "{act} rows: level pieces");
            assert_eq!((act * 32) % t, 0, "{act} rows: activation pieces");
        }
        // bf16 scales of groups of 64, the common case: three blocks an SM
        // (228 KiB, 1 KiB of it a block's own).
        assert!(3 * (shared_bytes(16, 64, AffineSide::Bf16) + 1024) <= 228 * 1024);
    }

    /// The words that hold a stage's scales: whole values, one more for
    /// 2-byte values that may start mid-word.
    #[test]
    fn side_words_cover_a_stage() {
        assert_eq!(side_words(64, 2), 3);
        assert_eq!(side_words(32, 2), 5);
        assert_eq!(side_words(512, 2), 2);
        assert_eq!(side_words(64, 4), 4);
        assert_eq!(side_words(32, 4), 8);
        assert_eq!(side_words(256, 4), 1);
    }

    /// The spans the kernel takes: one scale over each, dividing a stage or
    /// a stage within one group.
    #[test]
    fn spans_divide_a_stage() {
        assert_eq!(span(32), Some(32));
        assert_eq!(span(64), Some(64));
        assert_eq!(span(128), Some(128));
        assert_eq!(span(512), Some(256));
        assert_eq!(span(16), None);
        assert_eq!(span(96), None);
    }
}
