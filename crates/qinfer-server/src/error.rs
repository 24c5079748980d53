//! Errors in each API's own shape: OpenAI's `{"error": {"message", "type",
//! "param", "code"}}`, Anthropic's `{"type": "error", "error": {"type",
//! "message"}}`, with the HTTP status that says whose fault it is.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// Which API's error shape a response takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    OpenAi,
    Anthropic,
}

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// The request field at fault, if one is.
    pub param: Option<String>,
    pub flavor: Flavor,
}

impl ApiError {
    pub fn bad_request(flavor: Flavor, param: Option<&str>, message: impl Into<String>) -> Self {
        ApiError { status: StatusCode::BAD_REQUEST, message: message.into(), param: param.map(str::to_string), flavor }
    }

    pub fn with_status(flavor: Flavor, status: StatusCode, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into(), param: None, flavor }
    }

    fn kind(&self) -> &'static str {
        match (self.flavor, self.status.as_u16()) {
            (Flavor::OpenAi, 401) => "authentication_error",
            (Flavor::OpenAi, 404) => "not_found_error",
            (Flavor::OpenAi, 503) => "service_unavailable",
            (Flavor::OpenAi, s) if s >= 500 => "server_error",
            (Flavor::OpenAi, _) => "invalid_request_error",
            (Flavor::Anthropic, 401) => "authentication_error",
            (Flavor::Anthropic, 404) => "not_found_error",
            (Flavor::Anthropic, 413) => "request_too_large",
            (Flavor::Anthropic, 503 | 529) => "overloaded_error",
            (Flavor::Anthropic, s) if s >= 500 => "api_error",
            (Flavor::Anthropic, _) => "invalid_request_error",
        }
    }

    /// The body as a JSON value (also what a stream's error event carries).
    pub fn body(&self) -> serde_json::Value {
        match self.flavor {
            Flavor::OpenAi => json!({"error": {
                "message": self.message,
                "type": self.kind(),
                "param": self.param,
                "code": self.status.as_u16(),
            }}),
            Flavor::Anthropic => json!({"type": "error", "error": {"type": self.kind(), "message": self.message}}),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            r.headers_mut().insert(axum::http::header::RETRY_AFTER, axum::http::HeaderValue::from_static("1"));
        }
        r
    }
}

pub type ApiResult<T> = std::result::Result<T, ApiError>;
