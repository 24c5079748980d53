//! Pillow's bicubic resize of 8-bit images (`Image.resize(..., BICUBIC)`),
//! which the Qwen vision processors run: a separable convolution whose
//! support widens with the downscale factor (so shrinking is antialiased),
//! each pass rounding to 8 bits through 22-bit fixed-point weights.
//! Reproducing the fixed point and the order of the two passes (not only
//! the filter) is what makes the pixel values equal to the reference's.

use std::ops::Range;

/// Fractional bits of the fixed-point weights (Pillow's `PRECISION_BITS`).
const PRECISION_BITS: u32 = 32 - 8 - 2;

/// Keys' cubic with a = -0.5, Pillow's bicubic filter (support 2).
fn bicubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

/// Per output pixel: the first input pixel it reads and its fixed-point weights.
struct Taps {
    first: Vec<usize>,
    weights: Vec<Vec<i32>>,
}

/// The taps resizing an axis of `in_size` pixels to `out_size`, as Pillow's
/// `precompute_coeffs` and `normalize_coeffs_8bpc` compute them.
fn taps(in_size: usize, out_size: usize) -> Taps {
    let scale = in_size as f64 / out_size as f64;
    let filter_scale = scale.max(1.0);
    let support = 2.0 * filter_scale;
    let mut first = Vec::with_capacity(out_size);
    let mut weights = Vec::with_capacity(out_size);
    // Pillow multiplies by the reciprocal; dividing can differ in the last
    // bit, which could flip a rounded fixed-point weight.
    let inv_filter_scale = 1.0 / filter_scale;
    for xx in 0..out_size {
        let center = (xx as f64 + 0.5) * scale;
        // C's (int) truncates toward zero; both values are >= -0.5 + ...
        let xmin = ((center - support + 0.5) as i64).max(0) as usize;
        let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
        let w: Vec<f64> = (xmin..xmax).map(|x| bicubic((x as f64 - center + 0.5) * inv_filter_scale)).collect();
        let total: f64 = w.iter().sum();
        let fixed = w
            .iter()
            .map(|&v| {
                let v = if total != 0.0 { v / total } else { v };
                let scaled = v * (1u32 << PRECISION_BITS) as f64;
                if v < 0.0 { (scaled - 0.5) as i32 } else { (scaled + 0.5) as i32 }
            })
            .collect();
        first.push(xmin);
        weights.push(fixed);
    }
    Taps { first, weights }
}

fn clip8(acc: i64) -> u8 {
    if acc >= (1i64 << PRECISION_BITS << 8) {
        255
    } else if acc <= 0 {
        0
    } else {
        (acc >> PRECISION_BITS) as u8
    }
}

/// Whether Pillow runs the vertical pass first (`ImagingResampleInner`):
/// when the height loses more than twice as many pixels as the width, so
/// the horizontal pass has fewer rows to convolve. Each pass rounds to
/// 8 bits, so the order shows in the pixel values.
fn vertical_first(w: usize, h: usize, out_w: usize, out_h: usize) -> bool {
    let (dw, dh) = (w as i64 - out_w as i64, h as i64 - out_h as i64);
    dh > 0 && dh > 2 * dw
}

/// Rows `rows` of `src` (`w` pixels of `channels` bytes wide) resized
/// horizontally with `t`: `rows.len()` rows of `t.first.len()` pixels.
fn horizontal(src: &[u8], w: usize, rows: Range<usize>, channels: usize, t: &Taps) -> Vec<u8> {
    let out_w = t.first.len();
    let round = 1i64 << (PRECISION_BITS - 1);
    let mut out = vec![0u8; rows.len() * out_w * channels];
    for (y, out_row) in rows.zip(out.chunks_exact_mut(out_w * channels)) {
        let row = &src[y * w * channels..(y + 1) * w * channels];
        for xx in 0..out_w {
            let (x0, k) = (t.first[xx], &t.weights[xx]);
            for c in 0..channels {
                let mut acc = round;
                for (i, &kv) in k.iter().enumerate() {
                    acc += row[(x0 + i) * channels + c] as i64 * kv as i64;
                }
                out_row[xx * channels + c] = clip8(acc);
            }
        }
    }
    out
}

