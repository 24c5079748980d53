//! NumPy `.npy` (format 1.0) for float32 matrices: written by `qinfer score`,
//! read by tests that compare against reference logits.

use std::io::Write;
use std::path::Path;

use crate::{Error, Result};

/// Writes `data` as a C-order float32 array of `shape`. Writes to a sibling
/// temporary file and renames, so a failed write never leaves a partial file.
pub fn write_f32(path: &Path, shape: &[usize], data: &[f32]) -> Result<()> {
    assert_eq!(shape.iter().product::<usize>(), data.len(), "npy shape does not match data");
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_str = if dims.len() == 1 { format!("({},)", dims[0]) } else { format!("({})", dims.join(", ")) };
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape_str}, }}");
    // Pad so that data starts at a multiple of 64 bytes, ending in '\n'.
    let unpadded = 10 + header.len() + 1;
    header.push_str(&" ".repeat((64 - unpadded % 64) % 64));
    header.push('\n');
    let mut bytes = Vec::with_capacity(10 + header.len() + data.len() * 4);
    bytes.extend_from_slice(b"\x93NUMPY\x01\x00");
    bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
    bytes.extend_from_slice(header.as_bytes());
    for x in data {
        bytes.extend_from_slice(&x.to_le_bytes());
    }
    let tmp = path.with_extension("npy.part");
    let mut f = std::fs::File::create(&tmp).map_err(|e| Error::io(&tmp, e))?;
    f.write_all(&bytes).and_then(|_| f.sync_all()).map_err(|e| Error::io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))
}

/// Reads a little-endian float32 (or float64, converted) C-order array: (shape, data).
pub fn read_f32(path: &Path) -> Result<(Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    let bad = |r: &str| Error::malformed(path, r.to_string());
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err(bad("not a .npy file"));
    }
    let (hlen, hstart) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 if bytes.len() >= 12 => (u32::from_le_bytes(bytes[8..12].try_into().unwrap()) as usize, 12),
        v => return Err(bad(&format!("unsupported npy version {v}"))),
    };
    let header = std::str::from_utf8(bytes.get(hstart..hstart + hlen).ok_or_else(|| bad("truncated header"))?)
        .map_err(|_| bad("header is not UTF-8"))?;
    let elem = if header.contains("'<f4'") {
        4
    } else if header.contains("'<f8'") {
        8
    } else {
        return Err(bad("expected little-endian float32 or float64"));
    };
    if header.contains("'fortran_order': True") {
        return Err(bad("fortran order not supported"));
    }
    let s = header.find("'shape': (").ok_or_else(|| bad("no shape"))? + 10;
    let e = s + header[s..].find(')').ok_or_else(|| bad("bad shape"))?;
    let shape: Vec<usize> = header[s..e]
        .split(',')
        .map(str::trim)
        .filter(|x| !x.is_empty())
        .map(|x| x.parse().map_err(|_| bad("bad shape")))
        .collect::<Result<_>>()?;
    let n: usize = shape.iter().product();
    let body = &bytes[hstart + hlen..];
    if body.len() != n * elem {
        return Err(bad(&format!("expected {} data bytes, found {}", n * elem, body.len())));
    }
    let data = if elem == 4 {
        body.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
    } else {
        body.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap()) as f32).collect()
    };
    Ok((shape, data))
}

#[cfg(test)]
mod tests {
    #[test]
    fn round_trip() {
        let dir = std::env::temp_dir().join(format!("qinfer-npy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("a.npy");
        let data: Vec<f32> = (0..12).map(|i| i as f32 * 0.5 - 1.0).collect();
        super::write_f32(&p, &[3, 4], &data).unwrap();
        let (shape, back) = super::read_f32(&p).unwrap();
        assert_eq!(shape, vec![3, 4]);
        assert_eq!(back, data);
        std::fs::remove_dir_all(&dir).ok();
    }
}
