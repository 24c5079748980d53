//! Images in, as Qwen's vision processor prepares them (transformers'
//! `Qwen2VLImageProcessor`, which Qwen3-VL and Qwen3.5 checkpoints name):
//! decoded (JPEG, PNG, WebP), transparency composited onto white, resized
//! so both sides are multiples of `patch_size · merge_size` with the pixel
//! count inside the configured bounds (`smart_resize`), Pillow's bicubic,
//! rescaled and normalized, then cut into patches in the order the vision
//! tower consumes them (merge blocks of `merge_size²` patches, each patch
//! `channels × temporal_patch_size × patch_size²` values, the one frame
//! repeated over the temporal patch).

mod resample;

use std::path::Path;

use ::image::metadata::Orientation;
use ::image::{DynamicImage, ImageDecoder};

use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::{Error, Result};

pub use resample::resize_bicubic;

/// The processor's settings (`preprocessor_config.json`).
#[derive(Debug, Clone, PartialEq)]
pub struct ImageProcessorConfig {
    pub patch_size: usize,
    pub temporal_patch_size: usize,
    pub merge_size: usize,
    /// Pixel-count bounds of the resized image.
    pub min_pixels: usize,
    pub max_pixels: usize,
    pub image_mean: [f32; 3],
    pub image_std: [f32; 3],
    pub rescale_factor: f64,
    pub do_resize: bool,
    pub do_rescale: bool,
    pub do_normalize: bool,
}

impl Default for ImageProcessorConfig {
    /// Qwen3-VL / Qwen3.5's published processor settings.
    fn default() -> Self {
        ImageProcessorConfig {
            patch_size: 16,
            temporal_patch_size: 2,
            merge_size: 2,
            min_pixels: 65_536,
            max_pixels: 16_777_216,
            image_mean: [0.5; 3],
            image_std: [0.5; 3],
            rescale_factor: 1.0 / 255.0,
            do_resize: true,
            do_rescale: true,
            do_normalize: true,
        }
    }
}

/// Bicubic: the only resampling filter Qwen's processors use.
const BICUBIC: u64 = 3;

