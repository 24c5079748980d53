//! Batched decode steps recorded as CUDA graphs and replayed. A step's
//! inputs (the token ids, then the batch table: positions, slots, block
//! tables) are staged in one device buffer that every recording addresses;
//! each step writes its own there with one copy, then replays the recording
//! of its size (rows padded up to a bucket by the caller) and attention plan.
//! While a step is staged, the ops that would upload its tokens or table
//! read the staged copy instead, and the decode attention takes the plan a
//! recording serves (`decode_plan`, fixed between power-of-two key counts).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use cudarc::driver::CudaSlice;

use super::attention_plan::decode_step_key;
use super::batch::batch_table;
use super::graph::{CudaStep, Recorded};
use super::linear::GEMV_MAX_ROWS;
use super::{BufferPool, CudaAct, CudaBackend};
use crate::kv::batch::BatchLayout;
use crate::{Error, Result};

/// Most rows a batched step is recorded with; larger steps run as they come.
pub(super) const MAX_RECORDED_ROWS: usize = 512;

/// Recorded sizes above the powers of two up to 16 are multiples of this.
const ROWS_STEP: usize = 32;

/// The recorded size that serves `rows` decode rows: a power of two up to
/// 16, then a multiple of [`ROWS_STEP`] (padding costs a few rows of each
/// matmul; each size costs a recording per attention plan).
pub(super) fn recorded_rows(rows: usize) -> Option<usize> {
    match rows {
        0 => None,
        1..=16 => Some(rows.next_power_of_two()),
        _ => Some(rows.div_ceil(ROWS_STEP) * ROWS_STEP).filter(|&r| r <= MAX_RECORDED_ROWS),
    }
}

/// A batch state's recordings: by (rows, attention plan key), the
/// activation arena of each size (shared by its plans' recordings, which
/// never run at once), and the staging buffer they all read.
#[derive(Default)]
pub struct RecordedBatches {
    recorded: HashMap<(usize, usize), Recorded>,
    arenas: HashMap<usize, Arc<BufferPool>>,
    staging: Option<CudaSlice<i32>>,
}

/// The step staged for the ops of the pass now running: its layout and
/// tokens (which the ops compare theirs with), and where on the device its
/// token ids and batch table are.
pub(super) struct Staged {
    layout: BatchLayout,
    tokens: Vec<u32>,
    ids: u64,
    table: u64,
}

impl CudaBackend {
    /// [`crate::backend::Backend::batch_step_rows`].
    pub(super) fn batch_step_rows_op(&self, rows: usize, moe: bool) -> Option<usize> {
        // An encoded pool's steps upload their codec tables as they go.
        if !self.graphs || self.kv_coded.is_some() || self.batch_graphs_off.load(Ordering::Relaxed) {
            return None;
        }
        // Experts of larger batches are routed with a read back (moe.rs).
        recorded_rows(rows).filter(|&r| !moe || r <= GEMV_MAX_ROWS)
    }

    /// [`crate::backend::Backend::run_batch_step`]: the step's inputs staged,
    /// then its size's recording replayed, or `body` run and recorded.
    pub(super) fn run_batch_step_op<R>(
        &self,
        step: &mut CudaStep,
        tokens: &[u32],
        batch: &BatchLayout,
        body: &mut dyn FnMut() -> Result<CudaAct>,
        finish: &mut dyn FnMut(&CudaAct) -> Result<R>,
    ) -> Result<R> {
        let _pass = self.pass.lock().map_err(|_| Error::Invalid("cuda: a pass panicked".into()))?;
        let rows = batch.rows();
        if self.batch_step_rows_op(rows, false) != Some(rows) || tokens.len() != rows || self.failed() {
            let out = body()?;
            return finish(&out);
        }
        let mut inputs: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        inputs.extend(batch_table(batch).map_err(|e| Error::Invalid(format!("batch table: {e}")))?);
        let batches = &mut step.batches;
        if batches.staging.as_ref().is_none_or(|s| s.len() < inputs.len()) {
            // The recordings address the old buffer: they go with it.
            batches.recorded.clear();
            batches.staging = Some(self.zeros(inputs.len().next_power_of_two().max(4096)));
        }
        let staging = batches.staging.as_mut().expect("allocated above");
        let copied = self.stream.memcpy_htod(&inputs, &mut staging.slice_mut(..inputs.len()));
        self.record(copied, "staging a batch step's inputs");
        let n_keys = batch.seqs.iter().map(|s| s.context_len()).max().unwrap_or(0);
        let key = (rows, decode_step_key(n_keys));
        if let Some(rec) = batches.recorded.get(&key) {
            let r = rec.graph.launch();
            self.record(r, "replaying a batched decode step");
            self.replays.fetch_add(1, Ordering::Relaxed);
            return finish(&rec.out);
        }
        // The ops of the pass to record find its inputs staged (a replay runs
        // no op that would look).
        let ids = self.p(staging);
        let staged = Staged { layout: batch.clone(), tokens: tokens.to_vec(), ids, table: ids + 4 * rows as u64 };
        self.set_staged(Some(staged));
        let arena = batches.arenas.entry(rows).or_insert_with(|| Arc::new(BufferPool::arena())).clone();
        let result = self.record_batch_step(&mut batches.recorded, key, arena, body, finish);
        self.set_staged(None);
        result
    }

