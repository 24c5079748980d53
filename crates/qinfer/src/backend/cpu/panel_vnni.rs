//! Matmuls of several activation rows (prompts, batched steps) with ggml
//! block weights on AVX-512 VNNI, in panels of 16 weight rows.
//!
//! A panel is 16 weight rows unpacked once into unsigned byte levels and
//! interleaved by 4-value chunks: chunk `k` of the 16 rows fills one 512-bit
//! register, so a single `vpdpbusd` against chunk `k` of an activation row
//! (4 signed bytes, broadcast) adds 4 products to each of the 16 rows' sums.
//! Each lane thus holds one weight row's exact i32 sum over a block (or a
//! K-quant scale group) with no horizontal reduction, and the panel is
//! unpacked once for all the activation rows of the call.
//!
//! Level offsets (Q5_0's −16, Q6_K's −32, Q3_K's −4) are taken out as integers
//! (`off·Σx`), K-quant scales multiply the group sums in i32 and the mins term
//! is a `vpdpwssd` of the mins with the activations' 16-value sums. So every
//! block yields exactly the integers of the scalar reference
//! ([`super::q8::dot`], [`super::q8k::dot_scalar`]), and the float step is the
//! scalar's expression in its order, lane by lane (no fused multiply-add): the
//! outputs equal the scalar dots bit for bit, as the AVX2 kernels of these
//! types do. Q4_0, Q4_1 and Q8_0 instead follow ggml's float order, as their
//! AVX2 kernels do (see `q8_avx2`): each 4-value chunk's exact sum is one of
//! 8 float lanes, so their outputs equal those kernels' bit for bit.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;
use std::cell::RefCell;

use rayon::prelude::*;

use super::act_blocks::{Q8Block, Q8KBlock};
use super::out_ptr::OutPtr;
use crate::quant::kquants::{self, QK_K};
use crate::tensor::DType;

/// Weight rows per panel: one i32 lane each in a 512-bit register.
const LANES: usize = 16;

/// Activation rows per pass over a panel's blocks: each loaded weight
/// register serves this many rows.
const MR: usize = 4;

/// The same in ggml's order, whose 8 float sums a row (one per 4-value
/// chunk) take 8 registers: 2 rows, with the panel's 8 chunks of a block.
const GGML_MR: usize = 2;

/// Whether this module's kernels may run: AVX-512 F, BW, VL and VNNI present and
/// allowed by the CPU kernel limit.
pub(super) fn available() -> bool {
    super::simd::has_avx512_vnni()
}

/// One panel, unpacked. `levels[k·16 + j]` holds values 4k..4k+4 of row j as
/// unsigned bytes; per block (or super-block) `b`, `d`/`m` hold each row's
/// float scale and min scale (`dmin` for K-quants, 0 where the type has
/// none); per scale group `g` of the K-quants, `scales` holds each row's
/// integer scale and `aux` its min (Q2_K, Q4_K, Q5_K) or offset × scale
/// (Q3_K, Q6_K), the latter as i16 pairs of adjacent 16-value groups.
#[derive(Default)]
struct Panel {
    levels: Vec<u32>,
    d: Vec<f32>,
    m: Vec<f32>,
    scales: Vec<i32>,
    aux: Vec<u32>,
}

thread_local! {
    static PANEL: RefCell<Panel> = RefCell::new(Panel::default());
}

/// Weight rows a thread will most likely read next (rayon hands each
/// thread a run of consecutive panels), to be brought into L2 while it
/// computes. Reading a panel walks its 16 rows side by side, 16 strided
/// streams the hardware prefetchers do not follow well, so without this
/// the unpack waits on memory that the arithmetic before it could have
/// covered. The requests are spread over that arithmetic: all at once, they
/// fill the core's miss buffers and the thread stalls on them instead.
#[derive(Clone, Copy)]
struct Ahead<'a> {
    span: &'a [u8],
}

impl<'a> Ahead<'a> {
    const NONE: Ahead<'static> = Ahead { span: &[] };

    /// Rows `r0..r0 + 16` (those below `rows`) of a matrix of `rb`-byte rows.
    fn rows(bytes: &'a [u8], rb: usize, r0: usize, rows: usize) -> Ahead<'a> {
        if r0 >= rows {
            return Ahead { span: &[] };
        }
        Ahead { span: &bytes[r0 * rb..(r0 + LANES).min(rows) * rb] }
    }

    /// Lines to request per step so that `steps` steps cover the span.
    fn per_step(self, steps: usize) -> usize {
        self.span.len().div_ceil(64).div_ceil(steps.max(1))
    }

    /// Requests step `i`'s `per` lines (of [`Ahead::per_step`]).
    #[inline(always)]
    fn step(self, i: usize, per: usize) {
        let lines = self.span.len().div_ceil(64);
        for l in (i * per).min(lines)..((i + 1) * per).min(lines) {
            // SAFETY: prefetching has no architectural effect; the address is in bounds.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(self.span.as_ptr().add(l * 64).cast()) };
        }
    }

    /// Requests the whole span at once.
    fn all(self) {
        self.step(0, self.per_step(1));
    }
}

/// Reads the weight row `j` of a panel, or none past the matrix's last row.
struct Rows<'a> {
    bytes: &'a [u8],
    rb: usize,
    r0: usize,
    count: usize,
}

impl Rows<'_> {
    fn row(&self, j: usize) -> Option<&[u8]> {
        (j < self.count).then(|| &self.bytes[(self.r0 + j) * self.rb..(self.r0 + j + 1) * self.rb])
    }
}

