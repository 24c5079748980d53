//! The device: opening it and resolving the kernels (with the shared memory
//! and L1 split each may take), the sticky error every op records into,
//! device buffers (activations from a pool, weights uploaded as stored), and
//! the backend's options.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::{Arc, Mutex};

use cudarc::cublas::CudaBlas;
use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{CudaContext, CudaSlice, DevicePtr};

use super::affine::AFFINE_MMA_MAX_SHARED;
use super::attention::{HEAD_DIMS, KV_PRECISIONS};
use super::attention_plan::{decode_whole_keys, decode_whole_shared, flash_bidir_tile, flash_tile, kv_slot};
use super::fp8::FP8_MMA_MAX_SHARED;
use super::gdn::GDN_CHUNK_STATE_SHARED;
use super::kernels::{Kernel, Kernels, module_resolver};
use super::linear::GemvShape;
use super::{
    AffineSide, AffineWeight, BufferPool, CudaAct, CudaBackend, CudaWeight, Fp8Weight, STATIC_SHARED_ROOM, compile,
    moe_prefill, sampling,
};
use crate::kv::KvPrecision;
use crate::tensor::{DType, Tensor};
use crate::{Error, Result};

impl CudaBackend {
    /// True when the CUDA libraries load and at least one device is visible:
    /// callers that may skip GPU work (tests) ask this, then treat any
    /// failure of [`CudaBackend::new`] as an error.
    pub fn available() -> bool {
        // SAFETY: only tries to open the shared libraries.
        let libs = unsafe {
            cudarc::driver::sys::is_culib_present()
                && cudarc::nvrtc::sys::is_culib_present()
                && cudarc::cublas::sys::is_culib_present()
        };
        libs && CudaContext::device_count().map(|n| n > 0).unwrap_or(false)
    }

