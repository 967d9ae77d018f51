//! The HTTP surface: routes, API-key check, per-request metrics, and the small GET endpoints.

mod chat;
mod completions;
mod messages;
mod prompt;

use std::sync::{Arc, OnceLock};

use axum::body::Body;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::StreamExt;
use serde_json::json;
use tokio::sync::Semaphore;

use crate::anthropic::error::AnthropicError;
use crate::openai::error::ApiError;
use crate::state::{AppState, Phase};

/// Runs a request's CPU-heavy preparation (template rendering, tokenization) on tokio's blocking
/// pool, at most one per core at a time: on the async workers, one long prompt would stall
/// `/health` and every running stream until it was done. A request waits for its turn without
/// holding a worker, and the turn stays taken until the work ends, even if the client has gone.
pub(crate) async fn off_the_workers<T, F>(work: F) -> Result<T, ApiError>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T, ApiError> + Send + 'static,
{
    static TURNS: OnceLock<Arc<Semaphore>> = OnceLock::new();
    let turns = TURNS.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        Arc::new(Semaphore::new(cores))
    });
    let turn = turns
        .clone()
        .acquire_owned()
        .await
        .map_err(|_| ApiError::unavailable("the server is shutting down"))?;
    tokio::task::spawn_blocking(move || {
        let _turn = turn;
        work()
    })
    .await
    .map_err(|e| ApiError::internal(format!("preparing the request failed: {e}")))?
}

/// Largest request body accepted: what the longest context (262,144 tokens of at most 128 bytes)
/// can need, twice over for JSON escapes and the request's other fields. A model with a shorter
/// context accepts less (`body_limit`).
pub(crate) const MAX_BODY_BYTES: usize = 64 << 20;

/// The body limit for the model being served: twice the prompt text its context can hold, plus a
/// megabyte for tools and the other fields (the ceiling while it loads).
fn body_limit(state: &AppState) -> usize {
    state.model().map_or(MAX_BODY_BYTES, |model| {
        model
            .max_prompt_bytes
            .saturating_mul(2)
            .saturating_add(1 << 20)
            .min(MAX_BODY_BYTES)
    })
}

/// The API's routes, and the chat page's (`webui`) unless `--no-webui` turned it off.
pub fn router(state: Arc<AppState>, webui: bool) -> Router {
    let pages = if webui {
        crate::webui::routes()
    } else {
        Router::new()
    };
    Router::new()
        .merge(pages)
        .route("/v1/chat/completions", post(chat::handle))
        .route("/v1/completions", post(completions::handle))
        .route("/v1/messages", post(messages::handle))
        .route("/v1/messages/count_tokens", post(messages::count_tokens))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model_info))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        // Long conversations are long JSON; axum's 2 MB default is too tight for a 256k context.
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(middleware::from_fn_with_state(state.clone(), read_body))
        .layer(middleware::from_fn_with_state(state.clone(), check_api_key))
        .layer(middleware::from_fn_with_state(state.clone(), count_request))
        .with_state(state)
}

/// Reads the whole body before the handler runs, within the limits: a `Content-Length` over
/// `body_limit` gets its 413 before a byte is read, a body that grows past it a 413 when it
/// does, and one that has not fully arrived `body_timeout` after the headers a 408 (a client that
/// sends less than its `Content-Length` would otherwise hold the connection for ever).
async fn read_body(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    let limit = body_limit(&state);
    if declared.is_some_and(|n| n > limit as u64) {
        return ApiError::body_too_large(limit).into_response();
    }
    let (parts, body) = request.into_parts();
    let mut chunks = body.into_data_stream();
    let mut bytes = Vec::with_capacity(declared.unwrap_or(0) as usize);
    let read = async {
        while let Some(chunk) = chunks.next().await {
            let chunk = chunk.map_err(|e| ApiError::unreadable(format!("{e}")))?;
            if bytes.len() + chunk.len() > limit {
                return Err(ApiError::body_too_large(limit));
            }
            bytes.extend_from_slice(&chunk);
        }
        Ok(())
    };
    match tokio::time::timeout(state.body_timeout, read).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return e.into_response(),
        Err(_) => return ApiError::body_timeout(state.body_timeout).into_response(),
    }
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
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
            let header = request
                .headers()
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok());
            let given = header.and_then(bearer_token).or_else(|| {
                let x_api_key = request.headers().get("x-api-key");
                x_api_key.and_then(|v| v.to_str().ok()).map(str::trim)
            });
            let path = request.uri().path();
            match given {
                None => return api_error(
                    path,
                    ApiError::unauthorized(
                        "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                    ),
                ),
                Some(g) if !same(g.as_bytes(), key.as_bytes()) => {
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

/// The token of an `Authorization: Bearer TOKEN` header, trimmed; the scheme is case-insensitive
/// (RFC 9110 §11.1). None for another scheme or no token.
fn bearer_token(value: &str) -> Option<&str> {
    let value = value.trim_start();
    let split = value.find(|c: char| c.is_ascii_whitespace())?;
    let (scheme, token) = value.split_at(split);
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// Compares in time that depends only on the lengths, not on where the first difference is, so
/// timing does not reveal the key byte by byte.
fn same(given: &[u8], key: &[u8]) -> bool {
    let mut diff = u8::from(given.len() != key.len());
    for (i, &k) in key.iter().enumerate() {
        // Past the end of `given`, compare against the key's own complement (always differs) —
        // the lengths already differ then, the loop just keeps the same shape.
        let g = given.get(i).copied().unwrap_or(!k);
        diff |= g ^ k;
    }
    std::hint::black_box(diff) == 0
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

async fn method_not_allowed(request: Request) -> ApiError {
    ApiError::method_not_allowed(request.method().as_str(), request.uri().path())
}

async fn not_found(request: Request) -> Response {
    let path = request.uri().path();
    api_error(
        path,
        ApiError::not_found(format!("no route for {} {path}", request.method())),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_scheme_is_case_insensitive_and_the_token_trimmed() {
        for h in ["Bearer k", "bearer k", "BEARER  k ", "  bEaReR\tk"] {
            assert_eq!(bearer_token(h), Some("k"), "{h:?}");
        }
        for h in ["Basic k", "k", "Bearerk", "Bearer", "Bearer   ", ""] {
            assert_eq!(bearer_token(h), None, "{h:?}");
        }
    }

    #[test]
    fn keys_compare_equal_only_when_equal() {
        assert!(same(b"sekrit", b"sekrit"));
        assert!(!same(b"sekri", b"sekrit"));
        assert!(!same(b"sekrit!", b"sekrit"));
        assert!(!same(b"sekriT", b"sekrit"));
        assert!(!same(b"", b"sekrit"));
        assert!(!same(b"x", b""));
        assert!(same(b"", b""));
    }
}