/// Writes the 256 levels of row `j`'s super-block `b` into the panel: chunk
/// k (values 4k..4k+4) goes to lane j of the panel's chunk b·64 + k.
///
/// # Safety
/// The panel holds the chunks of super-block `b`; `j < 16`.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn put_levels_k(levels: &mut [u32], lv: &[u8; QK_K], b: usize, j: usize) {
    let stride = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
    for q in 0..4 {
        // SAFETY: `lv` holds 4·64 bytes; chunks b·64 + 16q .. +16 of lane j lie in the panel (caller).
        unsafe {
            let v = _mm512_loadu_si512(lv[64 * q..].as_ptr().cast());
            let at = levels.as_mut_ptr().add((b * (QK_K / 4) + 16 * q) * LANES + j);
            _mm512_i32scatter_epi32::<4>(at.cast(), stride, v);
        }
    }
}

/// How a 32-value block type's levels are made unsigned and its min applied.
#[derive(Clone, Copy)]
struct B32 {
    /// Added to every level to make it unsigned: the sum loses `offset·Σx`.
    offset: i32,
    /// Byte offset of the min `m` (Q4_1, Q5_1), if the type has one.
    min_at: Option<usize>,
    /// Whether `m·s_x` joins each block's step (Q5_1, as the scalar dot adds
    /// it there) or a separate sum added at the end (Q4_1).
    min_in_step: bool,
    /// Whether the float steps follow ggml's AVX2 order (Q4_0, Q4_1, Q8_0, as
    /// their AVX2 kernels in `q8_avx2` do) rather than the scalar dot's.
    ggml_order: bool,
}

fn b32_layout(dtype: DType) -> B32 {
    match dtype {
        DType::Q4_0 => B32 { offset: 8, min_at: None, min_in_step: false, ggml_order: true },
        DType::Q4_1 => B32 { offset: 0, min_at: Some(2), min_in_step: false, ggml_order: true },
        DType::Q5_0 => B32 { offset: 16, min_at: None, min_in_step: false, ggml_order: false },
        DType::Q5_1 => B32 { offset: 0, min_at: Some(2), min_in_step: true, ggml_order: false },
        DType::Q8_0 => B32 { offset: 128, min_at: None, min_in_step: false, ggml_order: true },
        _ => unreachable!("{} is not a 32-value block type", dtype.name()),
    }
}

/// `out[t, r]` = Σ_c x[t, c]·W[r, c] for 32-value block weights `bytes`
/// (`rows` rows of `blocks` blocks) and activations quantized to `xq`
/// (`n` rows of `blocks` blocks).
pub(super) fn matmul_b32(
    dtype: DType,
    bytes: &[u8],
    rows: usize,
    blocks: usize,
    xq: &[Q8Block],
    n: usize,
    out: OutPtr,
) {
    assert!(available() && dtype.is_quantized() && !dtype.is_k_quant());
    let rb = blocks * dtype.block_bytes();
    assert_eq!(bytes.len(), rows * rb);
    assert_eq!(xq.len(), n * blocks);
    let layout = b32_layout(dtype);
    // offset·Σq per activation block (or, in ggml's order, per 4-value chunk):
    // the level offset's share of each sum.
    let xoff: Vec<i32> = if layout.ggml_order {
        xq.iter()
            .flat_map(|y| y.qs.chunks_exact(4).map(|c| layout.offset * c.iter().map(|&q| q as i32).sum::<i32>()))
            .collect()
    } else {
        xq.iter().map(|y| layout.offset * y.qs.iter().map(|&q| q as i32).sum::<i32>()).collect()
    };
    (0..rows.div_ceil(LANES)).into_par_iter().for_each(|p| {
        let w = Rows { bytes, rb, r0: p * LANES, count: (rows - p * LANES).min(LANES) };
        let next = Ahead::rows(bytes, rb, (p + 1) * LANES, rows);
        PANEL.with(|panel| {
            let mut panel = panel.borrow_mut();
            // SAFETY: AVX-512 F/BW/VL/VNNI are present (`available`, asserted above).
            unsafe { unpack_b32(dtype, layout, &w, blocks, &mut panel) };
            let mut t = 0;
            while t < n {
                let take = (n - t).min(if layout.ggml_order { GGML_MR } else { MR });
                // The first pass over the panel brings in the next one.
                let ahead = if t == 0 { next } else { Ahead::NONE };
                let job = B32Job {
                    layout,
                    panel: &panel,
                    blocks,
                    xq,
                    xoff: &xoff,
                    t,
                    rows,
                    r0: w.r0,
                    count: w.count,
                    out,
                    ahead,
                };
                // SAFETY: as above; the panel holds `blocks` blocks and the
                // activation rows t..t+take exist.
                unsafe {
                    match (take, layout.ggml_order) {
                        (1, false) => job.run::<1>(),
                        (2, false) => job.run::<2>(),
                        (3, false) => job.run::<3>(),
                        (_, false) => job.run::<MR>(),
                        (1, true) => job.run_ggml::<1>(),
                        (_, true) => job.run_ggml::<GGML_MR>(),
                    }
                }
                t += take;
            }
        });
    });
}

