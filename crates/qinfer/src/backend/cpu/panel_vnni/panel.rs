//! What the panel kernels of every block type share: the panel buffer, its
//! rows, the prefetch of the next panel, and lane helpers.

use std::arch::x86_64::*;
use std::cell::RefCell;

/// Weight rows per panel: one i32 lane each in a 512-bit register.
pub(super) const LANES: usize = 16;

/// Activation rows per pass over a panel's blocks: each loaded weight
/// register serves this many rows.
pub(super) const MR: usize = 4;

/// Whether this module's kernels may run: AVX-512 F, BW, VL and VNNI present and
/// allowed by the CPU kernel limit.
pub(crate) fn available() -> bool {
    super::super::simd::has_avx512_vnni()
}

/// One panel, unpacked. `levels[k·16 + j]` holds values 4k..4k+4 of row j as
/// unsigned bytes; per block (or super-block) `b`, `d`/`m` hold each row's
/// float scale and min scale (`dmin` for K-quants, 0 where the type has
/// none); per scale group `g` of the K-quants, `scales` holds each row's
/// integer scale and `aux` its min (Q2_K, Q4_K, Q5_K) or offset × scale
/// (Q3_K, Q6_K), the latter as i16 pairs of adjacent 16-value groups.
#[derive(Default)]
pub(super) struct Panel {
    pub(super) levels: Vec<u32>,
    pub(super) d: Vec<f32>,
    pub(super) m: Vec<f32>,
    pub(super) scales: Vec<i32>,
    pub(super) aux: Vec<u32>,
}

thread_local! {
    pub(super) static PANEL: RefCell<Panel> = RefCell::new(Panel::default());
}

/// Weight rows a thread will most likely read next (rayon hands each
/// thread a run of consecutive panels), to be brought into L2 while it
/// computes. Reading a panel walks its 16 rows side by side, 16 strided
/// streams the hardware prefetchers do not follow well, so without this
/// the unpack waits on memory that the arithmetic before it could have
/// covered. The requests are spread over that arithmetic: all at once, they
/// fill the core's miss buffers and the thread stalls on them instead.
#[derive(Clone, Copy)]
pub(super) struct Ahead<'a> {
    pub(super) span: &'a [u8],
}

impl<'a> Ahead<'a> {
    pub(super) const NONE: Ahead<'static> = Ahead { span: &[] };

    /// Rows `r0..r0 + 16` (those below `rows`) of a matrix of `rb`-byte rows.
    pub(super) fn rows(bytes: &'a [u8], rb: usize, r0: usize, rows: usize) -> Ahead<'a> {
        if r0 >= rows {
            return Ahead { span: &[] };
        }
        Ahead { span: &bytes[r0 * rb..(r0 + LANES).min(rows) * rb] }
    }

    /// Lines to request per step so that `steps` steps cover the span.
    pub(super) fn per_step(self, steps: usize) -> usize {
        self.span.len().div_ceil(64).div_ceil(steps.max(1))
    }

    /// Requests step `i`'s `per` lines (of [`Ahead::per_step`]).
    #[inline(always)]
    pub(super) fn step(self, i: usize, per: usize) {
        let lines = self.span.len().div_ceil(64);
        for l in (i * per).min(lines)..((i + 1) * per).min(lines) {
            // SAFETY: prefetching has no architectural effect; the address is in bounds.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(self.span.as_ptr().add(l * 64).cast()) };
        }
    }

    /// Requests the whole span at once.
    pub(super) fn all(self) {
        self.step(0, self.per_step(1));
    }
}

/// Reads the weight row `j` of a panel, or none past the matrix's last row.
pub(super) struct Rows<'a> {
    pub(super) bytes: &'a [u8],
    pub(super) rb: usize,
    pub(super) r0: usize,
    pub(super) count: usize,
}

impl Rows<'_> {
    pub(super) fn row(&self, j: usize) -> Option<&[u8]> {
        (j < self.count).then(|| &self.bytes[(self.r0 + j) * self.rb..(self.r0 + j + 1) * self.rb])
    }
}

/// Broadcasts the 4 activation bytes at `p` to every lane.
///
/// # Safety
/// `p` points at 4 readable bytes.
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn splat4(p: *const i8) -> __m512i {
    // SAFETY: the caller guarantees 4 readable bytes.
    _mm512_set1_epi32(unsafe { p.cast::<i32>().read_unaligned() })
}

/// Stores lanes `0..count` of `v` at `p`.
///
/// # Safety
/// `p` points at `count` (≤ 16) writable floats.
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn store_lanes(p: *mut f32, v: __m512, count: usize) {
    let mask: __mmask16 = if count >= LANES { 0xffff } else { (1u16 << count) - 1 };
    // SAFETY: the caller guarantees `count` writable floats; masked lanes are not touched.
    unsafe { _mm512_mask_storeu_ps(p, mask, v) };
}
