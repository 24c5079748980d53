//! Stored tensors: a dtype, a shape and bytes that stay where the file put them
//! (usually an mmap), so weights are never copied or widened on load.

use std::sync::Arc;

pub use crate::quant::dtype::DType;
use crate::{Error, Result};

/// Bytes owned by something that keeps them alive (an mmap, a Vec).
#[derive(Clone)]
pub struct Bytes {
    owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
    start: usize,
    len: usize,
}

impl Bytes {
    pub fn new(owner: Arc<dyn AsRef<[u8]> + Send + Sync>, start: usize, len: usize) -> Self {
        debug_assert!(start + len <= (*owner).as_ref().len());
        Bytes { owner, start, len }
    }
    pub fn from_vec(v: Vec<u8>) -> Self {
        let len = v.len();
        Bytes { owner: Arc::new(v), start: 0, len }
    }
    pub fn as_slice(&self) -> &[u8] {
        &(*self.owner).as_ref()[self.start..self.start + self.len]
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// A sub-range sharing the same owner (no copy).
    pub fn slice(&self, start: usize, len: usize) -> Bytes {
        assert!(start + len <= self.len, "Bytes::slice out of range");
        Bytes { owner: self.owner.clone(), start: self.start + start, len }
    }
}

impl std::fmt::Debug for Bytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Bytes({} bytes)", self.len)
    }
}

/// A named tensor as stored: shape in row-major order, outermost first
/// (a linear weight is `[out_features, in_features]`).
#[derive(Debug, Clone)]
pub struct Tensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub data: Bytes,
}

impl Tensor {
    /// Checks that the byte length matches the shape and dtype.
    pub fn new(name: String, dtype: DType, shape: Vec<usize>, data: Bytes) -> Result<Self> {
        let n: usize = shape.iter().product();
        let inner = shape.last().copied().unwrap_or(1);
        if !inner.is_multiple_of(dtype.block_len()) {
            return Err(Error::tensor(
                &name,
                format!("row length {inner} is not a multiple of the {} block ({})", dtype.name(), dtype.block_len()),
            ));
        }
        let need = dtype.bytes_for(n).ok_or_else(|| Error::tensor(&name, "size overflow"))?;
        if need != data.len() {
            return Err(Error::tensor(
                &name,
                format!("{} {:?} needs {need} bytes, found {}", dtype.name(), shape, data.len()),
            ));
        }
        Ok(Tensor { name, dtype, shape, data })
    }
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// An f32 tensor holding `values`.
    pub fn from_f32(name: &str, shape: Vec<usize>, values: &[f32]) -> Result<Self> {
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Tensor::new(name.to_string(), DType::F32, shape, Bytes::from_vec(bytes))
    }
    /// The same bytes viewed with another shape of equal size and row length
    /// compatible with the block size.
    pub fn reshape(&self, shape: Vec<usize>) -> Result<Self> {
        if shape.iter().product::<usize>() != self.numel() {
            return Err(Error::tensor(&self.name, format!("cannot view {:?} as {shape:?}", self.shape)));
        }
        Tensor::new(self.name.clone(), self.dtype, shape, self.data.clone())
    }
    /// Entries `[start, start + len)` along the outermost dimension (no copy):
    /// one expert of a stacked `[E, …]` tensor, or a block of a matrix's rows.
    pub fn narrow(&self, start: usize, len: usize) -> Result<Self> {
        let outer = *self.shape.first().ok_or_else(|| Error::tensor(&self.name, "cannot narrow a scalar"))?;
        if start + len > outer {
            return Err(Error::tensor(&self.name, format!("rows {start}..{} out of range of {outer}", start + len)));
        }
        let per: usize = self.shape[1..].iter().product();
        let bytes_per = self.dtype.bytes_for(per).ok_or_else(|| Error::tensor(&self.name, "size overflow"))?;
        let mut shape = self.shape.clone();
        shape[0] = len;
        Tensor::new(self.name.clone(), self.dtype, shape, self.data.slice(start * bytes_per, len * bytes_per))
    }
    /// Matrices (or vectors) of one dtype and row length stacked along the
    /// outermost dimension into a new tensor named `name`: projections that
    /// one matmul computes together. `None` when their dtypes or row shapes
    /// differ.
    pub fn concat_rows(name: &str, parts: &[&Tensor]) -> Result<Option<Tensor>> {
        let Some(first) = parts.first() else { return Ok(None) };
        let alike = |t: &&Tensor| {
            t.dtype == first.dtype && t.shape.len() == first.shape.len() && t.shape[1..] == first.shape[1..]
        };
        if first.shape.is_empty() || !parts.iter().all(alike) {
            return Ok(None);
        }
        let mut data = Vec::with_capacity(parts.iter().map(|t| t.data.len()).sum());
        for t in parts {
            data.extend_from_slice(t.data.as_slice());
        }
        let mut shape = first.shape.clone();
        shape[0] = parts.iter().map(|t| t.shape[0]).sum();
        Tensor::new(name.to_string(), first.dtype, shape, Bytes::from_vec(data)).map(Some)
    }
    /// Decodes every value to f32 (for small tensors: norms, biases).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.numel()];
        crate::quant::ggml::dequantize_into(self.dtype, self.data.as_slice(), &mut out);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matrix(name: &str, dtype: DType, rows: usize, cols: usize, seed: u8) -> Tensor {
        let n = dtype.bytes_for(rows * cols).unwrap();
        Tensor::new(name.into(), dtype, vec![rows, cols], Bytes::from_vec((0..n).map(|i| i as u8 ^ seed).collect()))
            .unwrap()
    }

    #[test]
    fn concat_rows_stacks_alike_matrices_and_refuses_others() {
        for dtype in [DType::BF16, DType::F32, DType::Q4_K, DType::Q8_0] {
            let cols = 256;
            let (a, b, c) =
                (matrix("q", dtype, 4, cols, 1), matrix("k", dtype, 2, cols, 2), matrix("v", dtype, 3, cols, 3));
            let s = Tensor::concat_rows("qkv", &[&a, &b, &c]).unwrap().expect("alike matrices stack");
            assert_eq!((s.dtype, s.shape.clone()), (dtype, vec![9, cols]));
            assert_eq!(s.data.as_slice(), [a.data.as_slice(), b.data.as_slice(), c.data.as_slice()].concat());
            // Rows 4..6 of the stack are k.
            assert_eq!(s.narrow(4, 2).unwrap().data.as_slice(), b.data.as_slice());
        }
        let a = matrix("a", DType::BF16, 2, 64, 0);
        assert!(Tensor::concat_rows("x", &[&a, &matrix("b", DType::F16, 2, 64, 0)]).unwrap().is_none());
        assert!(Tensor::concat_rows("x", &[&a, &matrix("b", DType::BF16, 2, 32, 0)]).unwrap().is_none());
        assert!(Tensor::concat_rows("x", &[]).unwrap().is_none());
    }
}