/// Unpacks a panel of 32-value blocks: unsigned levels, `d` and `m` (0
/// where the type has none) per block. Each block of the 16 rows is read as
/// a 16 × 4 (Q8_0: 16 × 8) matrix of level dwords and transposed in
/// registers, so chunk k of the 16 rows lands as one 512-bit store; the
/// scales come in one gather. Rows past the matrix read a zero block (their
/// lanes are never stored). Every entry of the panel is written.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn unpack_b32(dtype: DType, layout: B32, w: &Rows, blocks: usize, panel: &mut Panel) {
    panel.levels.resize(blocks * 8 * LANES, 0);
    panel.d.resize(blocks * LANES, 0.0);
    panel.m.resize(blocks * LANES, 0.0);
    let bb = dtype.block_bytes();
    // Larger than any 32-value block; stands for the rows past the matrix.
    let zero = [0u8; 64];
    let base = w.bytes[w.r0 * w.rb..].as_ptr();
    // Each row's current block, advanced a block at a time (the zero block stays).
    let mut blk: [*const u8; LANES] =
        std::array::from_fn(|j| if j < w.count { base.wrapping_add(j * w.rb) } else { zero.as_ptr() });
    let step: [usize; LANES] = std::array::from_fn(|j| if j < w.count { bb } else { 0 });
    let live: __mmask16 = if w.count >= LANES { 0xffff } else { (1u16 << w.count) - 1 };
    let row_at = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(w.rb as i32),
    );
    let m4 = _mm512_set1_epi8(0x0f);
    let flip = _mm512_set1_epi8(-128);
    // Bits b of a 4-bit index, as 16 in byte b: Q5's fifth bits of one chunk.
    let fifth = _mm512_setr_epi32(
        0x00000000, 0x00000010, 0x00001000, 0x00001010, 0x00100000, 0x00100010, 0x00101000, 0x00101010, 0x10000000,
        0x10000010, 0x10001000, 0x10001010, 0x10100000, 0x10100010, 0x10101000, 0x10101010,
    );
    let levels = panel.levels.as_mut_ptr();
    for b in 0..blocks {
        let at = b * bb;
        // SAFETY: `blk` points at block `b` of each live row (`bb` bytes) or
        // at the zero block (64 bytes); every offset read lies within a block.
        let chunks: [__m512i; 8] = unsafe {
            match dtype {
                DType::Q8_0 => {
                    let lo = transpose_16x4(&blk, 2);
                    let hi = transpose_16x4(&blk, 18);
                    std::array::from_fn(|k| _mm512_xor_si512(if k < 4 { lo[k] } else { hi[k - 4] }, flip))
                }
                _ => {
                    let (qs, qh) = match dtype {
                        DType::Q4_0 => (2, None),
                        DType::Q4_1 => (4, None),
                        DType::Q5_0 => (6, Some(2)),
                        DType::Q5_1 => (8, Some(4)),
                        _ => unreachable!("{} is not a 32-value block type", dtype.name()),
                    };
                    let q = transpose_16x4(&blk, qs);
                    let mut c: [__m512i; 8] = std::array::from_fn(|k| {
                        if k < 4 {
                            _mm512_and_si512(q[k], m4)
                        } else {
                            _mm512_and_si512(_mm512_srli_epi32::<4>(q[k - 4]), m4)
                        }
                    });
                    if let Some(h) = qh {
                        // Bit v of qh is bit 4 of value v: chunk k takes bits 4k..4k+4.
                        let bits = _mm512_mask_i32gather_epi32::<1>(
                            _mm512_setzero_si512(),
                            live,
                            _mm512_add_epi32(row_at, _mm512_set1_epi32((at + h) as i32)),
                            base.cast(),
                        );
                        for (k, ck) in c.iter_mut().enumerate() {
                            let nib = _mm512_and_si512(
                                _mm512_srlv_epi32(bits, _mm512_set1_epi32(4 * k as i32)),
                                _mm512_set1_epi32(0xf),
                            );
                            *ck = _mm512_or_si512(*ck, _mm512_permutexvar_epi32(nib, fifth));
                        }
                    }
                    c
                }
            }
        };
        for (k, ck) in chunks.iter().enumerate() {
            // SAFETY: the panel holds `blocks`·8 chunks of 16 lanes.
            unsafe { _mm512_storeu_si512(levels.add((b * 8 + k) * LANES).cast(), *ck) };
        }
        // The dword at a block's start holds d and (Q4_1, Q5_1) m as f16.
        // SAFETY: each live row's block `b` starts at `at`; masked lanes read nothing.
        let dm = unsafe {
            _mm512_mask_i32gather_epi32::<1>(
                _mm512_setzero_si512(),
                live,
                _mm512_add_epi32(row_at, _mm512_set1_epi32(at as i32)),
                base.cast(),
            )
        };
        let d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
        let m = if layout.min_at.is_some() {
            _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(dm)))
        } else {
            _mm512_setzero_ps()
        };
        // SAFETY: the panel holds `blocks`·16 scales of each kind.
        unsafe {
            _mm512_storeu_ps(panel.d.as_mut_ptr().add(b * LANES), d);
            _mm512_storeu_ps(panel.m.as_mut_ptr().add(b * LANES), m);
        }
        for (p, s) in blk.iter_mut().zip(step) {
            *p = p.wrapping_add(s);
        }
    }
}

