//! Image preprocessing against transformers' Qwen2VL image processor (the
//! one Qwen3.5 checkpoints name), on the images and processor settings of
//! `scripts/make_fixtures_vision.py`: the same grid, the same pixel values;
//! and decoding against Pillow's (`scripts/make_fixtures_decode.py`).

use std::path::PathBuf;

use qinfer::image::{ImageLimits, ImageProcessorConfig, decode_rgb, prepare};
use serde_json::Value;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/vision")
}

#[test]
fn pixel_values_and_grids_equal_the_processors() {
    let cfg = ImageProcessorConfig::from_file(&dir().join("qwen3_5/preprocessor_config.json")).unwrap();
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(dir().join("images/reference.json")).unwrap()).unwrap();
    let grids = reference["grids"].as_object().unwrap();
    assert_eq!(grids.len(), 5);
    for (name, grid) in grids {
        let bytes = std::fs::read(dir().join("images").join(name)).unwrap();
        let img = prepare(&bytes, &cfg, &ImageLimits::default()).unwrap();
        let want: Vec<usize> = grid.as_array().unwrap().iter().map(|g| g.as_u64().unwrap() as usize).collect();
        assert_eq!(img.grid.to_vec(), want, "{name}: grid");
        let stem = name.split('.').next().unwrap();
        let (shape, pixels) = qinfer::npy::read_f32(&dir().join(format!("images/{stem}.pixels.npy"))).unwrap();
        assert_eq!(shape, vec![img.patches(), cfg.patch_values()], "{name}: shape");
        let diff = pixels.iter().zip(&img.pixels).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(diff < 1e-6, "{name}: pixel values differ by up to {diff}");
    }
}

/// JPEGs of every chroma layout Pillow writes, and JPEG, PNG and WebP files
/// with an EXIF orientation, decode to the pixels transformers'
/// `load_image` reads (`scripts/make_fixtures_decode.py`) exactly; a
/// damaged JPEG is refused.
#[test]
fn images_decode_to_pillows_pixels() {
    let jpeg = dir().join("decode");
    let files = ["s420.jpg", "s422.jpg", "s444.jpg", "progressive.jpg", "gray.jpg"];
    let oriented = ["exif6.jpg", "exif3.jpg", "exif5.jpg", "exif8.png", "exif2.webp"];
    for name in files.iter().chain(&oriented) {
        let (rgb, w, h) = decode_rgb(&std::fs::read(jpeg.join(name)).unwrap()).unwrap();
        let stem = name.split('.').next().unwrap();
        let (shape, want) = qinfer::npy::read_f32(&jpeg.join(format!("{stem}.rgb.npy"))).unwrap();
        assert_eq!(shape, vec![h, w, 3], "{name}");
        let got: Vec<f32> = rgb.iter().map(|&v| v as f32).collect();
        assert_eq!(got, want, "{name}");
    }
    let mut bytes = std::fs::read(jpeg.join("s420.jpg")).unwrap();
    bytes.truncate(300);
    let err = decode_rgb(&bytes).unwrap_err().to_string();
    assert!(err.contains("cannot decode the JPEG image"), "{err}");
}

#[test]
fn undecodable_and_oversized_images_are_refused_by_name() {
    let cfg = ImageProcessorConfig::from_file(&dir().join("qwen3_5/preprocessor_config.json")).unwrap();
    let err = prepare(b"not an image", &cfg, &ImageLimits::default()).unwrap_err().to_string();
    assert!(err.contains("cannot decode the image"), "{err}");
    let bytes = std::fs::read(dir().join("images/e.png")).unwrap();
    let err = prepare(&bytes, &cfg, &ImageLimits { max_source_pixels: 1000 }).unwrap_err().to_string();
    assert!(err.contains("130×90") && err.contains("1000 pixels"), "{err}");
}
