//! `qinfer serve`: an OpenAI- and Anthropic-compatible HTTP server over the
//! engine's handle (add a request, stream its outputs, abort it). The HTTP
//! schemas live here and talk to nothing but the engine and the tokenizer.
//!
//! The server binds first and answers `/health` with 503 until the model
//! has loaded; `/v1/*` asks for the API key when one is set.

mod anthropic;
mod bridge;
mod chat_prompt;
mod chat_stream;
mod error;
mod exchange;
mod images;
mod latency;
mod logprobs;
mod lora;
mod openai;
mod params;
mod pooling;
mod reasoning;
mod structured;
mod tool_parser;
mod tools;

pub use images::ImageSupport;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use qinfer::engine::handle::Engine;
use qinfer::engine::pooling::{PoolingConfig, RerankFormat};
use qinfer::engine::request::{FinishReason, SamplingParams};
use serde_json::json;

pub use error::{ApiError, Flavor};

/// How the server listens and what it promises.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub host: String,
    pub port: u16,
    /// The model's name in requests and `/v1/models`.
    pub served_model_name: String,
    /// When set, `/v1/*` needs `Authorization: Bearer KEY` or `x-api-key: KEY`.
    pub api_key: Option<String>,
    /// Requests waiting beyond this are refused with 503 and `Retry-After`.
    pub max_waiting: usize,
    /// Most choices (`n`) one request may ask for.
    pub max_n: usize,
    /// Largest request body, in bytes.
    pub max_body_bytes: usize,
    /// A request still running after this long is aborted (504, or an
    /// error event when streaming).
    pub request_timeout: Option<Duration>,
    /// `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` may change the
    /// served adapters.
    pub allow_lora_updates: bool,
}

/// What the served model does: its endpoints follow.
#[derive(Debug, Clone)]
pub enum ServedTask {
    /// Chat, completions, messages.
    Generate,
    /// `/v1/embeddings`, pooling as configured.
    Embed(PoolingConfig),
    /// `/v1/rerank`.
    Rerank(RerankFormat),
}

/// What loading produces: the running engine and the model's defaults.
pub struct Loaded {
    pub engine: Engine,
    /// Sampling defaults (the model's generation_config.json).
    pub defaults: SamplingParams,
    /// Token ids that end generation (the model's EOS ids).
    pub stop_token_ids: Vec<u32>,
    pub task: ServedTask,
    /// LoRA adapters placed beside the model's weights, each served under
    /// its own model name.
    pub adapters: Vec<ServedAdapter>,
    /// How images are taken, where the model takes them.
    pub images: Option<ImageSupport>,
}

/// A LoRA adapter a request picks by naming it as its `model`.
#[derive(Debug, Clone)]
pub struct ServedAdapter {
    pub name: String,
    pub id: qinfer::engine::request::AdapterId,
    pub path: std::path::PathBuf,
}

struct Ready {
    engine: Arc<Engine>,
    defaults: SamplingParams,
    stop_token_ids: Vec<u32>,
    task: ServedTask,
    /// The grammar engine's view of the vocabulary, made on first use.
    grammars: OnceLock<Result<structured::Grammars, String>>,
    adapters: std::sync::RwLock<Vec<ServedAdapter>>,
    images: Option<ImageSupport>,
}

impl Ready {
    /// The grammar engine for constrained output (a 400 naming `field` where
    /// this model's tokenizer cannot serve one).
    fn grammars(&self, flavor: Flavor, field: &str) -> Result<&structured::Grammars, ApiError> {
        let made = self.grammars.get_or_init(|| {
            let tok = self.engine.tokenizer().ok_or("this model has no tokenizer")?;
            let eos = *self.stop_token_ids.first().ok_or("this model has no end-of-text token")?;
            structured::Grammars::new(tok, self.engine.model().config().vocab_size, eos)
        });
        made.as_ref()
            .map_err(|e| ApiError::bad_request(flavor, Some(field), format!("constrained output is unavailable: {e}")))
    }

    /// Refuses generation endpoints on a pooling model.
    fn check_generates(&self, flavor: Flavor) -> Result<(), ApiError> {
        match &self.task {
            ServedTask::Generate => Ok(()),
            ServedTask::Embed(_) => {
                Err(ApiError::bad_request(flavor, None, "this server runs an embedding model: use /v1/embeddings"))
            }
            ServedTask::Rerank(_) => {
                Err(ApiError::bad_request(flavor, None, "this server runs a reranking model: use /v1/rerank"))
            }
        }
    }
}

pub(crate) struct AppState {
    ready: OnceLock<Ready>,
    opts: ServeOptions,
    next_id: AtomicU64,
    /// Set when loading failed: /health reports it.
    load_error: OnceLock<String>,
    latency: Arc<latency::Latency>,
}