/// The 16 bytes at `rows[j] + at` for the 16 rows, as four registers:
/// dword i of row j in lane j of register i.
///
/// # Safety
/// Each of the 16 pointers has 16 readable bytes at `at`.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn transpose_16x4(rows: &[*const u8; LANES], at: usize) -> [__m512i; 4] {
    // SAFETY: the caller guarantees 16 readable bytes at each `rows[j] + at`.
    let load = |j: usize| unsafe { _mm_loadu_si128(rows[j].add(at).cast()) };
    // Register i holds rows i, 4 + i, 8 + i, 12 + i in its 128-bit quarters,
    // so that the in-quarter 4 × 4 transposes below leave row j in lane j.
    let a: [__m512i; 4] = std::array::from_fn(|i| {
        let v = _mm512_castsi128_si512(load(i));
        let v = _mm512_inserti32x4::<1>(v, load(4 + i));
        let v = _mm512_inserti32x4::<2>(v, load(8 + i));
        _mm512_inserti32x4::<3>(v, load(12 + i))
    });
    // Per quarter q: rows 4q..4q+4 (r0..r3), dwords d0..d3 of each.
    let r01_lo = _mm512_unpacklo_epi32(a[0], a[1]); // r0d0 r1d0 r0d1 r1d1
    let r01_hi = _mm512_unpackhi_epi32(a[0], a[1]); // r0d2 r1d2 r0d3 r1d3
    let r23_lo = _mm512_unpacklo_epi32(a[2], a[3]); // r2d0 r3d0 r2d1 r3d1
    let r23_hi = _mm512_unpackhi_epi32(a[2], a[3]); // r2d2 r3d2 r2d3 r3d3
    [
        _mm512_unpacklo_epi64(r01_lo, r23_lo),
        _mm512_unpackhi_epi64(r01_lo, r23_lo),
        _mm512_unpacklo_epi64(r01_hi, r23_hi),
        _mm512_unpackhi_epi64(r01_hi, r23_hi),
    ]
}

/// Activation rows `t..t+R` against one panel of 32-value blocks.
struct B32Job<'a> {
    layout: B32,
    panel: &'a Panel,
    blocks: usize,
    xq: &'a [Q8Block],
    xoff: &'a [i32],
    t: usize,
    rows: usize,
    r0: usize,
    count: usize,
    out: OutPtr,
    ahead: Ahead<'a>,
}

impl B32Job<'_> {
    /// Per block, the exact `s = Σ level·x − offset·Σx` in each lane, then the
    /// scalar dot's step: `acc + (d_w·d_x)·s` (Q4_0, Q5_0, Q8_0: the scalar's
    /// `+ 0` for Q5_0 changes no sum that starts at +0), `acc + ((d_w·d_x)·s
    /// + m_w·s_x)` (Q5_1), or for Q4_1 `m_w·s_x` summed apart and added last.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn run<const R: usize>(&self) {
        let (panel, blocks, t) = (self.panel, self.blocks, self.t);
        let has_min = self.layout.min_at.is_some();
        let mut acc = [_mm512_setzero_ps(); R];
        let mut mins = [_mm512_setzero_ps(); R];
        let lv = panel.levels.as_ptr();
        let per = self.ahead.per_step(blocks);
        for b in 0..blocks {
            self.ahead.step(b, per);
            // SAFETY: the panel holds `blocks`·8 chunks of 16 lanes and `blocks`·16 scales.
            let (wv, dw, mw) = unsafe {
                let base = lv.add(b * 8 * LANES);
                let wv: [__m512i; 8] = std::array::from_fn(|k| _mm512_loadu_si512(base.add(k * LANES).cast()));
                (wv, _mm512_loadu_ps(panel.d.as_ptr().add(b * LANES)), _mm512_loadu_ps(panel.m.as_ptr().add(b * LANES)))
            };
            for i in 0..R {
                let y = &self.xq[(t + i) * blocks + b];
                let xp = y.qs.as_ptr();
                let mut s0 = _mm512_set1_epi32(-self.xoff[(t + i) * blocks + b]);
                let mut s1 = _mm512_setzero_si512();
                for k in (0..8).step_by(2) {
                    // SAFETY: `qs` holds 32 bytes; chunks k and k + 1 lie within it.
                    unsafe {
                        s0 = _mm512_dpbusd_epi32(s0, wv[k], splat4(xp.add(4 * k)));
                        s1 = _mm512_dpbusd_epi32(s1, wv[k + 1], splat4(xp.add(4 * k + 4)));
                    }
                }
                let s = _mm512_add_epi32(s0, s1);
                let mut v = _mm512_mul_ps(_mm512_mul_ps(dw, _mm512_set1_ps(y.d)), _mm512_cvtepi32_ps(s));
                if has_min {
                    let m = _mm512_mul_ps(mw, _mm512_set1_ps(y.s));
                    if self.layout.min_in_step {
                        v = _mm512_add_ps(v, m);
                    } else {
                        mins[i] = _mm512_add_ps(mins[i], m);
                    }
                }
                acc[i] = _mm512_add_ps(acc[i], v);
            }
        }
        for i in 0..R {
            let a = if has_min && !self.layout.min_in_step { _mm512_add_ps(acc[i], mins[i]) } else { acc[i] };
            // SAFETY: row t + i of the output has `rows` floats; r0 + count ≤ rows.
            unsafe { store_lanes(self.out.get().add((t + i) * self.rows + self.r0), a, self.count) };
        }
    }
}

/// Broadcasts the 4 activation bytes at `p` to every lane.
///
/// # Safety
/// `p` points at 4 readable bytes.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn splat4(p: *const i8) -> __m512i {
    // SAFETY: the caller guarantees 4 readable bytes.
    _mm512_set1_epi32(unsafe { p.cast::<i32>().read_unaligned() })
}

