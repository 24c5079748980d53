//! Device-side data of the CUDA backend: activations, weights, KV cache and
//! Gated DeltaNet state.

use std::collections::HashMap;
use std::mem::ManuallyDrop;
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaSlice, CudaStream, DriverError};

use crate::config::GdnConfig;
use crate::kv::{KvCache, KvPrecision};
use crate::quant::affine::AffineParams;
use crate::tensor::DType;

/// Row-major f32 activations on the device. When dropped, the buffer goes
/// back to its pool (if any) for the next activation of the same length.
pub struct CudaAct {
    pub rows: usize,
    pub cols: usize,
    pub buf: ManuallyDrop<CudaSlice<f32>>,
    /// The same row quantized by the GEMV that wrote it, for the next
    /// tensor-core GEMV to copy instead of quantizing x itself; cleared by
    /// every op that changes the activation in place.
    pub quantized: Option<Box<QuantizedRow>>,
    pool: Option<Arc<BufferPool>>,
}

impl CudaAct {
    pub fn new(rows: usize, cols: usize, buf: CudaSlice<f32>, pool: Option<Arc<BufferPool>>) -> Self {
        CudaAct { rows, cols, buf: ManuallyDrop::new(buf), quantized: None, pool }
    }
}

/// A one-row activation as a tensor-core affine GEMV hands it on
/// (affine_mma.cu's `AmmaRow`): each 16 values times `norm` (the next GEMV's
/// folded RMSNorm weight, 0 for none) as two signed bytes per value, with
/// per 16 values their sum, scale and Σx².
pub struct QuantizedRow {
    pub buf: CudaAct,
    pub norm: u64,
}

impl QuantizedRow {
    /// f32 words of the row of `cols` values: 2 bytes a value, 12 per 16.
    pub fn words(cols: usize) -> usize {
        cols / 2 + cols / 16 * 3
    }
}

impl Drop for CudaAct {
    fn drop(&mut self) {
        // SAFETY: `buf` is not used again after this.
        let buf = unsafe { ManuallyDrop::take(&mut self.buf) };
        if let Some(pool) = &self.pool {
            pool.put(buf);
        }
    }
}

/// Finished activation buffers by length. Decode allocates the same few sizes
/// every token: reusing them saves two driver calls (allocate and free) per op,
/// which on small models cost more than the kernels. Every use is on the one
/// stream, so a buffer handed out again is only written after its earlier
/// readers ran. Bounded, so prefills of many lengths do not hoard memory.
#[derive(Default)]
pub struct BufferPool {
    free: Mutex<FreeBuffers>,
    unbounded: bool,
}

/// Pooled bytes, and the buffers by length.
type FreeBuffers = (usize, HashMap<usize, Vec<CudaSlice<f32>>>);

/// Bytes the pool keeps at most; buffers beyond it go back to the driver.
const POOL_BYTES: usize = 512 << 20;

impl BufferPool {
    /// A pool without the bound: the buffers of one recorded decode step,
    /// which its CUDA graph addresses for as long as it exists.
    pub fn arena() -> Self {
        BufferPool { free: Mutex::new((0, HashMap::new())), unbounded: true }
    }

    pub fn take(&self, len: usize) -> Option<CudaSlice<f32>> {
        let mut free = self.free.lock().ok()?;
        let buf = free.1.get_mut(&len)?.pop()?;
        free.0 -= len * 4;
        Some(buf)
    }

    fn put(&self, buf: CudaSlice<f32>) {
        let Ok(mut free) = self.free.lock() else { return };
        let bytes = buf.len() * 4;
        if self.unbounded || free.0 + bytes <= POOL_BYTES {
            free.0 += bytes;
            free.1.entry(buf.len()).or_default().push(buf);
        }
    }
}

/// A weight on the device: matrices in their stored bytes, vectors as f32.
pub enum CudaWeight {
    Matrix {
        dtype: DType,
        rows: usize,
        cols: usize,
        buf: CudaSlice<u8>,
    },
    /// MLX affine groups: packed levels as stored, scales and biases as f32.
    Affine(AffineWeight),
    /// FP8 (E4M3) bytes as stored, with f32 scales per run of `group` columns.
    Fp8(Fp8Weight),
    Vector(CudaSlice<f32>),
}