impl AppState {
    /// The engine, or 503 while the model loads.
    fn ready(&self, flavor: Flavor) -> Result<&Ready, ApiError> {
        match self.ready.get() {
            Some(r) => Ok(r),
            None => Err(ApiError::with_status(flavor, StatusCode::SERVICE_UNAVAILABLE, "the model is still loading")),
        }
    }

    /// Checks the requested model name against the ones served: the base
    /// model (None) or a LoRA adapter (its id).
    fn check_model(
        &self,
        flavor: Flavor,
        model: Option<&str>,
    ) -> Result<Option<qinfer::engine::request::AdapterId>, ApiError> {
        let guard = self.ready.get().map(|r| r.adapters.read().unwrap_or_else(|e| e.into_inner()));
        let adapters = guard.as_deref().map_or(&[][..], |a| &a[..]);
        match model {
            Some(m) if m != self.opts.served_model_name => match adapters.iter().find(|a| a.name == m) {
                Some(a) => Ok(Some(a.id)),
                None => {
                    let mut names = vec![format!("`{}`", self.opts.served_model_name)];
                    names.extend(adapters.iter().map(|a| format!("`{}`", a.name)));
                    Err(ApiError {
                        status: StatusCode::NOT_FOUND,
                        message: format!("the model `{m}` does not exist; this server serves {}", names.join(", ")),
                        param: Some("model".into()),
                        flavor,
                    })
                }
            },
            _ => Ok(None),
        }
    }

    /// Refuses new work while too many requests wait.
    fn admit(&self, flavor: Flavor, ready: &Ready) -> Result<(), ApiError> {
        let waiting = ready.engine.metrics().waiting.load(Ordering::Relaxed);
        if waiting >= self.opts.max_waiting {
            return Err(ApiError::with_status(
                flavor,
                StatusCode::SERVICE_UNAVAILABLE,
                format!("{waiting} requests are waiting (the limit is {}); retry later", self.opts.max_waiting),
            ));
        }
        Ok(())
    }

    fn id(&self, prefix: &str) -> String {
        format!("{prefix}-{:x}{:06x}", now_secs(), self.next_id.fetch_add(1, Ordering::Relaxed))
    }
}

fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// A seed for a request that gave none: requests differ, as clients expect.
fn fresh_seed() -> u64 {
    let t = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    t ^ t.rotate_left(29).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// The finish reason as OpenAI names it.
fn openai_finish(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::Abort => "abort",
    }
}

/// The router over `state` (exposed for tests through [`serve_on`]).
fn router(state: Arc<AppState>) -> Router {
    let limit = state.opts.max_body_bytes;
    let v1 = Router::new()
        .route("/v1/models", get(openai::models))
        .route("/v1/chat/completions", post(openai::chat))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/v1/embeddings", post(pooling::embeddings))
        .route("/v1/rerank", post(pooling::rerank))
        .route("/v1/load_lora_adapter", post(lora::load))
        .route("/v1/unload_lora_adapter", post(lora::unload))
        .route("/rerank", post(pooling::rerank))
        .layer(axum::middleware::from_fn_with_state(state.clone(), auth));
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .merge(v1)
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

/// Equal bytes in time that depends on the length only.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn auth(State(state): State<Arc<AppState>>, headers: HeaderMap, req: Request, next: Next) -> Response {
    let Some(key) = &state.opts.api_key else { return next.run(req).await };
    let flavor = if req.uri().path().starts_with("/v1/messages") { Flavor::Anthropic } else { Flavor::OpenAi };
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let given = header("authorization").and_then(|v| v.strip_prefix("Bearer ")).or_else(|| header("x-api-key"));
    match given {
        Some(g) if constant_time_eq(g.trim().as_bytes(), key.as_bytes()) => next.run(req).await,
        _ => ApiError::with_status(flavor, StatusCode::UNAUTHORIZED, "a valid API key is required").into_response(),
    }
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    if let Some(e) = state.load_error.get() {
        return (StatusCode::SERVICE_UNAVAILABLE, axum::Json(json!({"status": "error", "error": e}))).into_response();
    }
    match state.ready.get() {
        Some(_) => (StatusCode::OK, axum::Json(json!({"status": "ok"}))).into_response(),
        None => (StatusCode::SERVICE_UNAVAILABLE, axum::Json(json!({"status": "loading"}))).into_response(),
    }
}