/// Stores lanes `0..count` of `v` at `p`.
///
/// # Safety
/// `p` points at `count` (≤ 16) writable floats.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn store_lanes(p: *mut f32, v: __m512, count: usize) {
    let mask: __mmask16 = if count >= LANES { 0xffff } else { (1u16 << count) - 1 };
    // SAFETY: the caller guarantees `count` writable floats; masked lanes are not touched.
    unsafe { _mm512_mask_storeu_ps(p, mask, v) };
}

impl B32Job<'_> {
    /// ggml's AVX2 order, as `q8_avx2`'s kernels compute it: the exact i32
    /// sum of each 4-value chunk `k` of a block is a float lane `k` of 8,
    /// `acc_k = fma(d_w·d_x, sum_k, acc_k)` block after block, then the
    /// lanes reduced as `hsum_float_8` does, plus (Q4_1) the `m_w·s_x` sum.
    /// All 8 chunk sums of a row live in registers, so `d_w·d_x` is made
    /// once per block and row; hence at most [`GGML_MR`] rows a pass.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn run_ggml<const R: usize>(&self) {
        let (panel, blocks, t) = (self.panel, self.blocks, self.t);
        let mut lanes = [[_mm512_setzero_ps(); 8]; R];
        let lv = panel.levels.as_ptr();
        let per = self.ahead.per_step(blocks);
        for b in 0..blocks {
            self.ahead.step(b, per);
            // SAFETY: the panel holds `blocks`·8 chunks of 16 lanes and `blocks`·16 scales.
            let (wv, dw) = unsafe {
                let base = lv.add(b * 8 * LANES);
                let wv: [__m512i; 8] = std::array::from_fn(|k| _mm512_loadu_si512(base.add(k * LANES).cast()));
                (wv, _mm512_loadu_ps(panel.d.as_ptr().add(b * LANES)))
            };
            for (i, l) in lanes.iter_mut().enumerate() {
                let y = &self.xq[(t + i) * blocks + b];
                let dwx = _mm512_mul_ps(dw, _mm512_set1_ps(y.d));
                for (k, lk) in l.iter_mut().enumerate() {
                    let init = if self.layout.offset == 0 {
                        _mm512_setzero_si512()
                    } else {
                        _mm512_set1_epi32(-self.xoff[((t + i) * blocks + b) * 8 + k])
                    };
                    // SAFETY: `qs` holds 32 bytes; chunk k lies within it.
                    let s = unsafe { _mm512_dpbusd_epi32(init, wv[k], splat4(y.qs.as_ptr().add(4 * k))) };
                    *lk = _mm512_fmadd_ps(dwx, _mm512_cvtepi32_ps(s), *lk);
                }
            }
        }
        for (i, l) in lanes.iter().enumerate() {
            let add = |a, b| _mm512_add_ps(a, b);
            let mut v = add(add(add(l[0], l[4]), add(l[2], l[6])), add(add(l[1], l[5]), add(l[3], l[7])));
            if self.layout.min_at.is_some() {
                let mut mins = _mm512_setzero_ps();
                for b in 0..blocks {
                    let y = &self.xq[(t + i) * blocks + b];
                    // SAFETY: the panel holds `blocks`·16 min scales.
                    let mw = unsafe { _mm512_loadu_ps(panel.m.as_ptr().add(b * LANES)) };
                    mins = add(mins, _mm512_mul_ps(mw, _mm512_set1_ps(y.s)));
                }
                v = add(v, mins);
            }
            // SAFETY: row t + i of the output has `rows` floats; r0 + count ≤ rows.
            unsafe { store_lanes(self.out.get().add((t + i) * self.rows + self.r0), v, self.count) };
        }
    }
}

/// How a K-quant's levels are stored in a panel and its groups scaled.
#[derive(Clone, Copy)]
struct KLayout {
    /// Values per integer scale (16, or 32 where adjacent 16-value groups share one).
    group: usize,
    /// Added to every level to make it unsigned (Q3_K 4, Q6_K 32).
    offset: i32,
    /// Whether the type has mins (Q2_K, Q4_K, Q5_K).
    mins: bool,
}

fn k_layout(dtype: DType) -> KLayout {
    match dtype {
        DType::Q2_K => KLayout { group: 16, offset: 0, mins: true },
        DType::Q3_K => KLayout { group: 16, offset: 4, mins: false },
        DType::Q4_K | DType::Q5_K => KLayout { group: 32, offset: 0, mins: true },
        DType::Q6_K => KLayout { group: 16, offset: 32, mins: false },
        _ => unreachable!("{} is not a K-quant", dtype.name()),
    }
}

