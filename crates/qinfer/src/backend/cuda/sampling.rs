//! Sampling on the device (sampling.cu): the repetition penalty, greedy
//! argmax, and temperature with top-k/top-p/min-p, so a decode step ends with
//! a 4-byte token id crossing to the host instead of the vocabulary's logits.

use std::sync::{Arc, Mutex};

use cudarc::driver::sys;
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, PinnedHostSlice};

use super::kernels::{Resolve, cfg, kernel_args};
use super::{CudaAct, CudaBackend};
use crate::backend::Backend;
use crate::sampling::{RowPick, SamplingParams};
use crate::{Error, Result};

/// Blocks of `sample_argmax`.
const ARGMAX_BLOCKS: usize = 128;

/// Threads of the one block of `sample_filtered` (`SAMPLE_THREADS`).
pub(super) const SAMPLE_THREADS: u32 = 1024;

/// Blocks of `sample_top_k`, and the largest top-k it takes (`TOPK_BLOCKS`,
/// `TOPK_MAX`): each block keeps at most that many candidates of its slice.
pub(super) const TOPK_BLOCKS: usize = 64;
pub(super) const TOPK_MAX: usize = 64;

/// Dynamic shared memory of `sample_top_k`: the gathered candidates' logits and ids.
pub(super) const TOP_K_SHARED: usize = 2 * TOPK_BLOCKS * TOPK_MAX * 4;

/// The kernels of sampling.cu.
pub(super) struct SamplingKernels<K> {
    argmax: K,
    argmax_rows: K,
    filtered: K,
    pub(super) top_k: K,
    penalty: K,
}

impl<K> SamplingKernels<K> {
    pub(super) fn load(get: &mut Resolve<'_, K>) -> Result<Self> {
        const U: &str = "sampling.cu";
        Ok(SamplingKernels {
            argmax: get(U, "sample_argmax".into())?,
            argmax_rows: get(U, "sample_argmax_rows".into())?,
            filtered: get(U, "sample_filtered".into())?,
            top_k: get(U, "sample_top_k".into())?,
            penalty: get(U, "sample_penalty".into())?,
        })
    }
}

kernel_args! {
    /// `sample_argmax_rows`.
    ArgmaxRowsArgs { x: u64, n: i32, at: u64, part_v: u64, part_i: u64, tickets: u64, out: u64 }
}
kernel_args! {
    /// `sample_penalty`.
    PenaltyArgs { x: u64, ids: u64, count: i32, n: i32, penalty: f32 }
}
kernel_args! {
    /// `sample_argmax`.
    ArgmaxArgs {
        x: u64, n: i32, part_values: u64, part_ids: u64, ticket: u64, token: u64, feed_step: u64, feed_start: i32,
        feed_host: u64,
    }
}
kernel_args! {
    /// `sample_top_k`.
    TopKArgs {
        x: u64, n: i32, temperature: f32, top_k: i32, top_p: f32, min_p: f32, u: f32, cand_logits: u64,
        cand_ids: u64, cand_counts: u64, slice_max: u64, slice_z: u64, left_logits: u64, left_ids: u64, ticket: u64,
        fallbacks: u64, token: u64, feed_step: u64, feed_start: i32, feed_host: u64,
    }
}
kernel_args! {
    /// `sample_filtered`.
    FilteredArgs {
        x: u64, n: i32, temperature: f32, top_k: i32, top_p: f32, min_p: f32, u: f32, token: u64, feed_step: u64,
        feed_start: i32, feed_host: u64,
    }
}

/// Device buffers the sampling kernels share: the argmax blocks' partial
/// results, the top-k blocks' candidates (and, without a top-k, each slice's
/// max, normalizer and best candidate left out), their ticket, and the
/// chosen token.
pub(super) struct SampleScratch {
    part_values: CudaSlice<f32>,
    part_ids: CudaSlice<i32>,
    cand_logits: CudaSlice<f32>,
    cand_ids: CudaSlice<i32>,
    cand_counts: CudaSlice<i32>,
    slice_max: CudaSlice<f32>,
    slice_z: CudaSlice<f32>,
    left_logits: CudaSlice<f32>,
    left_ids: CudaSlice<i32>,
    /// Draws without a top-k that had to look past the slices' candidates.
    fallbacks: CudaSlice<u32>,
    /// Zero between calls: the last block of a call resets it.
    ticket: CudaSlice<u32>,
    token: CudaSlice<u32>,
    /// Pinned host slots the sampling kernels write the picks of
    /// `sample_ahead` into, used in turn (the ticket is the slot), and the
    /// next one to use.
    picks: Vec<PickSlot>,
    next_slot: usize,
}

