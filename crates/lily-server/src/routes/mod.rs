//! The HTTP surface: routes, API-key check, per-request metrics, and the small GET endpoints.

mod chat;
mod completions;
mod messages;
mod prompt;

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;

use crate::anthropic::error::AnthropicError;
use crate::openai::error::ApiError;
use crate::state::{AppState, Phase};

/// Largest request body accepted.
const MAX_BODY_BYTES: usize = 64 << 20;

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat::handle))
        .route("/v1/completions", post(completions::handle))
        .route("/v1/messages", post(messages::handle))
        .route("/v1/messages/count_tokens", post(messages::count_tokens))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model_info))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        // Long conversations are long JSON; axum's 2 MB default is too tight for a 256k context.
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(middleware::from_fn_with_state(state.clone(), check_api_key))
        .layer(middleware::from_fn_with_state(state.clone(), count_request))
        .with_state(state)
}

/// `/v1/*` needs `Authorization: Bearer KEY` (or Anthropic's `x-api-key: KEY`) when the server
/// was started with `--api-key`; `/health` and `/metrics` stay open for supervisors and scrapers.
async fn check_api_key(
    State(state): State<Arc<AppState>>,
    request: Request,
    next: Next,
) -> Response {
    if let Some(key) = &state.api_key {
        if request.uri().path().starts_with("/v1/") {
            let given = request
                .headers()
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
                .or_else(|| {
                    let x_api_key = request.headers().get("x-api-key");
                    x_api_key.and_then(|v| v.to_str().ok())
                });
            let path = request.uri().path();
            match given {
                None => return api_error(
                    path,
                    ApiError::unauthorized(
                        "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                    ),
                ),
                Some(g) if !same(g.trim().as_bytes(), key.as_bytes()) => {
                    return api_error(path, ApiError::unauthorized("incorrect API key"))
                }
                Some(_) => {}
            }
        }
    }
    next.run(request).await
}

/// An error in the shape the path's API uses: Anthropic's under `/v1/messages`, else OpenAI's.
fn api_error(path: &str, err: ApiError) -> Response {
    if path.starts_with("/v1/messages") {
        AnthropicError(err).into_response()
    } else {
        err.into_response()
    }
}

/// Compares without stopping at the first difference, so timing does not reveal the key.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn count_request(
    State(state): State<Arc<AppState>>,
    request: Request,
    next: Next,
) -> Response {
    let endpoint = match request.uri().path() {
        p @ ("/v1/chat/completions"
        | "/v1/completions"
        | "/v1/messages"
        | "/v1/messages/count_tokens"
        | "/v1/models"
        | "/health"
        | "/metrics") => p.to_string(),
        p if p.starts_with("/v1/models/") => "/v1/models".to_string(),
        _ => "other".to_string(),
    };
    let response = next.run(request).await;
    state
        .metrics
        .record_request(&endpoint, response.status().as_u16());
    response
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    let phase = state.phase.read().unwrap_or_else(|p| p.into_inner());
    match &*phase {
        Phase::Loading(stage) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "loading", "model": state.model_id, "stage": stage})),
        )
            .into_response(),
        Phase::Ready(model) => Json(json!({
            "status": "ok",
            "model": state.model_id,
            "backend": model.engine.describe(),
            "ctx_size": model.ctx_size,
            "queue_depth": model.engine.queue_depth(),
        }))
        .into_response(),
        Phase::ShuttingDown => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "shutting_down"})),
        )
            .into_response(),
    }
}

async fn models(State(state): State<Arc<AppState>>) -> Json<serde_json::Value> {
    Json(json!({"object": "list", "data": [model_card(&state)]}))
}

async fn model_info(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<serde_json::Value>, ApiError> {
    if id != state.model_id {
        return Err(ApiError::not_found(format!(
            "model {id:?} is not served here; this server serves {:?}",
            state.model_id
        )));
    }
    Ok(Json(model_card(&state)))
}

fn model_card(state: &AppState) -> serde_json::Value {
    let ctx = state.model().map(|m| m.ctx_size).ok();
    json!({"id": state.model_id, "object": "model", "created": state.created, "owned_by": "lily", "max_model_len": ctx})
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let text = state.metrics.render(&state.gauges());
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

async fn not_found(request: Request) -> Response {
    let path = request.uri().path();
    api_error(
        path,
        ApiError::not_found(format!("no route for {} {path}", request.method())),
    )
}