/// Prometheus text format, in the `qinfer:` namespace (names modelled on vLLM's).
async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let Some(ready) = state.ready.get() else {
        return (StatusCode::SERVICE_UNAVAILABLE, "the model is still loading\n").into_response();
    };
    let m = ready.engine.metrics();
    let g = |a: &std::sync::atomic::AtomicUsize| a.load(Ordering::Relaxed) as f64;
    let c = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64;
    let (used, total) = (g(&m.kv_blocks_used), g(&m.kv_blocks_total));
    let rows: [(&str, &str, &str, f64); 21] = [
        ("num_requests_running", "gauge", "Requests in the running batch.", g(&m.running)),
        ("num_requests_waiting", "gauge", "Requests waiting to run.", g(&m.waiting)),
        ("kv_cache_usage_perc", "gauge", "Fraction of KV blocks held.", if total > 0.0 { used / total } else { 0.0 }),
        ("kv_blocks_used", "gauge", "KV blocks held.", used),
        ("prompt_tokens_total", "counter", "Prompt tokens computed.", c(&m.prompt_tokens_total)),
        ("generation_tokens_total", "counter", "Tokens generated.", c(&m.generation_tokens_total)),
        ("num_preemptions_total", "counter", "Requests preempted and recomputed.", c(&m.preemptions_total)),
        ("request_success_total", "counter", "Requests that finished.", c(&m.requests_finished_total)),
        (
            "request_aborted_total",
            "counter",
            "Requests aborted (cancelled or disconnected).",
            c(&m.requests_aborted_total),
        ),
        (
            "prefix_cache_queries_total",
            "counter",
            "Prompt tokens looked up in the prefix cache.",
            c(&m.prefix_cache_queried_tokens_total),
        ),
        (
            "prefix_cache_hits_total",
            "counter",
            "Prompt tokens served from the prefix cache.",
            c(&m.prefix_cache_hit_tokens_total),
        ),
        ("prefix_cache_blocks", "gauge", "KV blocks kept in the prefix cache.", g(&m.prefix_cache_blocks)),
        (
            "prefix_cache_evictions_total",
            "counter",
            "Cached KV blocks evicted to make room.",
            c(&m.prefix_cache_evictions_total),
        ),
        ("state_snapshots", "gauge", "Recurrent-state snapshots kept (hybrid models).", g(&m.state_snapshots)),
        ("state_snapshot_bytes", "gauge", "Bytes of the recurrent-state snapshots kept.", g(&m.state_snapshot_bytes)),
        (
            "state_snapshot_evictions_total",
            "counter",
            "Recurrent-state snapshots evicted to make room.",
            c(&m.state_snapshot_evictions_total),
        ),
        ("prefix_cache_host_bytes", "gauge", "Bytes in the prefix cache's host tier.", g(&m.host_tier_bytes)),
        (
            "prefix_cache_host_stored_total",
            "counter",
            "Blocks and snapshots copied to the host tier.",
            c(&m.host_tier_stored_total),
        ),
        (
            "prefix_cache_host_restored_total",
            "counter",
            "Blocks and snapshots copied back from the host tier.",
            c(&m.host_tier_restored_total),
        ),
        (
            "spec_decode_num_draft_tokens_total",
            "counter",
            "Speculative draft tokens verified.",
            c(&m.spec_draft_tokens_total),
        ),
        (
            "spec_decode_num_accepted_tokens_total",
            "counter",
            "Speculative draft tokens accepted.",
            c(&m.spec_accepted_tokens_total),
        ),
    ];
    let mut out = String::new();
    for (name, kind, help, v) in rows {
        out.push_str(&format!("# HELP qinfer:{name} {help}\n# TYPE qinfer:{name} {kind}\nqinfer:{name} {v}\n"));
    }
    state.latency.render(&mut out);
    ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], out).into_response()
}

/// Serves on `opts.host:opts.port` until `shutdown` resolves: binds first
/// (`on_bound` hears the address), then loads the model with `load` on a
/// worker thread while `/health` says 503. On shutdown every request still
/// running is aborted, so its stream ends, and the server stops.
pub async fn serve<L, S, B>(opts: ServeOptions, load: L, on_bound: B, shutdown: S) -> std::io::Result<()>
where
    L: FnOnce() -> Result<Loaded, String> + Send + 'static,
    S: std::future::Future<Output = ()> + Send + 'static,
    B: FnOnce(SocketAddr),
{
    let listener = tokio::net::TcpListener::bind((opts.host.as_str(), opts.port)).await?;
    on_bound(listener.local_addr()?);
    let state = Arc::new(AppState {
        ready: OnceLock::new(),
        opts,
        next_id: AtomicU64::new(0),
        load_error: OnceLock::new(),
        latency: Default::default(),
    });
    let loading = state.clone();
    tokio::task::spawn_blocking(move || match load() {
        Ok(l) => {
            let ready = Ready {
                engine: Arc::new(l.engine),
                defaults: l.defaults,
                stop_token_ids: l.stop_token_ids,
                task: l.task,
                grammars: OnceLock::new(),
                adapters: std::sync::RwLock::new(l.adapters),
                images: l.images,
            };
            let _ = loading.ready.set(ready);
        }
        Err(e) => {
            tracing::error!("loading the model failed: {e}");
            let _ = loading.load_error.set(e);
        }
    });
    let closing = state.clone();
    let stop = async move {
        shutdown.await;
        if let Some(r) = closing.ready.get() {
            r.engine.abort_all();
        }
        // Give aborted streams a moment to send their last event.
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    axum::serve(listener, router(state)).with_graceful_shutdown(stop).await
}