/// A pinned, device-mapped host u32 that a sampling kernel writes a pick into.
struct PickSlot {
    host: PinnedHostSlice<u32>,
    /// The slot's address on the device.
    device: u64,
    /// Recorded after the kernel that writes the slot (cudarc records the
    /// slot's own event only where it tracks events, which this backend
    /// turns off).
    written: CudaEvent,
}

impl PickSlot {
    /// A slot holding 0. Mapped, not write-combined: the host reads it.
    fn new(stream: &Arc<CudaStream>) -> std::result::Result<Self, cudarc::driver::DriverError> {
        // SAFETY: the slot is written before anything can read it.
        let mut host = unsafe { stream.context().alloc_pinned_with_flags::<u32>(1, sys::CU_MEMHOSTALLOC_DEVICEMAP)? };
        let ptr = host.as_mut_ptr()?;
        // SAFETY: the pointer is to the one u32 just allocated, and nothing else uses it yet.
        unsafe { ptr.write(0) };
        let mut device: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` is a mapped page-locked allocation of this context.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, ptr.cast(), 0) }.result()?;
        Ok(PickSlot { host, device, written: stream.context().new_event(None)? })
    }
}

impl SampleScratch {
    pub(super) fn new(stream: &Arc<CudaStream>) -> std::result::Result<Mutex<Self>, cudarc::driver::DriverError> {
        Ok(Mutex::new(SampleScratch {
            part_values: stream.alloc_zeros(ARGMAX_BLOCKS)?,
            part_ids: stream.alloc_zeros(ARGMAX_BLOCKS)?,
            cand_logits: stream.alloc_zeros(TOPK_BLOCKS * TOPK_MAX)?,
            cand_ids: stream.alloc_zeros(TOPK_BLOCKS * TOPK_MAX)?,
            cand_counts: stream.alloc_zeros(TOPK_BLOCKS)?,
            slice_max: stream.alloc_zeros(TOPK_BLOCKS)?,
            slice_z: stream.alloc_zeros(TOPK_BLOCKS)?,
            left_logits: stream.alloc_zeros(TOPK_BLOCKS)?,
            left_ids: stream.alloc_zeros(TOPK_BLOCKS)?,
            fallbacks: stream.alloc_zeros(1)?,
            ticket: stream.alloc_zeros(1)?,
            token: stream.alloc_zeros(1)?,
            picks: (0..2).map(|_| PickSlot::new(stream)).collect::<std::result::Result<_, _>>()?,
            next_slot: 0,
        }))
    }
}

/// Where a sampling kernel also writes its pick (`sample_emit` in
/// sampling.cu): the step inputs, as the pass at `start`'s, and a host slot;
/// null pointers for none.
#[derive(Clone, Copy, Default)]
struct Feed {
    step: u64,
    start: i32,
    host: u64,
}

impl CudaBackend {
    /// [`crate::backend::ops::SamplingOps::sample`] on the device.
    pub(super) fn sample_on_device(
        &self,
        logits: &CudaAct,
        params: &SamplingParams,
        penalized: &[u32],
        u: f32,
    ) -> Result<u32> {
        let scratch = self.sampling.lock().map_err(|_| Error::Invalid("cuda: a sampling call panicked".into()))?;
        let last = logits.rows - 1;
        self.launch_pick(&scratch, logits, last, params, penalized, u, self.p(&scratch.token), None);
        let id = self.read_picks(&scratch.token).first().copied().unwrap_or(0);
        drop(scratch);
        self.check()?;
        Ok(id)
    }

    /// [`crate::backend::ops::SamplingOps::sample_rows`] on the device: each
    /// row's kernels write its pick into one device array, read back once.
    pub(super) fn sample_rows_on_device(&self, logits: &CudaAct, picks: &[(usize, &RowPick)]) -> Result<Vec<u32>> {
        if picks.is_empty() {
            return Ok(Vec::new());
        }
        if let Some(&(r, _)) = picks.iter().find(|&&(r, _)| r >= logits.rows) {
            return Err(Error::Invalid(format!("sample_rows: row {r} of {} rows", logits.rows)));
        }
        let scratch = self.sampling.lock().map_err(|_| Error::Invalid("cuda: a sampling call panicked".into()))?;
        // Greedy rows without a penalty all go in one launch (where there are
        // several); the others one at a time.
        let plain_greedy =
            |p: &RowPick| p.params.temperature == 0.0 && (p.params.repetition_penalty == 1.0 || p.penalized.is_empty());
        let greedy: Vec<usize> = (0..picks.len()).filter(|&i| plain_greedy(picks[i].1)).collect();
        let together = greedy.len() >= 2;
        // The picks, then the batched argmax's tickets.
        let n = picks.len() + if together { greedy.len() } else { 0 };
        let out = match self.stream.alloc_zeros::<u32>(n) {
            Ok(o) => o,
            Err(e) => return Err(Error::Invalid(format!("cuda: allocating {} picks: {e}", picks.len()))),
        };
        let base = self.p(&out);
        for (i, &(r, pick)) in picks.iter().enumerate() {
            if !(together && plain_greedy(pick)) {
                self.launch_pick(&scratch, logits, r, &pick.params, &pick.penalized, pick.u, base + 4 * i as u64, None);
            }
        }
        if together {
            self.argmax_rows(logits, &greedy.iter().map(|&i| (picks[i].0, i)).collect::<Vec<_>>(), &out, picks.len());
        }
        let mut ids = self.read_picks(&out);
        ids.truncate(picks.len());
        drop(scratch);
        self.check()?;
        Ok(ids)
    }

    /// Greedy picks of logits rows in one launch (`sample_argmax_rows`):
    /// for each (row, i), row `row`'s argmax into `out[i]`; `out` holds
    /// zeroed tickets from `tickets_at` on, one per pick.
    fn argmax_rows(&self, logits: &CudaAct, at: &[(usize, usize)], out: &CudaSlice<u32>, tickets_at: usize) {
        // About ARGMAX_BLOCKS blocks in all, at least 16 a row.
        let per_row = ARGMAX_BLOCKS.div_ceil(at.len()).max(16);
        let table: Vec<i32> = at.iter().flat_map(|&(r, i)| [r as i32, i as i32]).collect();
        let table = self.upload_slice(&table);
        let (part_v, part_i) = (self.act(at.len(), per_row), self.act(at.len(), per_row));
        let args = ArgmaxRowsArgs {
            x: self.p(&logits.buf),
            n: logits.cols as i32,
            at: self.p(&table),
            part_v: self.p(&part_v.buf),
            part_i: self.p(&part_i.buf),
            tickets: self.p(out) + 4 * tickets_at as u64,
            out: self.p(out),
        };
        self.launch(&self.k.sampling.argmax_rows, cfg((per_row as u32, at.len() as u32, 1), 256, 0), &args);
        // Dropping `table` frees it in stream order, after the launch.
        drop(table);
    }

    /// The picks in `buf`, read back (waiting for the kernels that wrote
    /// them); none after a recorded failure, which `check` then reports.
    fn read_picks(&self, buf: &CudaSlice<u32>) -> Vec<u32> {
        if self.failed() {
            return Vec::new();
        }
        self.stream.clone_dtoh(buf).unwrap_or_else(|e| {
            self.record(Err(e), "reading the sampled tokens");
            Vec::new()
        })
    }

    /// [`crate::backend::ops::SamplingOps::sample_ahead`] on the device: the sampling kernel itself
    /// writes the pick into the step inputs and a pinned host slot.
    pub(super) fn sample_ahead_on_device(
        &self,
        logits: &CudaAct,
        params: &SamplingParams,
        u: f32,
        next_start: usize,
    ) -> Result<usize> {
        let mut scratch = self.sampling.lock().map_err(|_| Error::Invalid("cuda: a sampling call panicked".into()))?;
        let ticket = scratch.next_slot;
        scratch.next_slot = (ticket + 1) % scratch.picks.len();
        let feed = Feed { step: self.p(&self.step), start: next_start as i32, host: scratch.picks[ticket].device };
        let (last, token) = (logits.rows - 1, self.p(&scratch.token));
        self.launch_pick(&scratch, logits, last, params, &[], u, token, Some(feed));
        self.step_fed_on_device(next_start);
        self.record(scratch.picks[ticket].written.record(&self.stream), "marking a pick");
        self.recorded_error()?;
        Ok(ticket)
    }

    /// [`crate::backend::ops::SamplingOps::picked`] on the device: waits for the kernel that wrote the
    /// ticket's slot only.
    pub(super) fn picked_on_device(&self, ticket: usize) -> Result<u32> {
        let scratch = self.sampling.lock().map_err(|_| Error::Invalid("cuda: a sampling call panicked".into()))?;
        let slot = scratch.picks.get(ticket).ok_or_else(|| Error::Invalid(format!("no pick ticket {ticket}")))?;
        self.record(slot.written.synchronize(), "waiting for a pick");
        let id = match slot.host.as_ptr() {
            // SAFETY: the slot is one u32, written by a kernel that has finished.
            Ok(p) => unsafe { p.read_volatile() },
            Err(e) => {
                self.record(Err(e), "reading a pick");
                0
            }
        };
        self.recorded_error()?;
        Ok(id)
    }

    /// Launches the kernels that leave the pick from row `at` of `logits`
    /// at device address `token` (and where `feed` says).
    #[allow(clippy::too_many_arguments)]
    fn launch_pick(
        &self,
        scratch: &SampleScratch,
        logits: &CudaAct,
        at: usize,
        params: &SamplingParams,
        penalized: &[u32],
        u: f32,
        token: u64,
        feed: Option<Feed>,
    ) {
        let Feed { step: feed_step, start: feed_start, host: feed_host } = feed.unwrap_or_default();
        let vocab = logits.cols;
        let mut row = self.p(&logits.buf) + (at * vocab * 4) as u64;
        // The penalty rewrites logits: on a copy, never on the pass's output.
        let _penalized_copy = if params.repetition_penalty != 1.0 && !penalized.is_empty() {
            let copy = self.gather_rows_op(logits, &[at]);
            let ids = self.upload_slice(penalized);
            let args = PenaltyArgs {
                x: self.p(&copy.buf),
                ids: self.p(&ids),
                count: penalized.len() as i32,
                n: vocab as i32,
                penalty: params.repetition_penalty,
            };
            self.launch(&self.k.sampling.penalty, cfg((penalized.len().div_ceil(256) as u32, 1, 1), 256, 0), &args);
            row = self.p(&copy.buf);
            Some((copy, ids))
        } else {
            None
        };
        if params.temperature == 0.0 {
            let args = ArgmaxArgs {
                x: row,
                n: vocab as i32,
                part_values: self.p(&scratch.part_values),
                part_ids: self.p(&scratch.part_ids),
                ticket: self.p(&scratch.ticket),
                token,
                feed_step,
                feed_start,
                feed_host,
            };
            self.launch(&self.k.sampling.argmax, cfg((ARGMAX_BLOCKS as u32, 1, 1), 256, 0), &args);
        } else if (params.top_k <= TOPK_MAX || params.top_k >= vocab) && vocab >= TOPK_BLOCKS * TOPK_MAX {
            // A small top-k, or none: the vocabulary is cut to the slices'
            // best candidates on many SMs first (the one-block kernel takes
            // 0.6 ms over Qwen's 151,936 logits). Without a top-k the kernel
            // checks that the draw depends on those candidates only, and
            // else draws from the whole vocabulary itself.
            let top_k = if params.top_k >= vocab { 0 } else { params.top_k };
            let args = TopKArgs {
                x: row,
                n: vocab as i32,
                temperature: params.temperature,
                top_k: top_k as i32,
                top_p: params.top_p,
                min_p: params.min_p,
                u,
                cand_logits: self.p(&scratch.cand_logits),
                cand_ids: self.p(&scratch.cand_ids),
                cand_counts: self.p(&scratch.cand_counts),
                slice_max: self.p(&scratch.slice_max),
                slice_z: self.p(&scratch.slice_z),
                left_logits: self.p(&scratch.left_logits),
                left_ids: self.p(&scratch.left_ids),
                ticket: self.p(&scratch.ticket),
                fallbacks: self.p(&scratch.fallbacks),
                token,
                feed_step,
                feed_start,
                feed_host,
            };
            let c = cfg((TOPK_BLOCKS as u32, 1, 1), SAMPLE_THREADS, TOP_K_SHARED as u32);
            self.launch(&self.k.sampling.top_k, c, &args);
        } else {
            let args = FilteredArgs {
                x: row,
                n: vocab as i32,
                temperature: params.temperature,
                top_k: params.top_k.min(vocab) as i32,
                top_p: params.top_p,
                min_p: params.min_p,
                u,
                token,
                feed_step,
                feed_start,
                feed_host,
            };
            self.launch(&self.k.sampling.filtered, cfg((1, 1, 1), SAMPLE_THREADS, 0), &args);
        }
    }

    /// Draws without a top-k so far that the cut-down candidates could not
    /// decide, so that the last block drew from the whole vocabulary (tests
    /// check that both ways ran).
    pub fn sampling_fallbacks(&self) -> Result<u32> {
        let scratch = self.sampling.lock().map_err(|_| Error::Invalid("cuda: a sampling call panicked".into()))?;
        let v = self.stream.clone_dtoh(&scratch.fallbacks).map_err(|e| Error::Invalid(format!("cuda: {e}")))?;
        Ok(v[0])
    }
}