impl ImageProcessorConfig {
    /// Reads `preprocessor_config.json`; fields it leaves out keep
    /// transformers' defaults for this processor.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let v: Value = serde_json::from_str(&text).map_err(|e| Error::malformed(path, e.to_string()))?;
        Self::from_json(&v).map_err(|e| Error::malformed(path, e.to_string()))
    }

    pub fn from_json(v: &Value) -> Result<Self> {
        let d = ImageProcessorConfig::default();
        let uint = |key: &str, default: usize| -> Result<usize> {
            match v.get(key) {
                None | Some(Value::Null) => Ok(default),
                Some(x) => x
                    .as_u64()
                    .filter(|&n| n > 0)
                    .map(|n| n as usize)
                    .ok_or_else(|| Error::config(key, format!("expected a positive integer, found {x}"))),
            }
        };
        let flag = |key: &str, default: bool| -> Result<bool> {
            match v.get(key) {
                None | Some(Value::Null) => Ok(default),
                Some(x) => x.as_bool().ok_or_else(|| Error::config(key, format!("expected true or false, found {x}"))),
            }
        };
        let triple = |key: &str, default: [f32; 3]| -> Result<[f32; 3]> {
            match v.get(key) {
                None | Some(Value::Null) => Ok(default),
                Some(Value::Number(n)) => Ok([n.as_f64().unwrap_or(0.0) as f32; 3]),
                Some(Value::Array(a)) if a.len() == 3 && a.iter().all(Value::is_number) => {
                    Ok([0, 1, 2].map(|i| a[i].as_f64().unwrap_or(0.0) as f32))
                }
                Some(x) => Err(Error::config(key, format!("expected three numbers, found {x}"))),
            }
        };
        let size = v.get("size");
        let bound = |size_key: &str, legacy: &str, default: usize| -> Result<usize> {
            match size.and_then(|s| s.get(size_key)) {
                Some(x) => x.as_u64().map(|n| n as usize).ok_or_else(|| {
                    Error::config(format!("size.{size_key}"), format!("expected an integer, found {x}"))
                }),
                None => uint(legacy, default),
            }
        };
        if let Some(r) = v.get("resample").filter(|r| !r.is_null())
            && r.as_u64() != Some(BICUBIC)
        {
            return Err(Error::config("resample", format!("{r} is not supported (Qwen's processors use 3, bicubic)")));
        }
        let c = ImageProcessorConfig {
            patch_size: uint("patch_size", d.patch_size)?,
            temporal_patch_size: uint("temporal_patch_size", d.temporal_patch_size)?,
            merge_size: uint("merge_size", d.merge_size)?,
            min_pixels: bound("shortest_edge", "min_pixels", d.min_pixels)?,
            max_pixels: bound("longest_edge", "max_pixels", d.max_pixels)?,
            image_mean: triple("image_mean", d.image_mean)?,
            image_std: triple("image_std", d.image_std)?,
            rescale_factor: v.get("rescale_factor").and_then(Value::as_f64).unwrap_or(d.rescale_factor),
            do_resize: flag("do_resize", true)?,
            do_rescale: flag("do_rescale", true)?,
            do_normalize: flag("do_normalize", true)?,
        };
        if c.min_pixels > c.max_pixels {
            return Err(Error::config(
                "size",
                format!("min pixels {} exceed max pixels {}", c.min_pixels, c.max_pixels),
            ));
        }
        Ok(c)
    }

    /// Values per patch: channels × temporal patch × patch².
    pub fn patch_values(&self) -> usize {
        3 * self.temporal_patch_size * self.patch_size * self.patch_size
    }

    /// The resized (height, width) of an `h × w` image: both multiples of
    /// `patch_size · merge_size`, the aspect ratio kept as closely as
    /// possible, the pixel count within bounds (transformers' `smart_resize`,
    /// Python's round-half-to-even included).
    pub fn smart_resize(&self, h: usize, w: usize) -> Result<(usize, usize)> {
        let factor = (self.patch_size * self.merge_size) as f64;
        let (hf, wf) = (h as f64, w as f64);
        if h == 0 || w == 0 {
            return Err(Error::Invalid(format!("image of {w}×{h} pixels is empty")));
        }
        if hf.max(wf) / hf.min(wf) > 200.0 {
            return Err(Error::Invalid(format!("image of {w}×{h} pixels: aspect ratio over 200")));
        }
        let mut hb = (hf / factor).round_ties_even() * factor;
        let mut wb = (wf / factor).round_ties_even() * factor;
        if hb * wb > self.max_pixels as f64 {
            let beta = (hf * wf / self.max_pixels as f64).sqrt();
            hb = factor.max((hf / beta / factor).floor() * factor);
            wb = factor.max((wf / beta / factor).floor() * factor);
        } else if hb * wb < self.min_pixels as f64 {
            let beta = (self.min_pixels as f64 / (hf * wf)).sqrt();
            hb = (hf * beta / factor).ceil() * factor;
            wb = (wf * beta / factor).ceil() * factor;
        }
        Ok((hb as usize, wb as usize))
    }
}

/// An image ready for the vision tower.
#[derive(Debug, Clone, PartialEq)]
pub struct PreparedImage {
    /// `[patches, patch_values]`, patches in merge-block order.
    pub pixels: Vec<f32>,
    /// Patches along time, height and width.
    pub grid: [usize; 3],
    /// SHA-256 of the grid and pixel values: equal images key equal cache entries.
    pub hash: [u8; 32],
}

impl PreparedImage {
    pub fn patches(&self) -> usize {
        self.grid.iter().product()
    }
    /// Tokens it takes in the prompt (each merge block becomes one).
    pub fn tokens(&self, merge_size: usize) -> usize {
        self.patches() / (merge_size * merge_size)
    }
}

