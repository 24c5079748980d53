//! Between async handlers and the engine thread: a request's outputs arrive
//! on a channel the handler awaits, and a request whose handler goes away
//! (client disconnected, response dropped) is aborted at once.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use qinfer::engine::handle::{Engine, StreamItem};
use qinfer::engine::request::{Request, RequestId};
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

use crate::latency::{Latency, RequestClock};

/// A request in the engine: its outputs, and the guard that aborts it when dropped.
pub struct Submitted {
    pub rx: UnboundedReceiver<StreamItem>,
    pub guard: AbortOnDrop,
    /// Set when the request was aborted for running past the timeout.
    pub timed_out: Arc<AtomicBool>,
}

pub struct AbortOnDrop {
    engine: Arc<Engine>,
    id: RequestId,
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        // A finished request is no longer known to the engine: a no-op then.
        self.engine.abort(self.id);
    }
}

/// Sends `req` to the engine; its outputs are timed into `latency` as they
/// leave; past `timeout` it is aborted (and marked so).
pub fn submit(
    engine: &Arc<Engine>,
    req: Request,
    latency: &Arc<Latency>,
    timeout: Option<Duration>,
) -> qinfer::Result<Submitted> {
    let (tx, rx) = unbounded_channel();
    let (latency, mut clock) = (latency.clone(), RequestClock::new());
    let sink = move |item: StreamItem| {
        if let Ok(out) = &item {
            clock.output(&latency, out.token_ids.len(), out.finish.is_some());
        }
        tx.send(item).is_ok()
    };
    let id = engine.add_with_sink(req, Box::new(sink))?;
    let timed_out = Arc::new(AtomicBool::new(false));
    if let Some(t) = timeout {
        let (engine, flag) = (Arc::downgrade(engine), timed_out.clone());
        tokio::spawn(async move {
            tokio::time::sleep(t).await;
            // A finished request is unknown to the engine by then: a no-op.
            if let Some(e) = engine.upgrade() {
                flag.store(true, Ordering::Relaxed);
                e.abort(id);
            }
        });
    }
    Ok(Submitted { rx, guard: AbortOnDrop { engine: engine.clone(), id }, timed_out })
}
