//! Decode steps recorded as CUDA graphs and replayed: the step inputs (the
//! pass's first position and one-token id on the device, written by
//! `set_step` so a replay serves any position), the recording arena, and
//! each sequence's recorded steps by the attention plan they were recorded
//! for.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use cudarc::driver::CudaGraph;
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};

use super::attention_plan::decode_step_key;
use super::elementwise::SetStepArgs;
use super::kernels::cfg;
use super::{BufferPool, CudaAct, CudaBackend};
use crate::backend::DEVICE_PICK;
use crate::{Error, Result};

/// The token id the step inputs hold after a pick fed on the device
/// (sampling.rs `sample_ahead_on_device`): the host does not
/// know it ([`DEVICE_PICK`]).
const PICK_ON_DEVICE: i32 = -1;

/// One sequence's recorded decode steps, by the number of attention key
/// chunks they were recorded for (see [`decode_step_key`]).
#[derive(Default)]
pub struct CudaStep {
    recorded: HashMap<usize, Recorded>,
    /// A batch state's recorded batched decode steps (batch_graph.rs).
    pub(super) batches: super::batch_graph::RecordedBatches,
}

/// A captured decode step: the graph, the activations it leaves the logits in,
/// and the arena holding every buffer the graph addresses.
pub(super) struct Recorded {
    pub(super) graph: CudaGraph,
    pub(super) out: CudaAct,
    pub(super) _arena: Arc<BufferPool>,
}

// SAFETY: a graph is used only through its sequence's state, which one thread
// at a time holds (`&mut`), and only on the backend's one stream.
unsafe impl Send for CudaStep {}

impl CudaBackend {
    /// [`crate::backend::Backend::run_step`]: `body` run as it comes, or
    /// replayed from the recorded step that serves its cache length.
    pub(super) fn run_step_op<R>(
        &self,
        step: &mut CudaStep,
        start: usize,
        tokens: &[u32],
        replayable: bool,
        body: &mut dyn FnMut() -> Result<CudaAct>,
        finish: &mut dyn FnMut(&CudaAct) -> Result<R>,
    ) -> Result<R> {
        // Passes share the step inputs and the recording state: one at a time.
        let _pass = self.pass.lock().map_err(|_| Error::Invalid("cuda: a pass panicked".into()))?;
        self.ensure_step(start, (tokens.len() == 1).then(|| tokens[0]));
        if !replayable || !self.graphs || self.failed() {
            let out = body()?;
            return finish(&out);
        }
        let key = decode_step_key(start + tokens.len());
        if let Some(rec) = step.recorded.get(&key) {
            let r = rec.graph.launch();
            self.record(r, "replaying a decode step");
            self.replays.fetch_add(1, Ordering::Relaxed);
            return finish(&rec.out);
        }
        // Warm-up: this token's pass runs for real, every buffer it takes from
        // a fresh arena; then the same pass is captured (not run) and finds
        // the same buffers free in the same order (so `finish`, which may
        // take buffers of its own, runs outside the arena). `finish` may also
        // set the next pass's step inputs (a pick fed on the device): the
        // capture sees this pass's, which its replays are given (above).
        let arena = Arc::new(BufferPool::arena());
        let pass_inputs = self.step_inputs();
        self.set_recording(Some((arena.clone(), false)));
        let warm = body();
        self.set_recording(None);
        let result = finish(&warm?)?;
        if self.failed() {
            return Ok(result);
        }
        let next_inputs = self.set_step_inputs(pass_inputs);
        let (out, graph) = self.capture(&arena, "a decode step", body);
        self.set_step_inputs(next_inputs);
        match (out, graph) {
            (Ok(out), Ok(Some(graph))) if !self.failed() => {
                step.recorded.insert(key, Recorded { graph, out, _arena: arena });
            }
            (out, graph) => {
                out?;
                self.record(graph.map(|_| ()), "capturing a decode step");
            }
        }
        Ok(result)
    }

    /// `body` captured on the stream (not run), every buffer it takes from
    /// `arena`: its output activations and the graph (or why there is none).
    pub(super) fn capture(
        &self,
        arena: &Arc<BufferPool>,
        what: &str,
        body: &mut dyn FnMut() -> Result<CudaAct>,
    ) -> (Result<CudaAct>, std::result::Result<Option<CudaGraph>, cudarc::driver::DriverError>) {
        self.set_recording(Some((arena.clone(), true)));
        let began = self.stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
        self.record(began, &format!("starting the capture of {what}"));
        let out = body();
        let graph = self.stream.end_capture(CUgraphInstantiate_flags(0));
        self.set_recording(None);
        (out, graph)
    }

    /// Makes the device step inputs hold `start` (and `id`, when given), with
    /// a `set_step` launch when they differ from what was last written.
    pub(super) fn ensure_step(&self, start: usize, id: Option<u32>) {
        let Ok(mut written) = self.step_written.lock() else {
            return self.record(Err("step lock poisoned"), "step inputs");
        };
        if id == Some(DEVICE_PICK) {
            // Only a sampling kernel writes this token, and only the device knows it.
            if *written != Some([start as i32, PICK_ON_DEVICE]) {
                drop(written);
                let e = format!("no pick on the device feeds position {start}");
                self.record(Err(e), "feeding a pick made on the device");
            }
            return;
        }
        let old_id = written.map(|w| w[1]).unwrap_or(0);
        let want = [start as i32, id.map(|i| i as i32).unwrap_or(old_id)];
        if *written == Some(want) {
            return;
        }
        if self.capturing() {
            // A launch captured here would replay these values at every token.
            return self.record(Err("the step inputs changed inside the recorded pass"), "recording a decode step");
        }
        *written = Some(want);
        drop(written);
        let args = SetStepArgs { step: self.p(&self.step), start: want[0], id: want[1] };
        self.launch(&self.k.elementwise.set_step, cfg((1, 1, 1), 1, 0), &args);
        self.after_step_write.store(true, Ordering::Relaxed);
    }

    /// What the host last wrote (or knows) of the device step inputs.
    pub(super) fn step_inputs(&self) -> Option<[i32; 2]> {
        self.step_written.lock().ok().and_then(|w| *w)
    }

    /// Sets what the host takes the device step inputs to hold, returning
    /// what it took before (no launch: for a capture, which does not run).
    fn set_step_inputs(&self, inputs: Option<[i32; 2]>) -> Option<[i32; 2]> {
        match self.step_written.lock() {
            Ok(mut written) => std::mem::replace(&mut *written, inputs),
            Err(_) => None,
        }
    }

    /// Notes that a sampling kernel has just written the step inputs of position
    /// `start` on the device.
    pub(super) fn step_fed_on_device(&self, start: usize) {
        match self.step_written.lock() {
            Ok(mut written) => *written = Some([start as i32, PICK_ON_DEVICE]),
            Err(_) => self.record(Err("step lock poisoned"), "step inputs"),
        }
        self.after_step_write.store(true, Ordering::Relaxed);
    }

    /// Whether the stream is capturing a decode step (nothing may be
    /// allocated, synchronized or changed on the host's side then).
    pub(super) fn capturing(&self) -> bool {
        self.recording.lock().ok().and_then(|r| r.as_ref().map(|r| r.1)).unwrap_or(false)
    }

    pub(super) fn set_recording(&self, to: Option<(Arc<BufferPool>, bool)>) {
        match self.recording.lock() {
            Ok(mut r) => *r = to,
            Err(_) => self.record(Err("recording lock poisoned"), "recording a decode step"),
        }
    }
}