    /// Runs the step's `body` for real (its buffers from `arena`), finishes
    /// it, then captures the same body for `key`'s replays. A capture that
    /// fails (an op the pass issues cannot be recorded) turns recording off
    /// for batched steps, with a warning, and loses nothing: the step ran.
    fn record_batch_step<R>(
        &self,
        recorded: &mut HashMap<(usize, usize), Recorded>,
        key: (usize, usize),
        arena: Arc<BufferPool>,
        body: &mut dyn FnMut() -> Result<CudaAct>,
        finish: &mut dyn FnMut(&CudaAct) -> Result<R>,
    ) -> Result<R> {
        self.set_recording(Some((arena.clone(), false)));
        let warm = body();
        self.set_recording(None);
        let result = finish(&warm?)?;
        if self.failed() {
            return Ok(result);
        }
        match self.capture(&arena, "a batched decode step", body) {
            (Ok(out), Ok(Some(graph))) if !self.failed() => {
                recorded.insert(key, Recorded { graph, out, _arena: arena });
            }
            (out, graph) => {
                let why = match (out, graph) {
                    (Err(e), _) => e.to_string(),
                    (_, Err(e)) => e.to_string(),
                    _ => self.take_error().unwrap_or_else(|| "no graph".into()),
                };
                // Nothing of the capture ran: the device is as the step left it.
                self.take_error();
                self.batch_graphs_off.store(true, Ordering::Relaxed);
                tracing::warn!("recording a batched decode step failed ({why}); batched steps run as they come");
            }
        }
        Ok(result)
    }

    fn set_staged(&self, to: Option<Staged>) {
        match self.staged.lock() {
            Ok(mut s) => *s = to,
            Err(_) => self.record(Err("staged-step lock poisoned"), "staging a batch step"),
        }
    }

    /// The staged batch table, where `batch` is the staged step's.
    pub(super) fn staged_table(&self, batch: &BatchLayout) -> Option<u64> {
        let s = self.staged.lock().ok()?;
        s.as_ref().filter(|s| s.layout == *batch).map(|s| s.table)
    }

    /// The staged token ids, where `ids` are the staged step's.
    pub(super) fn staged_ids(&self, ids: &[u32]) -> Option<u64> {
        let s = self.staged.lock().ok()?;
        s.as_ref().filter(|s| s.tokens == ids).map(|s| s.ids)
    }

    /// The staged slot mapping, where `slots` are the staged step's.
    pub(super) fn staged_slots(&self, slots: &[u32]) -> Option<u64> {
        let s = self.staged.lock().ok()?;
        s.as_ref().filter(|s| s.layout.slots == slots).map(|s| s.table + 8 * s.layout.rows() as u64)
    }

    /// Whether a batched step is staged (its decode attention then takes
    /// the plan its recording serves).
    pub(super) fn batch_staged(&self) -> bool {
        self.staged.lock().map(|s| s.is_some()).unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recorded_sizes_cover_every_batch_up_to_the_largest() {
        assert_eq!(recorded_rows(0), None);
        assert_eq!(
            (1..=16).map(|r| recorded_rows(r).unwrap()).collect::<Vec<_>>(),
            [1, 2, 4, 4, 8, 8, 8, 8, 16, 16, 16, 16, 16, 16, 16, 16]
        );
        assert_eq!(recorded_rows(17), Some(32));
        assert_eq!(recorded_rows(33), Some(64));
        assert_eq!(recorded_rows(MAX_RECORDED_ROWS), Some(MAX_RECORDED_ROWS));
        assert_eq!(recorded_rows(MAX_RECORDED_ROWS + 1), None);
        for r in 1..=MAX_RECORDED_ROWS {
            let s = recorded_rows(r).unwrap();
            assert!(s >= r && recorded_rows(s) == Some(s), "{r} rows go to {s}");
        }
    }
}