/// An FP8 `[rows, cols]` matrix (see [`crate::quant::fp8`]).
pub struct Fp8Weight {
    pub rows: usize,
    pub cols: usize,
    /// Columns per scale.
    pub group: usize,
    /// `rows × cols` E4M3 bytes.
    pub weight: CudaSlice<u8>,
    /// `rows × ⌈cols/group⌉` f32.
    pub scales: CudaSlice<f32>,
}

/// An affine-quantized `[rows, cols]` matrix (see [`crate::quant::affine`]).
pub struct AffineWeight {
    pub params: AffineParams,
    pub rows: usize,
    pub cols: usize,
    /// `rows × cols·bits/8` bytes of u32 words.
    pub packed: CudaSlice<u8>,
    /// As [`AffineSide`] says.
    pub scales: CudaSlice<u8>,
    pub biases: CudaSlice<u8>,
    pub side: AffineSide,
}

/// How an [`AffineWeight`] stores its scales and biases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AffineSide {
    /// `rows × cols/group_size` f32 values each.
    F32,
    /// The same as bf16 (the checkpoint stores both so).
    Bf16,
    /// GGUF K-quants, Q4_K/Q5_K (groups of 32) and Q2_K/Q3_K/Q6_K (groups
    /// of 16): one record per 256 values of a row in `scales`
    /// (formats/gguf/as_affine.rs `superblock_records`: 16, 18 or 20 bytes);
    /// `biases` is not read.
    Records,
}

impl AffineWeight {
    /// Bytes of scales and of biases per row, per `cols` values of it (a
    /// multiple of 256 with records).
    pub fn side_bytes(&self, cols: usize) -> (usize, usize) {
        let groups = cols / self.params.group_size;
        match self.side {
            AffineSide::F32 => (4 * groups, 4 * groups),
            AffineSide::Bf16 => (2 * groups, 2 * groups),
            AffineSide::Records => {
                let record = crate::quant::gguf_affine::superblock_record_bytes(self.params.bits)
                    .expect("records are made for the K-quants only");
                (cols / 256 * record, 0)
            }
        }
    }
}

/// One key and one value buffer per layer, f16 or f32 values
/// ([`KvPrecision`]), allocated at full capacity on the layer's first write
/// (layers without attention never allocate).
#[derive(Default)]
pub struct CudaKv {
    kv_dim: usize,
    capacity: usize,
    len: usize,
    precision: KvPrecision,
    layers: Vec<Option<(CudaSlice<u8>, CudaSlice<u8>)>>,
}

impl CudaKv {
    pub fn new(num_layers: usize, kv_dim: usize, capacity: usize, precision: KvPrecision) -> Self {
        CudaKv { kv_dim, capacity, len: 0, precision, layers: (0..num_layers).map(|_| None).collect() }
    }

    /// How the buffers store keys and values.
    pub fn precision(&self) -> KvPrecision {
        self.precision
    }

    /// Makes room for `rows` rows at positions `[len, len + rows)` of `layer`
    /// (its buffers are allocated at full capacity on first use).
    pub fn reserve(&mut self, stream: &Arc<CudaStream>, layer: usize, rows: usize) -> Result<(), DriverError> {
        assert!(self.len + rows <= self.capacity, "KV cache overflow: {} + {rows} > {}", self.len, self.capacity);
        if self.layers[layer].is_none() {
            let bytes = (self.capacity * self.kv_dim * self.precision.bytes()).max(4);
            self.layers[layer] = Some((stream.alloc_zeros(bytes)?, stream.alloc_zeros(bytes)?));
        }
        Ok(())
    }

    /// The layer's key and value buffers, `[capacity, kv_dim]` values each.
    pub fn layer(&self, layer: usize) -> Option<(&CudaSlice<u8>, &CudaSlice<u8>)> {
        self.layers[layer].as_ref().map(|(k, v)| (k, v))
    }
}

impl KvCache for CudaKv {
    fn len(&self) -> usize {
        self.len
    }
    fn set_len(&mut self, len: usize) {
        assert!(len <= self.capacity);
        self.len = len;
    }
    fn capacity(&self) -> usize {
        self.capacity
    }
}

/// One layer's Gated DeltaNet state for one sequence; cloning copies it on the device.
#[derive(Clone)]
pub struct CudaGdnState {
    pub cfg: GdnConfig,
    /// `[kernel - 1, conv_dim]`, oldest first.
    pub conv: CudaSlice<f32>,
    /// `[num_v_heads, dk, dv]`.
    pub recurrent: CudaSlice<f32>,
}