/// As [`matmul_b32`] for K-quant weights and Q8_K activations.
pub(super) fn matmul_k(dtype: DType, bytes: &[u8], rows: usize, blocks: usize, xq: &[Q8KBlock], n: usize, out: OutPtr) {
    assert!(available() && dtype.is_k_quant());
    let rb = blocks * dtype.block_bytes();
    assert_eq!(bytes.len(), rows * rb);
    assert_eq!(xq.len(), n * blocks);
    let layout = k_layout(dtype);
    (0..rows.div_ceil(LANES)).into_par_iter().for_each(|p| {
        let w = Rows { bytes, rb, r0: p * LANES, count: (rows - p * LANES).min(LANES) };
        Ahead::rows(bytes, rb, (p + 1) * LANES, rows).all();
        PANEL.with(|panel| {
            let mut panel = panel.borrow_mut();
            // SAFETY: AVX-512 F/BW/VNNI are present (asserted above).
            unsafe { unpack_k(dtype, layout, &w, blocks, &mut panel) };
            let mut t = 0;
            while t < n {
                let take = (n - t).min(MR);
                // SAFETY: as above; the panel holds `blocks` super-blocks.
                unsafe {
                    match (take, layout.group) {
                        (1, 16) => run_k::<1, 16>(layout, &panel, blocks, xq, t, rows, w.r0, w.count, out),
                        (2, 16) => run_k::<2, 16>(layout, &panel, blocks, xq, t, rows, w.r0, w.count, out),
                        (3, 16) => run_k::<3, 16>(layout, &panel, blocks, xq, t, rows, w.r0, w.count, out),
                        (_, 16) => run_k::<MR, 16>(layout, &panel, blocks, xq, t, rows, w.r0, w.count, out),
                        (1, _) => run_k::<1, 32>(layout, &panel, blocks, xq, t, rows, w.r0, w.count, out),
                        (2, _) => run_k::<2, 32>(layout, &panel, blocks, xq, t, rows, w.r0, w.count, out),
                        (3, _) => run_k::<3, 32>(layout, &panel, blocks, xq, t, rows, w.r0, w.count, out),
                        (_, _) => run_k::<MR, 32>(layout, &panel, blocks, xq, t, rows, w.r0, w.count, out),
                    }
                }
                t += take;
            }
        });
    });
}

/// The 256 levels of one K-quant super-block as unsigned bytes (`q + offset`).
#[inline(always)]
fn k_levels(dtype: DType, layout: KLayout, blk: &[u8], lv: &mut [u8; QK_K]) {
    match dtype {
        DType::Q4_K | DType::Q5_K => {
            let (qh, qs) =
                if dtype == DType::Q5_K { (Some(&blk[16..48]), &blk[48..176]) } else { (None, &blk[16..144]) };
            for pair in 0..4 {
                for l in 0..32 {
                    let byte = qs[pair * 32 + l];
                    let (mut lo, mut hi) = (byte & 0x0f, byte >> 4);
                    if let Some(qh) = qh {
                        lo |= ((qh[l] >> (2 * pair)) & 1) << 4;
                        hi |= ((qh[l] >> (2 * pair + 1)) & 1) << 4;
                    }
                    lv[pair * 64 + l] = lo;
                    lv[pair * 64 + 32 + l] = hi;
                }
            }
        }
        DType::Q6_K => {
            let (ql, qh) = (&blk[0..128], &blk[128..192]);
            for half in 0..2 {
                for l in 0..32 {
                    let (a, c) = (ql[half * 64 + l], ql[half * 64 + 32 + l]);
                    let h = qh[half * 32 + l];
                    let base = half * 128;
                    lv[base + l] = (a & 0x0f) | ((h & 3) << 4);
                    lv[base + 32 + l] = (c & 0x0f) | (((h >> 2) & 3) << 4);
                    lv[base + 64 + l] = (a >> 4) | (((h >> 4) & 3) << 4);
                    lv[base + 96 + l] = (c >> 4) | (((h >> 6) & 3) << 4);
                }
            }
        }
        _ => {
            let u = kquants::unpack(dtype, blk);
            for (o, &q) in lv.iter_mut().zip(&u.q) {
                *o = (q as i32 + layout.offset) as u8;
            }
        }
    }
}

/// Per 16-value group: the integer scale and min of a K-quant super-block.
fn k_scales(dtype: DType, blk: &[u8]) -> ([i32; 16], [i32; 16], f32, f32) {
    match dtype {
        DType::Q4_K | DType::Q5_K => {
            let (mut sc, mut mn) = ([0; 16], [0; 16]);
            for j in 0..8 {
                let (s, m) = kquants::scale_min_k4(j, &blk[4..16]);
                (sc[2 * j], sc[2 * j + 1]) = (s as i32, s as i32);
                (mn[2 * j], mn[2 * j + 1]) = (m as i32, m as i32);
            }
            (sc, mn, kquants::f16_at(blk, 0), kquants::f16_at(blk, 2))
        }
        DType::Q6_K => (std::array::from_fn(|g| blk[192 + g] as i8 as i32), [0; 16], kquants::f16_at(blk, 208), 0.0),
        DType::Q3_K => (kquants::q3_k_scales(&blk[96..108]), [0; 16], kquants::f16_at(blk, 108), 0.0),
        DType::Q2_K => (
            std::array::from_fn(|g| (blk[g] & 0x0f) as i32),
            std::array::from_fn(|g| (blk[g] >> 4) as i32),
            kquants::f16_at(blk, 80),
            kquants::f16_at(blk, 82),
        ),
        _ => unreachable!("{} is not a K-quant", dtype.name()),
    }
}