/// `src` (`w` pixels of `channels` bytes wide, holding the input rows from
/// `row_offset` on) resized vertically with `t`.
fn vertical(src: &[u8], w: usize, channels: usize, t: &Taps, row_offset: usize) -> Vec<u8> {
    let round = 1i64 << (PRECISION_BITS - 1);
    let stride = w * channels;
    let mut out = vec![0u8; t.first.len() * stride];
    for (yy, out_row) in out.chunks_exact_mut(stride).enumerate() {
        let (y0, k) = (t.first[yy] - row_offset, &t.weights[yy]);
        for (x, o) in out_row.iter_mut().enumerate() {
            let mut acc = round;
            for (i, &kv) in k.iter().enumerate() {
                acc += src[(y0 + i) * stride + x] as i64 * kv as i64;
            }
            *o = clip8(acc);
        }
    }
    out
}

/// `src` (`h × w` pixels of `channels` bytes, row-major) resized to
/// `out_h × out_w`.
pub fn resize_bicubic(src: &[u8], w: usize, h: usize, channels: usize, out_w: usize, out_h: usize) -> Vec<u8> {
    assert_eq!(src.len(), w * h * channels);
    if vertical_first(w, h, out_w, out_h) {
        // The height shrinks here, so the vertical pass always runs.
        let mid = vertical(src, w, channels, &taps(h, out_h), 0);
        return if out_w != w { horizontal(&mid, w, 0..out_h, channels, &taps(w, out_w)) } else { mid };
    }
    // Horizontal pass over only the rows the vertical pass reads.
    let vert = (out_h != h).then(|| taps(h, out_h));
    let rows = match &vert {
        Some(t) => t.first[0]..t.first[out_h - 1] + t.weights[out_h - 1].len(),
        None => 0..h,
    };
    let tmp: Vec<u8>;
    let (mid, mid_w): (&[u8], usize) = if out_w != w {
        tmp = horizontal(src, w, rows.clone(), channels, &taps(w, out_w));
        (&tmp, out_w)
    } else {
        (&src[rows.start * w * channels..rows.end * w * channels], w)
    };
    match vert {
        Some(t) => vertical(mid, mid_w, channels, &t, rows.start),
        None => mid.to_vec(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_of_each_output_pixel_sum_to_one_in_fixed_point() {
        for (i, o) in [(45, 48), (90, 48), (12, 16), (130, 72), (7, 7)] {
            let t = taps(i, o);
            for k in &t.weights {
                let sum: i64 = k.iter().map(|&v| v as i64).sum();
                assert!((sum - (1 << PRECISION_BITS)).abs() <= k.len() as i64, "{i}->{o}: {sum}");
            }
        }
    }

    #[test]
    fn pass_order_follows_pillow() {
        // (w, h, out_w, out_h) checked against Pillow 13's output.
        for (w, h, ow, oh) in [(70, 50, 72, 48), (20, 20, 30, 10), (40, 40, 39, 20), (30, 60, 60, 30)] {
            assert!(vertical_first(w, h, ow, oh), "{w}x{h}->{ow}x{oh}");
        }
        for (w, h, ow, oh) in [(130, 90, 72, 48), (50, 70, 48, 72), (40, 40, 20, 39), (60, 30, 30, 60), (7, 7, 7, 7)] {
            assert!(!vertical_first(w, h, ow, oh), "{w}x{h}->{ow}x{oh}");
        }
    }

    #[test]
    fn a_constant_image_stays_constant() {
        let src = vec![77u8; 13 * 9 * 3];
        let out = resize_bicubic(&src, 13, 9, 3, 24, 5);
        assert!(out.iter().all(|&v| v == 77));
    }
}