/// Decodes an encoded image (JPEG, PNG or WebP) to 8-bit RGB, turned
/// upright by its EXIF orientation as transformers' `load_image` does
/// (Pillow's `exif_transpose`), compositing any transparency onto white as
/// transformers' `convert_to_rgb` does. Returns (pixels, width, height).
pub fn decode_rgb(bytes: &[u8]) -> Result<(Vec<u8>, usize, usize)> {
    if bytes.starts_with(&[0xFF, 0xD8, 0xFF]) {
        let (rgb, w, h, orientation) = decode_jpeg(bytes)?;
        if orientation == Orientation::NoTransforms {
            return Ok((rgb, w, h));
        }
        let mut img =
            DynamicImage::ImageRgb8(::image::RgbImage::from_raw(w as u32, h as u32, rgb).expect("w·h·3 values"));
        img.apply_orientation(orientation);
        let (w, h) = (img.width() as usize, img.height() as usize);
        return Ok((img.into_rgb8().into_raw(), w, h));
    }
    let undecodable = |e: ::image::ImageError| Error::Invalid(format!("cannot decode the image: {e}"));
    let mut decoder = ::image::ImageReader::new(std::io::Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| Error::Invalid(format!("cannot decode the image: {e}")))?
        .into_decoder()
        .map_err(undecodable)?;
    let orientation = decoder.orientation().unwrap_or(Orientation::NoTransforms);
    let mut img = DynamicImage::from_decoder(decoder).map_err(undecodable)?;
    img.apply_orientation(orientation);
    let (w, h) = (img.width() as usize, img.height() as usize);
    if !img.color().has_alpha() {
        return Ok((img.into_rgb8().into_raw(), w, h));
    }
    let rgba = img.into_rgba8().into_raw();
    let rgb = rgba.chunks_exact(4).flat_map(|p| over_white(p[0], p[1], p[2], p[3])).collect();
    Ok((rgb, w, h))
}

/// A JPEG through libjpeg-turbo's decoder (the `mozjpeg` crate builds it),
/// the one Pillow uses: the same integer IDCT and fancy chroma upsampling,
/// so the pixels are Pillow's exactly. libjpeg's fatal errors arrive as
/// panics, caught here into an error naming the problem. Also returns the
/// orientation its EXIF block (APP1) gives.
fn decode_jpeg(bytes: &[u8]) -> Result<(Vec<u8>, usize, usize, Orientation)> {
    let decoded = std::panic::catch_unwind(|| -> std::io::Result<(Vec<u8>, usize, usize, Orientation)> {
        let d = mozjpeg::Decompress::builder().with_markers(&[mozjpeg::Marker::APP(1)]).from_mem(bytes)?;
        let orientation = (d.markers())
            .find_map(|m| m.data.strip_prefix(b"Exif\0\0").and_then(Orientation::from_exif_chunk))
            .unwrap_or(Orientation::NoTransforms);
        let mut img = d.rgb()?;
        let (w, h) = (img.width(), img.height());
        let rows: Vec<[u8; 3]> = img.read_scanlines()?;
        img.finish()?;
        Ok((rows.into_flattened(), w, h, orientation))
    });
    let why = match decoded {
        Ok(Ok(rgb)) => return Ok(rgb),
        Ok(Err(e)) => e.to_string(),
        Err(panic) => (panic.downcast_ref::<String>().cloned())
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "libjpeg failed".into()),
    };
    Err(Error::Invalid(format!("cannot decode the JPEG image: {why}")))
}

/// Pillow's `alpha_composite` of one pixel over opaque white, in its fixed point.
fn over_white(r: u8, g: u8, b: u8, a: u8) -> [u8; 3] {
    if a == 0 {
        return [255; 3];
    }
    let a = a as u32;
    let blend = |c: u8| {
        // coef1 = a·128, coef2 = (255 − a)·128 when the background is opaque.
        let tmp = (c as u32 * a + 255 * (255 - a)) * 128 + (0x80 << 7);
        ((((tmp >> 8) + tmp) >> 8) >> 7) as u8
    };
    [blend(r), blend(g), blend(b)]
}

/// Limits on images a caller accepts, checked before any resize.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageLimits {
    /// Most pixels of a decoded image (width × height).
    pub max_source_pixels: usize,
}