/// Unpacks a K-quant panel: levels, `d`/`dmin` per super-block, scales per
/// `layout.group` values, and the mins (or offset × scales) as i16 pairs.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn unpack_k(dtype: DType, layout: KLayout, w: &Rows, blocks: usize, panel: &mut Panel) {
    let groups = QK_K / layout.group;
    panel.levels.clear();
    panel.levels.resize(blocks * (QK_K / 4) * LANES, 0);
    panel.d.clear();
    panel.d.resize(blocks * LANES, 0.0);
    panel.m.clear();
    panel.m.resize(blocks * LANES, 0.0);
    panel.scales.clear();
    panel.scales.resize(blocks * groups * LANES, 0);
    panel.aux.clear();
    panel.aux.resize(blocks * 8 * LANES, 0);
    let bb = dtype.block_bytes();
    let mut lv = [0u8; QK_K];
    for j in 0..LANES {
        let Some(row) = w.row(j) else { continue };
        for (b, blk) in row.chunks_exact(bb).enumerate() {
            k_levels(dtype, layout, blk, &mut lv);
            assert!(panel.levels.len() >= (b + 1) * (QK_K / 4) * LANES);
            // SAFETY: asserted above; j < 16.
            unsafe { put_levels_k(&mut panel.levels, &lv, b, j) };
            let (sc, mn, d, dmin) = k_scales(dtype, blk);
            panel.d[b * LANES + j] = d;
            panel.m[b * LANES + j] = dmin;
            for g in 0..groups {
                panel.scales[(b * groups + g) * LANES + j] = sc[g * layout.group / 16];
            }
            // Per pair of 16-value groups, as two i16 (|min| < 64, |offset·scale| ≤ 32·128).
            let aux = |g: usize| if layout.mins { mn[g] } else { layout.offset * sc[g] } as i16 as u16 as u32;
            for h in 0..8 {
                panel.aux[(b * 8 + h) * LANES + j] = aux(2 * h) | (aux(2 * h + 1) << 16);
            }
        }
    }
}

/// Activation rows `t..t+R` against one K-quant panel (`G` values per
/// scale): per super-block the exact `isum = Σ_g scale_g·Σ level·x` (less
/// `Σ offset·scale_g·bsum_g` for Q3_K/Q6_K) and `msum = Σ_g min_g·bsum_g`,
/// then `acc + ((d·d_x)·isum − (dmin·d_x)·msum)` as the scalar dot.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn run_k<const R: usize, const G: usize>(
    layout: KLayout,
    panel: &Panel,
    blocks: usize,
    xq: &[Q8KBlock],
    t: usize,
    rows: usize,
    r0: usize,
    count: usize,
    out: OutPtr,
) {
    let groups = QK_K / G;
    let chunks = G / 4;
    let mut acc = [_mm512_setzero_ps(); R];
    let lv = panel.levels.as_ptr();
    for b in 0..blocks {
        let mut isum = [_mm512_setzero_si512(); R];
        let ys: [&Q8KBlock; R] = std::array::from_fn(|i| &xq[(t + i) * blocks + b]);
        for g in 0..groups {
            // SAFETY: the panel holds `blocks`·64 chunks of 16 lanes and
            // `blocks`·`groups` scale vectors; group g's chunks lie in the block.
            let (wv, sc) = unsafe {
                let base = lv.add((b * (QK_K / 4) + g * chunks) * LANES);
                let wv: [__m512i; 8] = std::array::from_fn(|k| {
                    if k < chunks { _mm512_loadu_si512(base.add(k * LANES).cast()) } else { _mm512_setzero_si512() }
                });
                (wv, _mm512_loadu_si512(panel.scales.as_ptr().add((b * groups + g) * LANES).cast()))
            };
            for i in 0..R {
                let xp = ys[i].qs.as_ptr();
                let (mut s0, mut s1) = (_mm512_setzero_si512(), _mm512_setzero_si512());
                for k in (0..chunks).step_by(2) {
                    // SAFETY: chunks k, k + 1 of group g lie within the 256 `qs` bytes.
                    unsafe {
                        s0 = _mm512_dpbusd_epi32(s0, wv[k], splat4(xp.add(g * G + 4 * k)));
                        s1 = _mm512_dpbusd_epi32(s1, wv[k + 1], splat4(xp.add(g * G + 4 * k + 4)));
                    }
                }
                isum[i] = _mm512_add_epi32(isum[i], _mm512_mullo_epi32(sc, _mm512_add_epi32(s0, s1)));
            }
        }
        // SAFETY: the panel holds 8 aux vectors and one d/m vector per super-block.
        let (aux, dw, mw) = unsafe {
            let aux: [__m512i; 8] =
                std::array::from_fn(|h| _mm512_loadu_si512(panel.aux.as_ptr().add((b * 8 + h) * LANES).cast()));
            (aux, _mm512_loadu_ps(panel.d.as_ptr().add(b * LANES)), _mm512_loadu_ps(panel.m.as_ptr().add(b * LANES)))
        };
        for i in 0..R {
            let y = ys[i];
            // Σ_g aux_g·bsum_g, two groups per `vpdpwssd` (bsums are i16 pairs in memory).
            let mut side = _mm512_setzero_si512();
            for (h, a) in aux.iter().enumerate() {
                // SAFETY: `bsums` holds 16 i16, so pair h (bytes 4h..4h+4) is in bounds.
                side = _mm512_dpwssd_epi32(side, *a, unsafe { splat4(y.bsums.as_ptr().add(2 * h).cast()) });
            }
            let (is, ms) =
                if layout.mins { (isum[i], side) } else { (_mm512_sub_epi32(isum[i], side), _mm512_setzero_si512()) };
            let yd = _mm512_set1_ps(y.d);
            let v = _mm512_sub_ps(
                _mm512_mul_ps(_mm512_mul_ps(dw, yd), _mm512_cvtepi32_ps(is)),
                _mm512_mul_ps(_mm512_mul_ps(mw, yd), _mm512_cvtepi32_ps(ms)),
            );
            acc[i] = _mm512_add_ps(acc[i], v);
        }
    }
    for (i, a) in acc.iter().enumerate() {
        // SAFETY: row t + i of the output has `rows` floats; r0 + count ≤ rows.
        unsafe { store_lanes(out.get().add((t + i) * rows + r0), *a, count) };
    }
}

