//! `qinfer serve`: the OpenAI- and Anthropic-compatible server (qinfer-server)
//! over the continuous-batching engine, on loopback unless told otherwise.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use qinfer::engine::handle::Engine;
use qinfer_server::{ImageSupport, Loaded, ServeOptions};

use crate::common::{EngineArgs, TaskArgs, open_model, stop_tokens};

fn task_name(t: &qinfer_server::ServedTask) -> &'static str {
    match t {
        qinfer_server::ServedTask::Generate => "generating",
        qinfer_server::ServedTask::Embed(_) => "embedding: /v1/embeddings",
        qinfer_server::ServedTask::Rerank(_) => "reranking: /v1/rerank",
    }
}

#[derive(clap::Args)]
pub struct Args {
    /// Model directory, .gguf file or Hugging Face repo id (default: the fetched SmolLM2).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Address to listen on (loopback by default).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// The model's name in requests and /v1/models (default: the file or
    /// directory name).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Require this key (`Authorization: Bearer KEY` or `x-api-key: KEY`) on /v1/*.
    #[arg(long)]
    api_key: Option<String>,
    /// Requests that may wait for a place in the batch; more get 503.
    #[arg(long, default_value_t = 1024)]
    max_waiting: usize,
    /// Most choices (`n`) one request may ask for.
    #[arg(long, default_value_t = 16)]
    max_n: usize,
    /// Seconds a request may run before it is aborted and answered with a
    /// 504 (or, streaming, an error event); 0 for no limit.
    #[arg(long, default_value_t = 0.0)]
    request_timeout: f64,
    /// Largest request body, in MiB.
    #[arg(long, default_value_t = 32)]
    max_body_mib: usize,
    #[command(flatten)]
    task: TaskArgs,
    /// A LoRA adapter served under its own model name, NAME=PATH (PEFT's or
    /// mlx-lm's directory); repeatable. A request picks it with
    /// `"model": "NAME"`; /v1/models lists it.
    #[arg(long = "lora", value_name = "NAME=PATH")]
    loras: Vec<String>,
    /// Let clients load and unload adapters at run time
    /// (`/v1/load_lora_adapter` with a path on this machine,
    /// `/v1/unload_lora_adapter`).
    #[arg(long)]
    allow_lora_updates: bool,
    /// Fetch http(s) image URLs given in requests (off: only data URLs and
    /// base64 images are taken).
    #[arg(long)]
    allow_remote_images: bool,
    /// Most images one request may carry.
    #[arg(long, default_value_t = 8)]
    max_images_per_request: usize,
    /// The vision projector llama.cpp publishes beside a Qwen3.5 GGUF
    /// (`mmproj-*.gguf`): the GGUF takes images with it.
    #[arg(long, value_name = "PATH")]
    mmproj: Option<PathBuf>,
    #[command(flatten)]
    engine: EngineArgs,
}

pub fn main(a: Args, device: qinfer::loader::Device) -> Result<()> {
    let mut model = crate::common::with_mmproj(open_model(a.model.as_ref())?, a.mmproj.as_deref())?;
    let name = a
        .served_model_name
        .clone()
        .or_else(|| {
            // A repo id is served under its name (as vLLM serves it).
            let spec = a.model.as_ref()?.to_str()?;
            crate::hub::looks_like_repo(spec).then(|| spec.split(':').next().unwrap_or(spec).to_string())
        })
        .unwrap_or_else(|| model.path.file_name().map_or_else(|| "model".into(), |f| f.to_string_lossy().into_owned()));
    let opts = ServeOptions {
        host: a.host.clone(),
        port: a.port,
        served_model_name: name.clone(),
        api_key: a.api_key.clone(),
        max_waiting: a.max_waiting,
        max_n: a.max_n,
        max_body_bytes: a.max_body_mib << 20,
        request_timeout: (a.request_timeout > 0.0).then(|| std::time::Duration::from_secs_f64(a.request_timeout)),
        allow_lora_updates: a.allow_lora_updates,
    };
    let mut loras: Vec<(String, PathBuf)> = Vec::new();
    for spec in &a.loras {
        let Some((n, p)) = spec.split_once('=').filter(|(n, p)| !n.is_empty() && !p.is_empty()) else {
            anyhow::bail!("--lora {spec:?}: expected NAME=PATH");
        };
        if n == name || loras.iter().any(|(m, _)| m == n) {
            anyhow::bail!("--lora {spec:?}: the name `{n}` is already served");
        }
        loras.push((n.to_string(), PathBuf::from(p)));
    }
    let (allow_remote_images, max_images_per_request) = (a.allow_remote_images, a.max_images_per_request);
    let engine_args = a.engine.clone();
    let task = a.task.clone();
    let load = move || -> std::result::Result<Loaded, String> {
        let tok = model.tokenizer.take().map(Arc::new);
        let stop_token_ids = stop_tokens(&model, tok.as_deref());
        let model = crate::common::SpeculativeKind::target(engine_args.speculative.as_ref(), model)
            .map_err(|e| format!("{e:#}"))?;
        let lm: Arc<dyn qinfer::models::LanguageModel> =
            Arc::from(model.load(device, false).map_err(|e| format!("loading {}: {e}", model.path.display()))?);
        let task = task.resolve(&model.path, model.gguf_pooling_type, tok.as_deref()).map_err(|e| e.to_string())?;
        let mut adapters = Vec::new();
        for (name, path) in loras {
            let adapter = qinfer::lora::LoraAdapter::load(&path).map_err(|e| format!("--lora {name}: {e}"))?;
            let id = lm.add_adapter(&adapter).map_err(|e| format!("--lora {name}: {e}"))?;
            adapters.push(qinfer_server::ServedAdapter { name, id, path });
        }
        let images = match (&model.config.vision, &model.image_processor) {
            (Some(v), Some(p)) if lm.takes_images() => Some(ImageSupport {
                processor: p.clone(),
                image_token_id: v.image_token_id,
                merge_size: v.spatial_merge_size,
                allow_remote: allow_remote_images,
                max_images: max_images_per_request,
                limits: Default::default(),
            }),
            _ => None,
        };
        let cfg = engine_args.config(lm.as_ref(), &device);
        let pool = crate::common::kv_pool_summary(lm.as_ref(), &cfg, &device);
        let draft = match &engine_args.speculative {
            Some(kind) => kind.load_draft(device, tok.as_deref()).map_err(|e| format!("{e:#}"))?,
            None => None,
        };
        let engine = Engine::start_with_draft(lm, tok, cfg, draft).map_err(|e| e.to_string())?;
        eprintln!("qinfer serve: {name} is ready ({pool}, {} KiB; {})", engine.kv_bytes() >> 10, task_name(&task));
        Ok(Loaded { engine, defaults: model.sampling_defaults.clone(), stop_token_ids, task, adapters, images })
    };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async move {
        let bound =
            |addr: std::net::SocketAddr| eprintln!("qinfer serve: listening on http://{addr} (loading the model)");
        qinfer_server::serve(opts, load, bound, shutdown_signal()).await
    })
    .with_context(|| format!("serving on {}:{}", a.host, a.port))
}

/// SIGINT or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    eprintln!("qinfer serve: shutting down");
}