    /// Opens device `ordinal` and compiles (or loads cached) kernels for it.
    pub fn new(ordinal: usize) -> Result<Self> {
        let err = |what: &str, e: &dyn std::fmt::Display| Error::Invalid(format!("cuda:{ordinal}: {what}: {e}"));
        // cudarc panics on first use of a library it cannot load: look first.
        // SAFETY: only tries to open the shared libraries.
        let present = unsafe {
            [
                ("the CUDA driver (libcuda)", cudarc::driver::sys::is_culib_present()),
                ("NVRTC (libnvrtc)", cudarc::nvrtc::sys::is_culib_present()),
                ("cuBLAS (libcublas)", cudarc::cublas::sys::is_culib_present()),
            ]
        };
        if let Some((lib, _)) = present.iter().find(|(_, ok)| !ok) {
            return Err(Error::Invalid(format!("cuda:{ordinal}: {lib} is not installed or not on the library path")));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| err("cannot open the device", &e))?;
        // One stream: no cross-stream events needed on every launch.
        // SAFETY: called before any allocation on this context.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx.compute_capability().map_err(|e| err("compute capability", &e))?;
        let device_name = ctx.name().map_err(|e| err("device name", &e))?;
        // Hopper's architecture-specific features need the `a` target.
        let suffix = if major >= 9 { "a" } else { "" };
        let arch = format!("compute_{major}{minor}{suffix}");
        let modules = compile::ptx(&arch)?
            .into_iter()
            .zip(compile::UNITS)
            .map(|(ptx, unit)| ctx.load_module(ptx).map_err(|e| err(&format!("loading {}", unit.name), &e)))
            .collect::<Result<Vec<_>>>()?;
        let k = Kernels::load(&mut module_resolver(&modules, ordinal))?;
        // The simple attention kernel keeps one score per key in shared memory:
        // let it use all the device allows per block.
        let max_shared = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .unwrap_or(48 * 1024);
        // What a kernel's dynamic shared memory may take.
        let block_shared = max_shared as usize - STATIC_SHARED_ROOM;
        // Dynamic shared memory beyond the default 48 KB, per kernel.
        let allow_shared = |kernel: &Kernel, bytes: usize, what: &str| {
            kernel
                .function()
                .set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32)
                .map_err(|e| err(what, &e))
        };
        for kv in KV_PRECISIONS {
            allow_shared(k.attention.exact(kv), block_shared, "attention shared memory")?;
        }
        allow_shared(&k.attention.combine, block_shared, "attention combine shared memory")?;
        allow_shared(&k.gdn.chunk_prep, block_shared, "chunked delta rule shared memory")?;
        allow_shared(&k.gdn.chunk_state, GDN_CHUNK_STATE_SHARED.min(block_shared), "chunked delta rule shared memory")?;
        allow_shared(&k.sampling.top_k, sampling::TOP_K_SHARED, "top-k sampling shared memory")?;
        // The tensor-core affine GEMV takes what the device allows up to its
        // own cap; launches needing more take the CUDA-core kernel.
        let affine_mma_max_shared = AFFINE_MMA_MAX_SHARED.min(block_shared);
        // The one-row decode chain of affine models (the tensor-core GEMVs
        // and the decode attention between them) asks for one split of an
        // SM's L1 and shared memory: all of it shared. An SM changes its
        // split only when idle, so a kernel launched to overlap one whose
        // split differs finds no room beside it. With the driver's choice
        // (the least that fits each launch) the 8 blocks of the 8B decode
        // attention held their SMs alone, and as many blocks of the o
        // projection after it started only once it ended. Kernels that read
        // through L1 (the bf16 GEMV takes x from it) keep the driver's
        // choice: all of them at this split made 8B bf16 decode 10% slower.
        let prefer_shared = |kernel: &Kernel| {
            kernel
                .function()
                .set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100)
                .map_err(|e| err(kernel.name(), &e))
        };
        for kernel in k.affine.mma_kernels() {
            allow_shared(kernel, affine_mma_max_shared, "affine GEMV shared memory")?;
            prefer_shared(kernel)?;
        }
        // The 4-bit affine GEMM's blocks, where the device has room for them
        // (affine_gemm4_takes checks the same bound).
        for (kernel, bytes) in k.affine_gemm4.gemms() {
            if bytes <= block_shared {
                allow_shared(kernel, bytes, "4-bit affine GEMM shared memory")?;
            }
        }
        let fp8_mma_max_shared = ((major, minor) >= (8, 9)).then_some(FP8_MMA_MAX_SHARED.min(block_shared));
        if let Some(bytes) = fp8_mma_max_shared {
            for kernel in k.fp8.mma_kernels() {
                allow_shared(kernel, bytes, "FP8 GEMV shared memory")?;
            }
        }
        for kernel in k.moe.grouped_gemms() {
            allow_shared(kernel, moe_prefill::GROUPED_SHARED, "grouped MoE GEMM shared memory")?;
            prefer_shared(kernel)?;
        }
        let sm_count = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| err("multiprocessor count", &e))? as usize;
        // Per head dim, what the device's shared memory allows: the decode
        // attention's rows (else the plain split kernel) and the prefill's
        // tensor-core tiles (else the exact attention kernel).
        let mut decode_whole = [[None; 3]; 2];
        let mut flash = [false; 3];
        for (i, hd) in HEAD_DIMS.into_iter().enumerate() {
            for kv in [KvPrecision::F16, KvPrecision::F32] {
                let whole = decode_whole_keys(hd, max_shared as usize, kv);
                decode_whole[kv_slot(kv)][i] = whole;
                let Some(whole) = whole else { continue };
                for kernel in &k.attention.decode[kv_slot(kv)][i] {
                    prefer_shared(kernel)?;
                    let shared = decode_whole_shared(whole, hd, kv, max_shared as usize);
                    allow_shared(kernel, shared, "decode attention shared memory")?;
                }
            }
            flash[i] = flash_tile(hd).shared <= block_shared;
            if flash[i] {
                allow_shared(&k.attention.flash[i], flash_tile(hd).shared, "flash attention shared memory")?;
                allow_shared(&k.attention.flash_paged[i], flash_tile(hd).shared, "flash attention shared memory")?;
            }
        }
        let mut flash_bidir = [false; 3];
        for (i, hd) in super::vision::BIDIR_HEAD_DIMS.into_iter().enumerate() {
            let shared = flash_bidir_tile(hd).shared;
            flash_bidir[i] = shared <= block_shared;
            if flash_bidir[i] {
                allow_shared(&k.vision.flash_bidir[i], shared, "vision attention shared memory")?;
            }
        }
        // Not the legacy default stream: CUDA graphs cannot be captured from it.
        let stream = ctx.new_stream().map_err(|e| err("creating a stream", &e))?;
        let blas = CudaBlas::new(stream.clone()).map_err(|e| err("cuBLAS", &e))?;
        let step = stream.alloc_zeros::<i32>(2).map_err(|e| err("allocating the step inputs", &e))?;
        let sampling = sampling::SampleScratch::new(&stream).map_err(|e| err("allocating the sampling buffers", &e))?;
        Ok(CudaBackend {
            ordinal,
            device_name,
            stream,
            blas,
            k,
            error: Mutex::new(None),
            poison: false,
            split_activations: false,
            grouped_moe_rows: None,
            fold_split_prologue: true,
            kv_precision: KvPrecision::default(),
            kv_coded: None,
            kv_codecs: Mutex::new(None),
            graphs: true,
            overlap_launches: major >= 9,
            gemv_shape: None,
            replays: Arc::new(AtomicUsize::new(0)),
            max_attention_keys: block_shared / 4,
            decode_whole,
            flash,
            flash_bidir,
            affine_gemm: true,
            affine_gemm4: true,
            affine_mma_max_shared,
            fp8_mma_max_shared,
            max_block_shared: block_shared,
            sm_count,
            rope_tables: Mutex::new(HashMap::new()),
            pool: Arc::new(BufferPool::default()),
            step,
            step_written: Mutex::new(None),
            after_step_write: AtomicBool::new(false),
            after_attention: AtomicBool::new(false),
            recording: Mutex::new(None),
            pass: Mutex::new(()),
            sampling,
            moe_tables: Mutex::new(HashMap::new()),
            batch_table: Mutex::new(None),
            row_slot_table: Mutex::new(None),
            staged: Mutex::new(None),
            batch_graphs_off: AtomicBool::new(false),
        })
    }

    /// The first failure recorded so far, without waiting for the device.
    pub(super) fn recorded_error(&self) -> Result<()> {
        match self.error.lock().ok().and_then(|e| e.clone()) {
            Some(e) => Err(Error::Invalid(format!("cuda:{}: {e}", self.ordinal))),
            None => Ok(()),
        }
    }

    /// Takes the recorded failure back (one known to have left the device
    /// as it was: a capture that was not recorded).
    pub(super) fn take_error(&self) -> Option<String> {
        self.error.lock().ok().and_then(|mut e| e.take())
    }

    pub(super) fn failed(&self) -> bool {
        self.error.lock().map(|e| e.is_some()).unwrap_or(true)
    }

    pub(super) fn record<E: std::fmt::Display>(&self, r: std::result::Result<(), E>, what: &str) {
        if let Err(e) = r
            && let Ok(mut slot) = self.error.lock()
            && slot.is_none()
        {
            *slot = Some(format!("{what}: {e}"));
        }
    }

    /// A device buffer of `n` zeros (one element after a failure, never used then).
    pub(super) fn zeros<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> CudaSlice<T> {
        match self.stream.alloc_zeros::<T>(n.max(1)) {
            Ok(s) => s,
            Err(e) => {
                self.record(Err(e), &format!("allocating {n} values"));
                self.stream.alloc_zeros::<T>(1).expect("CUDA cannot allocate even one value")
            }
        }
    }

    /// A device buffer of `n` values left as the allocator hands them over:
    /// for outputs a kernel writes whole (a zeroing memset per op would be one
    /// more launch on the decode path; the poisoned-output tests catch any
    /// element left unwritten).
    pub(super) fn uninit<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> CudaSlice<T> {
        // SAFETY: callers write every element before it is read.
        match unsafe { self.stream.alloc::<T>(n.max(1)) } {
            Ok(s) => s,
            Err(e) => {
                self.record(Err(e), &format!("allocating {n} values"));
                self.zeros(1)
            }
        }
    }

    /// New activations are NaN-filled instead of zeroed, so a kernel that
    /// leaves an element unwritten fails its test.
    pub fn with_poisoned_outputs(mut self) -> Self {
        self.poison = true;
        self
    }

    /// Runs every decode step as it comes instead of replaying recorded graphs
    /// (for comparison and debugging; the results are the same).
    pub fn without_graphs(mut self) -> Self {
        self.graphs = false;
        self
    }

    /// Launches each kernel only after the one before it has finished (as
    /// without programmatic dependent launch; for measuring what it gains).
    pub fn without_overlapped_launches(mut self) -> Self {
        self.overlap_launches = false;
        self
    }

    /// Launches every GEMV with `shape` (profiling the choice of shapes).
    pub fn with_gemv_shape(mut self, shape: GemvShape) -> Self {
        self.gemv_shape = Some(shape);
        self
    }

    /// Leaves affine weights' rows to the GEMVs and the prefill path (bf16
    /// tiles and cuBLAS), never the tensor-core GEMM (for measuring what it
    /// gains; the results differ by bf16 rounding only).
    pub fn without_affine_gemm(mut self) -> Self {
        self.affine_gemm = false;
        self
    }

    /// Leaves 4-bit affine weights' GEMM rows to the general kernel (for
    /// measuring what the 4-bit kernel gains).
    pub fn without_affine_gemm4(mut self) -> Self {
        self.affine_gemm4 = false;
        self
    }

    /// Counts the decode steps replayed from recordings (tests and benchmarks
    /// check that the fast path ran).
    pub fn replay_counter(&self) -> Arc<AtomicUsize> {
        self.replays.clone()
    }

    /// New KV caches store keys and values as `kv` (f16 unless set).
    pub fn with_kv_precision(mut self, kv: KvPrecision) -> Self {
        self.kv_precision = kv;
        self
    }

    /// A paged pool encoded in `format` (one the CUDA kernels take, see
    /// [`coded_pair`](super::kv_coded::coded_pair)); contiguous caches stay
    /// plain.
    pub fn with_coded_kv(mut self, format: crate::kv::KvFormat) -> Result<Self> {
        super::kv_coded::coded_pair(format).map_err(Error::Invalid)?;
        self.kv_coded = Some(format);
        Ok(self)
    }

    /// The codecs of the encoded pool format, if there is one; an error
    /// when the model's cache shape has not been given yet.
    pub(super) fn kv_coded_codecs(&self) -> Result<Option<Arc<super::kv_coded::CudaCodecs>>> {
        if self.kv_coded.is_none() {
            return Ok(None);
        }
        let c = self.kv_codecs.lock().map_err(|_| Error::Invalid("KV codecs lock poisoned".into()))?.clone();
        c.map(Some).ok_or_else(|| Error::Invalid("prepare_kv builds the KV codecs before the first pool".into()))
    }

    /// Prefill GEMMs carry activations at about 16 bits (see `split_activations`).
    pub fn with_split_activations(mut self) -> Self {
        self.split_activations = true;
        self
    }

    /// MoE prefill takes the grouped expert GEMM where the chosen experts
    /// would average at most `rows` rows (0: never, `usize::MAX`: always),
    /// whatever the experts' storage, one cuBLAS GEMM per expert otherwise;
    /// for tests and for measuring the crossover (the results agree within
    /// the GEMMs' f32 summation order).
    pub fn with_grouped_moe_rows(mut self, rows: usize) -> Self {
        self.grouped_moe_rows = Some(rows);
        self
    }

    /// Decode steps over a split cache run the q|k|v prologue as its own
    /// kernel, as long caches do (for measuring what folding it gains; the
    /// results are the same).
    pub fn without_split_prologue_folding(mut self) -> Self {
        self.fold_split_prologue = false;
        self
    }

    pub(super) fn act(&self, rows: usize, cols: usize) -> CudaAct {
        let n = (rows * cols).max(1);
        let (pool, capturing) =
            self.recording.lock().ok().and_then(|r| r.clone()).unwrap_or((self.pool.clone(), false));
        let buf = match pool.take(n) {
            Some(b) => b,
            None if capturing => {
                // The warm-up pass allocated every buffer this step uses; a new
                // one now would be a different program than the one that ran.
                self.record(Err(format!("{n} values")), "recording a decode step: a buffer the warm-up did not use");
                return CudaAct::new(rows, cols, self.zeros(1), None);
            }
            None => self.uninit::<f32>(n),
        };
        if self.poison && !self.failed() {
            // SAFETY: the range is exactly the allocation.
            let r = unsafe {
                cudarc::driver::result::memset_d8_async(self.p(&buf), 0xff, buf.len() * 4, self.stream.cu_stream())
            };
            self.record(r, "poisoning an output");
        }
        CudaAct::new(rows, cols, buf, Some(pool))
    }

    pub(super) fn upload_slice<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        v: &[T],
    ) -> CudaSlice<T> {
        if self.capturing() && self.batch_staged() {
            // A capture would keep the host address and copy from it at every
            // replay: the recording fails instead (and batched steps then run
            // as they come).
            self.record(Err("a host-to-device copy inside a recorded batched step"), "recording a batched step");
        }
        match self.stream.clone_htod(v) {
            Ok(s) => s,
            Err(e) => {
                self.record(Err(e), "host-to-device copy");
                self.zeros(1)
            }
        }
    }

    /// A raw device pointer for a kernel argument (one stream, no event tracking).
    pub(super) fn p<T>(&self, s: &CudaSlice<T>) -> u64 {
        let (p, _sync) = s.device_ptr(&self.stream);
        p
    }

    /// A K-quant matrix `t` (Q2_K … Q6_K): its affine levels, and one
    /// record per 256 values of a row (formats/gguf/as_affine.rs
    /// `superblock_records`) for its scales and biases. The f32 scales and
    /// biases of the full affine form are never built.
    pub(super) fn upload_superblocks(&self, t: &Tensor) -> Result<CudaWeight> {
        use crate::quant::gguf_affine::{affine_levels, superblock_records};
        let no_form = || Error::tensor(&t.name, format!("{} has no super-block records", t.dtype.name()));
        let levels = affine_levels(t).ok_or_else(no_form)??;
        let records = superblock_records(t).ok_or_else(no_form)??;
        // Every K-quant is one of these, with rows of whole 256-value blocks.
        let takes_records = matches!((levels.params.bits, levels.params.group_size), (4 | 5, 32) | (2 | 3 | 6, 16));
        if !takes_records || !levels.cols.is_multiple_of(256) {
            return Err(Error::tensor(
                &t.name,
                format!("{} bits in groups of {}: no record kernels", levels.params.bits, levels.params.group_size),
            ));
        }
        Ok(CudaWeight::Affine(AffineWeight {
            params: levels.params,
            rows: levels.rows,
            cols: levels.cols,
            packed: self.upload_slice(&levels.packed),
            scales: self.upload_slice(&records),
            // Not read (records hold the biases too); one word so the pointer is a real one.
            biases: self.upload_slice(&[0u8; 4]),
            side: AffineSide::Records,
        }))
    }

    /// [`crate::backend::Backend::upload`].
    pub(super) fn upload_op(&self, t: &Tensor) -> Result<CudaWeight> {
        match (t.shape.len(), t.dtype) {
            (1, _) => Ok(CudaWeight::Vector(self.upload_slice(&t.to_f32_vec()))),
            (2, DType::BF16 | DType::F16 | DType::F32) => Ok(CudaWeight::Matrix {
                dtype: t.dtype,
                rows: t.shape[0],
                cols: t.shape[1],
                buf: self.upload_slice(t.data.as_slice()),
            }),
            // ggml blocks become affine weights, with groups of 32 or (Q2_K,
            // Q3_K, Q6_K) 16 values: exact, see formats/gguf/as_affine.rs.
            // The K-quants keep their super-blocks' scales as records.
            (2, DType::Q2_K | DType::Q3_K | DType::Q4_K | DType::Q5_K | DType::Q6_K) => self.upload_superblocks(t),
            (2, DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 | DType::Q8_0) => {
                match crate::quant::gguf_affine::as_affine(t) {
                    Some(affine) => affine.and_then(|a| self.upload_affine_op(&a)),
                    None => Err(Error::tensor(&t.name, format!("{} has no affine form", t.dtype.name()))),
                }
            }
            (2, DType::U32) => Err(Error::tensor(
                &t.name,
                "u32 words are quantized weights only with their scales and biases (an affine weight)",
            )),
            _ => Err(Error::tensor(&t.name, format!("expected 1-D or 2-D, found shape {:?}", t.shape))),
        }
        .and_then(|w| self.check_op().map(|_| w))
    }

    /// [`crate::backend::Backend::upload_affine`].
    pub(super) fn upload_affine_op(&self, t: &crate::quant::affine::AffineTensor) -> Result<CudaWeight> {
        let &[rows, cols] = t.shape.as_slice() else {
            return Err(Error::tensor(&t.name, format!("expected a 2-D matrix, found shape {:?}", t.shape)));
        };
        // bf16 scales and biases stay bf16 (half the bytes, exact); any other
        // storage becomes f32, which holds f16 exactly too. Groups of 16 take
        // f32 ones only (their GEMVs have no bf16 form).
        let bf16_scales = t.scales.dtype == DType::BF16 && t.biases.dtype == DType::BF16 && t.params.group_size != 16;
        let side = |v: &Tensor| match bf16_scales {
            true => self.upload_slice(v.data.as_slice()),
            false => self.upload_slice(&v.to_f32_vec().iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>()),
        };
        Ok(CudaWeight::Affine(AffineWeight {
            params: t.params,
            rows,
            cols,
            packed: self.upload_slice(t.packed.data.as_slice()),
            scales: side(&t.scales),
            biases: side(&t.biases),
            side: if bf16_scales { AffineSide::Bf16 } else { AffineSide::F32 },
        }))
    }

    /// [`crate::backend::Backend::upload_fp8`].
    pub(super) fn upload_fp8_op(&self, t: &crate::quant::fp8::Fp8Tensor) -> Result<CudaWeight> {
        let &[rows, cols] = t.shape() else {
            return Err(Error::tensor(&t.name, format!("expected a 2-D matrix, found shape {:?}", t.shape())));
        };
        Ok(CudaWeight::Fp8(Fp8Weight {
            rows,
            cols,
            group: t.group,
            weight: self.upload_slice(t.weight.data.as_slice()),
            scales: self.upload_slice(&t.scales.to_f32_vec()),
        }))
        .and_then(|w| self.check_op().map(|_| w))
    }

    /// [`crate::backend::Backend::check`].
    pub(super) fn check_op(&self) -> Result<()> {
        let sync = self.stream.synchronize();
        self.record(sync, "synchronize");
        self.recorded_error()
    }

    /// [`crate::backend::Backend::to_host`].
    pub(super) fn to_host_op(&self, x: &CudaAct) -> Vec<f32> {
        if self.failed() {
            return vec![0.0; x.rows * x.cols];
        }
        match self.stream.clone_dtoh(&*x.buf) {
            Ok(mut v) => {
                v.truncate(x.rows * x.cols);
                v
            }
            Err(e) => {
                self.record(Err(e), "device-to-host copy");
                vec![0.0; x.rows * x.cols]
            }
        }
    }
}