#[cfg(test)]
mod tests {
    use super::super::out_ptr::OutPtr;
    use super::super::test_rng::{avx512_vnni_or_skip, finite_f16, fresh_seed, next};
    use super::super::{q8, q8k};
    use super::*;
    use crate::quant::kquants::f16_field_offsets;

    /// Random level and scale bytes with random finite f16 fields, or every
    /// byte `fill` (saturated levels) with f16 fields of 0.5.
    fn weights(seed: &mut u64, dtype: DType, rows: usize, blocks: usize, fill: Option<u8>) -> Vec<u8> {
        let bb = dtype.block_bytes();
        let mut w: Vec<u8> = (0..rows * blocks * bb).map(|_| fill.unwrap_or(next(seed) as u8)).collect();
        let f16_at: &[usize] = match dtype {
            DType::Q4_0 | DType::Q5_0 | DType::Q8_0 => &[0],
            DType::Q4_1 | DType::Q5_1 => &[0, 2],
            _ => f16_field_offsets(dtype),
        };
        for blk in w.chunks_exact_mut(bb) {
            for &off in f16_at {
                let v = if fill.is_some() { half::f16::from_f32(0.5) } else { finite_f16(seed) };
                blk[off..off + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        w
    }

    /// Activation rows of mixed magnitudes: a zero row part, ±1 only (every
    /// value quantizing to ±127), tiny and large values.
    fn activations(seed: &mut u64, n: usize, cols: usize) -> Vec<f32> {
        (0..n * cols)
            .map(|i| {
                let u = (next(seed) >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
                match (i / 32) % 6 {
                    1 => 0.0,
                    3 => u.signum(),
                    4 => u * 1e-3,
                    5 => u * 40.0,
                    _ => u,
                }
            })
            .collect()
    }

    /// Every output of the panel matmul equals the bits of the scalar
    /// reference dot, or for the types whose AVX2 kernels follow ggml's float
    /// order (Q4_0, Q4_1, Q8_0) those kernels' bits.
    fn check(dtype: DType, rows: usize, cols: usize, n: usize, seed: &mut u64, fill: Option<u8>, start: u64) {
        let w = weights(seed, dtype, rows, cols / dtype.block_len(), fill);
        let x = activations(seed, n, cols);
        let rb = w.len() / rows;
        let mut out = vec![f32::NAN; n * rows];
        let optr = OutPtr::new(&mut out);
        if dtype.is_k_quant() {
            let blocks = cols / QK_K;
            let mut xq = vec![Q8KBlock::ZERO; n * blocks];
            for (q, row) in xq.chunks_mut(blocks).zip(x.chunks(cols)) {
                q8k::quantize_row(row, q);
            }
            matmul_k(dtype, &w, rows, blocks, &xq, n, optr);
            for t in 0..n {
                for r in 0..rows {
                    let want = q8k::dot_scalar(dtype, &w[r * rb..(r + 1) * rb], &xq[t * blocks..(t + 1) * blocks]);
                    let got = out[t * rows + r];
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{dtype:?} {rows}x{cols} n {n} ({t},{r}): {got} vs {want}, seed {start}"
                    );
                }
            }
        } else {
            let blocks = cols / 32;
            let mut xq = vec![Q8Block::ZERO; n * blocks];
            for (q, row) in xq.chunks_mut(blocks).zip(x.chunks(cols)) {
                q8::quantize_row_scalar(row, q);
            }
            matmul_b32(dtype, &w, rows, blocks, &xq, n, optr);
            for t in 0..n {
                for r in 0..rows {
                    let (wr, xr) = (&w[r * rb..(r + 1) * rb], &xq[t * blocks..(t + 1) * blocks]);
                    // Q4_0, Q4_1 and Q8_0 follow the AVX2 kernels' (ggml's) order, the rest the scalar dot's.
                    let want = if b32_layout(dtype).ggml_order {
                        q8::dot_tile::<1, 1>(dtype, [wr], [xr])[0][0]
                    } else {
                        q8::dot(dtype, wr, xr)
                    };
                    let got = out[t * rows + r];
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{dtype:?} {rows}x{cols} n {n} ({t},{r}): {got} vs {want}, seed {start}"
                    );
                }
            }
        }
    }

    const TYPES: [DType; 7] =
        [DType::Q5_0, DType::Q5_1, DType::Q2_K, DType::Q3_K, DType::Q4_K, DType::Q5_K, DType::Q6_K];

    /// Partial panels (rows not a multiple of 16), every remainder of the
    /// 4-row activation groups, one and several blocks.
    #[test]
    fn random_panels_match_scalar_bit_for_bit() {
        if !avx512_vnni_or_skip() {
            return;
        }
        let mut seed = fresh_seed("panel_vnni");
        let start = seed;
        for dtype in TYPES {
            let unit = dtype.block_len().max(256);
            for (rows, cols, n) in [(37, unit, 7), (16, 2 * unit, 4), (5, 3 * unit, 6), (48, unit, 1)] {
                check(dtype, rows, cols, n, &mut seed, None, start);
            }
        }
    }

    /// Saturated levels and scales against ±127 activations: the largest
    /// integer sums the kernels form.
    #[test]
    fn extreme_panels_match_scalar_bit_for_bit() {
        if !avx512_vnni_or_skip() {
            return;
        }
        let mut seed = 1;
        for dtype in TYPES {
            for byte in [0x00u8, 0xff, 0x80, 0x7f, 0x55, 0xaa] {
                check(dtype, 19, 512, 5, &mut seed, Some(byte), 0);
            }
        }
    }
}
