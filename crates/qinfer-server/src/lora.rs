//! Loading and unloading LoRA adapters while serving, as vLLM's
//! `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` do; allowed only
//! when the server was started with `--allow-lora-updates` (loading reads
//! a path on the server's machine).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use crate::error::{ApiError, ApiResult, Flavor};
use crate::params::Body;
use crate::{AppState, ServedAdapter};

const F: Flavor = Flavor::OpenAi;

fn allowed(state: &AppState) -> ApiResult<()> {
    if state.opts.allow_lora_updates {
        return Ok(());
    }
    Err(ApiError::with_status(
        F,
        StatusCode::FORBIDDEN,
        "loading and unloading LoRA adapters is off; start the server with --allow-lora-updates",
    ))
}

/// The request's `lora_name`, required.
fn name<'a>(b: &Body<'a>) -> ApiResult<&'a str> {
    match b.str("lora_name")? {
        Some(n) if !n.is_empty() => Ok(n),
        _ => Err(b.bad("lora_name", "is required (a non-empty string)")),
    }
}

pub async fn load(State(state): State<Arc<AppState>>, body: Bytes) -> ApiResult<Response> {
    allowed(&state)?;
    let ready = state.ready(F)?;
    let v = Body::parse(&body, F)?;
    let b = Body::new(&v, F);
    let name = name(&b)?.to_string();
    let path = match b.str("lora_path")? {
        Some(p) if !p.is_empty() => std::path::PathBuf::from(p),
        _ => return Err(b.bad("lora_path", "is required (the adapter's directory on the server)")),
    };
    let taken = |name: &str| {
        name == state.opts.served_model_name
            || ready.adapters.read().unwrap_or_else(|e| e.into_inner()).iter().any(|a| a.name == name)
    };
    if taken(&name) {
        return Err(b.bad("lora_name", format!("`{name}` is already served")));
    }
    let model = ready.engine.model().clone();
    let (p, placed_path) = (path.clone(), path.clone());
    let placed = tokio::task::spawn_blocking(move || {
        let adapter = qinfer::engine::request::LoraAdapter::load(&p)?;
        model.add_adapter(&adapter)
    })
    .await
    .map_err(|e| ApiError::with_status(F, StatusCode::INTERNAL_SERVER_ERROR, format!("loading the adapter: {e}")))?;
    let id = placed.map_err(|e| b.bad("lora_path", e.to_string()))?;
    let mut adapters = ready.adapters.write().unwrap_or_else(|e| e.into_inner());
    if adapters.iter().any(|a| a.name == name) {
        // Another request loaded the name meanwhile: this copy goes.
        let _ = ready.engine.model().remove_adapter(id);
        return Err(b.bad("lora_name", format!("`{name}` is already served")));
    }
    adapters.push(ServedAdapter { name: name.clone(), id, path: placed_path });
    tracing::info!("LoRA adapter `{name}` loaded from {}", path.display());
    Ok((StatusCode::OK, format!("Success: LoRA adapter '{name}' added successfully.")).into_response())
}

pub async fn unload(State(state): State<Arc<AppState>>, body: Bytes) -> ApiResult<Response> {
    allowed(&state)?;
    let ready = state.ready(F)?;
    let v = Body::parse(&body, F)?;
    let b = Body::new(&v, F);
    let name = name(&b)?;
    let mut adapters = ready.adapters.write().unwrap_or_else(|e| e.into_inner());
    let Some(at) = adapters.iter().position(|a| a.name == name) else {
        return Err(ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("no LoRA adapter `{name}` is served"),
            param: Some("lora_name".into()),
            flavor: F,
        });
    };
    let gone = adapters.remove(at);
    // Requests already running with it finish with it; its weights go then.
    ready
        .engine
        .model()
        .remove_adapter(gone.id)
        .map_err(|e| ApiError::with_status(F, StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    tracing::info!("LoRA adapter `{name}` unloaded");
    Ok((StatusCode::OK, format!("Success: LoRA adapter '{name}' removed successfully.")).into_response())
}
