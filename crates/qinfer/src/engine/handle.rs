//! The engine on its own thread: a handle adds requests (and gets each one's
//! stream of outputs) or aborts them, from any thread; the step loop runs
//! while any request is unfinished and sleeps otherwise. A request whose
//! receiver is dropped is aborted, so a client that goes away frees its
//! blocks at the next step.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use super::core::{EngineConfig, EngineCore, validate};
use super::request::{Output, Request, RequestId};
use crate::models::LanguageModel;
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};

/// One item of a request's stream: an output, or the error that ended it.
pub type StreamItem = std::result::Result<Output, String>;

/// Where a request's outputs go; returns false once nobody listens.
pub type Sink = Box<dyn FnMut(StreamItem) -> bool + Send>;

enum Command {
    Add(RequestId, Box<Request>, Sink),
    Abort(RequestId),
    AbortAll,
}

/// What the engine is doing, updated by its thread after every step (for
/// `/metrics`).
#[derive(Debug, Default)]
pub struct EngineMetrics {
    pub running: AtomicUsize,
    pub waiting: AtomicUsize,
    pub kv_blocks_used: AtomicUsize,
    pub kv_blocks_total: AtomicUsize,
    pub prompt_tokens_total: AtomicU64,
    pub generation_tokens_total: AtomicU64,
    pub preemptions_total: AtomicU64,
    pub requests_finished_total: AtomicU64,
    pub requests_aborted_total: AtomicU64,
    /// Prompt tokens looked up in the prefix cache, and those found.
    pub prefix_cache_queried_tokens_total: AtomicU64,
    pub prefix_cache_hit_tokens_total: AtomicU64,
    /// KV blocks kept in the prefix cache, and those evicted so far.
    pub prefix_cache_blocks: AtomicUsize,
    pub prefix_cache_evictions_total: AtomicU64,
    /// Recurrent-state snapshots kept (hybrid models), their bytes, and
    /// those evicted so far.
    pub state_snapshots: AtomicUsize,
    pub state_snapshot_bytes: AtomicUsize,
    pub state_snapshot_evictions_total: AtomicU64,
    /// The prefix cache's host tier: bytes held, entries copied in and
    /// copied back.
    pub host_tier_bytes: AtomicUsize,
    pub host_tier_stored_total: AtomicU64,
    pub host_tier_restored_total: AtomicU64,
    /// Speculative decoding: draft tokens verified, and those accepted.
    pub spec_draft_tokens_total: AtomicU64,
    pub spec_accepted_tokens_total: AtomicU64,
}

/// A handle to the engine thread. Dropping it lets the thread finish the
/// requests it has and stop.
pub struct Engine {
    commands: Mutex<Option<Sender<Command>>>,
    thread: Mutex<Option<JoinHandle<EngineStats>>>,
    next_id: AtomicU64,
    cfg: EngineConfig,
    vocab: usize,
    kv_bytes: usize,
    tokenizer: Option<Arc<Tokenizer>>,
    model: Arc<dyn LanguageModel>,
    metrics: Arc<EngineMetrics>,
}

/// Copies the core's gauges into `metrics`.
fn publish(core: &EngineCore, metrics: &EngineMetrics) {
    metrics.running.store(core.num_running(), Ordering::Relaxed);
    metrics.waiting.store(core.num_waiting(), Ordering::Relaxed);
    metrics.kv_blocks_used.store(core.blocks_used().0, Ordering::Relaxed);
    metrics.preemptions_total.store(core.preemptions() as u64, Ordering::Relaxed);
    let spec = core.speculative_stats();
    metrics.spec_draft_tokens_total.store(spec.drafted, Ordering::Relaxed);
    metrics.spec_accepted_tokens_total.store(spec.accepted, Ordering::Relaxed);
    if let Some(p) = core.prefix_stats() {
        metrics.prefix_cache_queried_tokens_total.store(p.queried_tokens, Ordering::Relaxed);
        metrics.prefix_cache_hit_tokens_total.store(p.hit_tokens, Ordering::Relaxed);
    }
    let (cached, evicted) = core.cached_blocks();
    metrics.prefix_cache_blocks.store(cached, Ordering::Relaxed);
    metrics.prefix_cache_evictions_total.store(evicted, Ordering::Relaxed);
    let snapshots = core.snapshots();
    metrics.state_snapshots.store(snapshots.kept, Ordering::Relaxed);
    metrics.state_snapshot_bytes.store(snapshots.kept * snapshots.bytes_each, Ordering::Relaxed);
    metrics.state_snapshot_evictions_total.store(snapshots.evicted, Ordering::Relaxed);
    if let Some((bytes, _, stats)) = core.host_tier() {
        metrics.host_tier_bytes.store(bytes, Ordering::Relaxed);
        metrics.host_tier_stored_total.store(stats.stored, Ordering::Relaxed);
        metrics.host_tier_restored_total.store(stats.restored, Ordering::Relaxed);
    }
}

