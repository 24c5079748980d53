//! A request's trip through the engine as both APIs' handlers see it:
//! submitting its choices, collecting a whole result, merging the choices'
//! streams, the SSE response, and the request timeout.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use qinfer::engine::request::{FinishReason, Output, Request, TokenLogprob, Usage};
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, UnboundedReceiverStream};

use crate::bridge::{AbortOnDrop, Submitted, submit};
use crate::error::{ApiError, ApiResult, Flavor};
use crate::{AppState, Ready};

/// Submits `n` copies of a request (seeds `seed`, `seed + 1`, …): engine
/// errors (a prompt over the context, say) are the client's, named.
pub fn submit_n(state: &AppState, ready: &Ready, req: Request, n: usize, flavor: Flavor) -> ApiResult<Vec<Submitted>> {
    (0..n)
        .map(|i| {
            let mut r = req.clone();
            r.sampling.seed = r.sampling.seed.wrapping_add(i as u64);
            submit(&ready.engine, r, &state.latency, state.opts.request_timeout)
                .map_err(|e| ApiError::bad_request(flavor, None, e.to_string()))
        })
        .collect()
}

/// A request's whole result.
pub struct Collected {
    pub text: String,
    pub token_ids: Vec<u32>,
    pub logprobs: Vec<TokenLogprob>,
    pub finish: FinishReason,
    pub stop_string: Option<String>,
    pub usage: Usage,
}

/// The error a request that ran past the timeout gets.
pub fn timeout_error(flavor: Flavor) -> ApiError {
    ApiError::with_status(
        flavor,
        axum::http::StatusCode::GATEWAY_TIMEOUT,
        "the request ran past this server's request timeout and was stopped",
    )
}

/// Whether an output ends a request the timeout aborted.
pub fn timed_out(out: &Output, flag: &AtomicBool) -> bool {
    out.finish == Some(FinishReason::Abort) && flag.load(std::sync::atomic::Ordering::Relaxed)
}

pub async fn collect(mut s: Submitted, flavor: Flavor) -> ApiResult<Collected> {
    let mut text = String::new();
    let (mut logprobs, mut token_ids) = (Vec::new(), Vec::new());
    while let Some(item) = s.rx.recv().await {
        let out = item.map_err(|e| ApiError::with_status(flavor, axum::http::StatusCode::INTERNAL_SERVER_ERROR, e))?;
        if timed_out(&out, &s.timed_out) {
            return Err(timeout_error(flavor));
        }
        text.push_str(&out.text);
        logprobs.extend(out.logprobs);
        token_ids.extend(out.token_ids);
        if let Some(finish) = out.finish {
            return Ok(Collected { text, token_ids, logprobs, finish, stop_string: out.stop_string, usage: out.usage });
        }
    }
    Err(ApiError::with_status(flavor, axum::http::StatusCode::SERVICE_UNAVAILABLE, "the engine stopped"))
}

/// Every choice's outputs on one stream, tagged with the choice's index;
/// the choices' abort guards and timeout flags.
pub fn merged(
    subs: Vec<Submitted>,
) -> (impl futures_util::Stream<Item = (usize, Result<Output, String>)> + Send + 'static, Guards) {
    let mut streams = Vec::new();
    let mut guards = Guards::default();
    for (i, s) in subs.into_iter().enumerate() {
        streams.push(UnboundedReceiverStream::new(s.rx).map(move |item| (i, item)));
        guards.aborts.push(s.guard);
        guards.timed_out.push(s.timed_out);
    }
    (futures_util::stream::select_all(streams), guards)
}

#[derive(Default)]
pub struct Guards {
    pub aborts: Vec<AbortOnDrop>,
    pub timed_out: Vec<Arc<AtomicBool>>,
}

/// An SSE response whose events `produce` sends; when the client goes away
/// the sender fails and `produce` ends, dropping what it holds.
pub fn sse<Fut>(produce: impl FnOnce(mpsc::Sender<Event>) -> Fut) -> Response
where
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = mpsc::channel::<Event>(64);
    tokio::spawn(produce(tx));
    Sse::new(ReceiverStream::new(rx).map(Ok::<_, Infallible>)).keep_alive(KeepAlive::default()).into_response()
}
