"""Image decoding fixtures: small JPEGs of each chroma layout Pillow writes
(4:2:0, 4:2:2, 4:4:4, progressive, grayscale), and JPEG, PNG and WebP
files with an EXIF orientation, with the RGB pixels transformers'
`load_image` reads from each (Pillow: libjpeg-turbo's decoder, then
`exif_transpose`), for tests/vision_preprocess.rs.
Usage: python scripts/make_fixtures_decode.py (Pillow as in
requirements-fixtures.txt)."""

from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

OUT = Path(__file__).resolve().parent.parent / "tests/fixtures/vision/decode"


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(7)
    h, w = 47, 61
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([(x * 4) % 256, (y * 5 + x) % 256, rng.integers(0, 256, (h, w))], -1).astype(np.uint8)
    cases = {
        "s420": dict(subsampling=2, quality=85),
        "s422": dict(subsampling=1, quality=70),
        "s444": dict(subsampling=0, quality=95),
        "progressive": dict(progressive=True, quality=80),
    }
    for name, kw in cases.items():
        Image.fromarray(img).save(OUT / f"{name}.jpg", **kw)
    Image.fromarray(img[..., 1]).save(OUT / "gray.jpg", quality=90)
    names = [f"{n}.jpg" for n in [*cases, "gray"]]
    # EXIF orientations: rotations, a mirror and a transpose.
    for orientation, ext in [(6, "jpg"), (3, "jpg"), (5, "jpg"), (8, "png"), (2, "webp")]:
        exif = Image.Exif()
        exif[0x0112] = orientation
        name = f"exif{orientation}.{ext}"
        kw = {"quality": 90} if ext == "jpg" else {"lossless": True} if ext == "webp" else {}
        Image.fromarray(img).save(OUT / name, exif=exif, **kw)
        names.append(name)
    for name in names:
        rgb = np.asarray(ImageOps.exif_transpose(Image.open(OUT / name)).convert("RGB"))
        np.save(OUT / f"{name.split('.')[0]}.rgb.npy", rgb.astype(np.float32))


if __name__ == "__main__":
    main()