/// What the engine thread reports when it stops.
#[derive(Debug, Clone, Copy, Default)]
pub struct EngineStats {
    pub preemptions: usize,
    /// Every block and state slot was free when it stopped.
    pub pools_whole: bool,
}

impl Engine {
    /// Starts the step loop for `model` on its own thread. Fails (before
    /// starting it) when the model cannot run batched forwards or the KV
    /// pool cannot be made.
    pub fn start(model: Arc<dyn LanguageModel>, tokenizer: Option<Arc<Tokenizer>>, cfg: EngineConfig) -> Result<Self> {
        Self::start_with_draft(model, tokenizer, cfg, None)
    }

    /// [`Engine::start`] with a draft model for speculative decoding
    /// ([`EngineCore::with_draft`]).
    pub fn start_with_draft(
        model: Arc<dyn LanguageModel>,
        tokenizer: Option<Arc<Tokenizer>>,
        cfg: EngineConfig,
        draft: Option<Arc<dyn LanguageModel>>,
    ) -> Result<Self> {
        let core = EngineCore::with_draft(model.clone(), tokenizer.clone(), cfg, draft)?;
        let kv_bytes = core.kv_bytes();
        let vocab = model.config().vocab_size;
        let (tx, rx) = channel();
        let metrics = Arc::new(EngineMetrics::default());
        metrics.kv_blocks_total.store(core.blocks_used().1, Ordering::Relaxed);
        let m = metrics.clone();
        let thread = std::thread::Builder::new()
            .name("qinfer-engine".into())
            .spawn(move || step_loop(core, rx, &m))
            .map_err(|e| Error::Invalid(format!("starting the engine thread: {e}")))?;
        Ok(Engine {
            commands: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
            next_id: AtomicU64::new(0),
            cfg,
            vocab,
            kv_bytes,
            tokenizer,
            model,
            metrics,
        })
    }