impl Default for ImageLimits {
    fn default() -> Self {
        ImageLimits { max_source_pixels: 64 << 20 }
    }
}

/// Decodes and prepares one image.
pub fn prepare(bytes: &[u8], cfg: &ImageProcessorConfig, limits: &ImageLimits) -> Result<PreparedImage> {
    let (rgb, w, h) = decode_rgb(bytes)?;
    if w * h > limits.max_source_pixels {
        return Err(Error::Invalid(format!(
            "image of {w}×{h} pixels exceeds the limit of {} pixels",
            limits.max_source_pixels
        )));
    }
    prepare_rgb(&rgb, w, h, cfg)
}

/// Prepares decoded 8-bit RGB pixels (`h × w × 3`).
pub fn prepare_rgb(rgb: &[u8], w: usize, h: usize, cfg: &ImageProcessorConfig) -> Result<PreparedImage> {
    let (rh, rw) = if cfg.do_resize { cfg.smart_resize(h, w)? } else { (h, w) };
    let factor = cfg.patch_size * cfg.merge_size;
    if rh % factor != 0 || rw % factor != 0 {
        return Err(Error::Invalid(format!(
            "image of {w}×{h} pixels is not a multiple of {factor} on each side and resizing is off"
        )));
    }
    let resized = if (rh, rw) == (h, w) { rgb.to_vec() } else { resize_bicubic(rgb, w, h, 3, rw, rh) };
    // Channel-major planes of normalized values.
    let plane = rh * rw;
    let mut chw = vec![0f32; 3 * plane];
    for (i, px) in resized.chunks_exact(3).enumerate() {
        for c in 0..3 {
            let mut v = px[c] as f32;
            if cfg.do_rescale {
                v = (px[c] as f64 * cfg.rescale_factor) as f32;
            }
            if cfg.do_normalize {
                v = (v - cfg.image_mean[c]) / cfg.image_std[c];
            }
            chw[c * plane + i] = v;
        }
    }
    let (p, m, t) = (cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size);
    let (gh, gw) = (rh / p, rw / p);
    let mut pixels = Vec::with_capacity(gh * gw * cfg.patch_values());
    for bh in 0..gh / m {
        for bw in 0..gw / m {
            for ih in 0..m {
                for iw in 0..m {
                    let (y0, x0) = ((bh * m + ih) * p, (bw * m + iw) * p);
                    for c in 0..3 {
                        for _ in 0..t {
                            for y in y0..y0 + p {
                                let row = c * plane + y * rw;
                                pixels.extend_from_slice(&chw[row + x0..row + x0 + p]);
                            }
                        }
                    }
                }
            }
        }
    }
    let grid = [1, gh, gw];
    let mut sha = Sha256::new();
    for g in grid {
        sha.update((g as u64).to_le_bytes());
    }
    sha.update(bytemuck::cast_slice(&pixels));
    Ok(PreparedImage { pixels, grid, hash: sha.finalize().into() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smart_resize_matches_transformers_on_hand_worked_cases() {
        let c = ImageProcessorConfig {
            patch_size: 14,
            merge_size: 2,
            min_pixels: 3136,
            max_pixels: 1_003_520,
            ..Default::default()
        };
        // Values from transformers' smart_resize. 1024×768 stays within bounds: round(768/28)=27 → 756, round(1024/28)=37 (36.57) → 1036.
        assert_eq!(c.smart_resize(768, 1024).unwrap(), (756, 1036));
        // round-half-to-even: 42/28 = 1.5 → 2, 70/28 = 2.5 → 2.
        assert_eq!(c.smart_resize(42, 70).unwrap(), (56, 56));
        assert!(c.smart_resize(10, 2500).is_err());
    }

    #[test]
    fn transparent_pixels_become_white_and_opaque_ones_stay() {
        assert_eq!(over_white(10, 20, 30, 0), [255; 3]);
        assert_eq!(over_white(10, 20, 30, 255), [10, 20, 30]);
    }
}