    /// Counters and gauges the engine thread keeps up to date.
    pub fn metrics(&self) -> &EngineMetrics {
        &self.metrics
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    pub fn model(&self) -> &Arc<dyn LanguageModel> {
        &self.model
    }

    pub fn tokenizer(&self) -> Option<&Arc<Tokenizer>> {
        self.tokenizer.as_ref()
    }

    /// Bytes of the KV pool.
    pub fn kv_bytes(&self) -> usize {
        self.kv_bytes
    }

    /// Adds a request whose outputs go to `sink`. A request the engine's
    /// limits rule out is refused here, with an error naming the limit.
    pub fn add_with_sink(&self, req: Request, sink: Sink) -> Result<RequestId> {
        validate(&req, &self.cfg, self.vocab)?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.send(Command::Add(id, Box::new(req), sink))?;
        Ok(id)
    }

    /// Adds a request; its outputs arrive on the receiver, the last one
    /// carrying the finish reason.
    pub fn add(&self, req: Request) -> Result<(RequestId, Receiver<StreamItem>)> {
        let (tx, rx) = channel();
        let id = self.add_with_sink(req, Box::new(move |item| tx.send(item).is_ok()))?;
        Ok((id, rx))
    }

    /// Ends a request at the next step boundary (its stream then ends with
    /// finish reason `Abort`); unknown or finished ids are ignored.
    pub fn abort(&self, id: RequestId) {
        let _ = self.send(Command::Abort(id));
    }

    /// Aborts every request the engine has (a server shutting down).
    pub fn abort_all(&self) {
        let _ = self.send(Command::AbortAll);
    }

    fn send(&self, cmd: Command) -> Result<()> {
        let guard = self.commands.lock().map_err(|_| Error::Invalid("the engine handle is poisoned".into()))?;
        match guard.as_ref() {
            Some(tx) => tx.send(cmd).map_err(|_| Error::Invalid("the engine thread has stopped".into())),
            None => Err(Error::Invalid("the engine is shutting down".into())),
        }
    }

    /// Lets the thread finish every request it has, then stops it.
    pub fn shutdown(&self) -> EngineStats {
        if let Ok(mut tx) = self.commands.lock() {
            tx.take();
        }
        let thread = self.thread.lock().ok().and_then(|mut t| t.take());
        thread.and_then(|t| t.join().ok()).unwrap_or_default()
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn step_loop(mut core: EngineCore, rx: Receiver<Command>, metrics: &EngineMetrics) -> EngineStats {
    let mut sinks: std::collections::HashMap<RequestId, Sink> = std::collections::HashMap::new();
    let mut open = true;
    loop {
        // Take every command waiting; when idle, sleep until one comes.
        loop {
            let cmd = if core.num_unfinished() == 0 && open {
                // Idle: the gauges say so before the thread sleeps.
                publish(&core, metrics);
                match rx.recv() {
                    Ok(c) => c,
                    Err(_) => {
                        open = false;
                        break;
                    }
                }
            } else {
                match rx.try_recv() {
                    Ok(c) => c,
                    Err(std::sync::mpsc::TryRecvError::Empty) => break,
                    Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
            };
            match cmd {
                Command::Add(id, req, mut sink) => match core.add(id, *req) {
                    Ok(()) => {
                        sinks.insert(id, sink);
                    }
                    Err(e) => {
                        sink(Err(e.to_string()));
                    }
                },
                Command::Abort(id) => {
                    if let (Some(out), Some(mut sink)) = (core.abort(id), sinks.remove(&id)) {
                        metrics.requests_aborted_total.fetch_add(1, Ordering::Relaxed);
                        sink(Ok(out));
                    }
                }
                Command::AbortAll => {
                    for id in core.request_ids() {
                        if let (Some(out), Some(mut sink)) = (core.abort(id), sinks.remove(&id)) {
                            metrics.requests_aborted_total.fetch_add(1, Ordering::Relaxed);
                            sink(Ok(out));
                        }
                    }
                }
            }
        }
        publish(&core, metrics);
        if core.num_unfinished() == 0 {
            if open {
                continue;
            }
            return EngineStats { preemptions: core.preemptions(), pools_whole: core.pools_whole() };
        }
        let result = core.step();
        for (id, e) in core.take_failed() {
            if let Some(mut sink) = sinks.remove(&id) {
                sink(Err(e.to_string()));
            }
        }
        match result {
            Ok(outputs) => {
                for out in outputs {
                    let (id, done) = (out.id, out.finish.is_some());
                    metrics.generation_tokens_total.fetch_add(out.token_ids.len() as u64, Ordering::Relaxed);
                    if done {
                        metrics.requests_finished_total.fetch_add(1, Ordering::Relaxed);
                    }
                    // A request's first output (its prompt has just been computed).
                    if out.usage.completion_tokens == out.token_ids.len() && !out.token_ids.is_empty() {
                        metrics.prompt_tokens_total.fetch_add(out.usage.prompt_tokens as u64, Ordering::Relaxed);
                    }
                    let listening = sinks.get_mut(&id).is_some_and(|sink| sink(Ok(out)));
                    if done {
                        sinks.remove(&id);
                    } else if !listening {
                        sinks.remove(&id);
                        core.abort(id);
                        metrics.requests_aborted_total.fetch_add(1, Ordering::Relaxed);
                    }
                }
                publish(&core, metrics);
            }
            Err(e) => {
                // A failed step ends every request it had: report the error to each.
                tracing::error!("engine step failed: {e}");
                let msg = e.to_string();
                for (id, mut sink) in sinks.drain() {
                    core.abort(id);
                    sink(Err(msg.clone()));
                }
            }
        }
    }
}
