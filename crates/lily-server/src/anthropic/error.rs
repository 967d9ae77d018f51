//! Anthropic error objects: `{"type": "error", "error": {"type", "message"}}`, with the HTTP status
//! the official API gives each type, so the `anthropic` client raises the exception it documents
//! (`BadRequestError`, `AuthenticationError`, `NotFoundError`, `RateLimitError`, …). Validation is
//! shared with the OpenAI side, so this wraps its `ApiError`; the field a 400 is about is named in
//! the message, as Anthropic's own messages do (`messages.0.content: …`).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::openai::error::ApiError;

#[derive(Debug)]
pub struct AnthropicError(pub ApiError);

impl From<ApiError> for AnthropicError {
    fn from(e: ApiError) -> Self {
        AnthropicError(e)
    }
}

impl AnthropicError {
    /// Anthropic's error type for an HTTP status.
    pub fn kind(&self) -> &'static str {
        match self.0.status {
            StatusCode::BAD_REQUEST => "invalid_request_error",
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::FORBIDDEN => "permission_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
            _ => "api_error",
        }
    }

    pub fn body(&self) -> Value {
        let e = &self.0;
        let message = match &e.param {
            Some(p) if !e.message.contains(p.as_str()) => format!("{p}: {}", e.message),
            _ => e.message.clone(),
        };
        json!({"type": "error", "error": {"type": self.kind(), "message": message}})
    }
}

impl IntoResponse for AnthropicError {
    fn into_response(self) -> Response {
        (self.0.status, Json(self.body())).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_map_to_anthropic_error_types() {
        for (err, kind) in [
            (
                ApiError::invalid_param("max_tokens", "bad"),
                "invalid_request_error",
            ),
            (ApiError::unauthorized("no key"), "authentication_error"),
            (ApiError::not_found("nothing"), "not_found_error"),
            (ApiError::queue_full(4), "rate_limit_error"),
            (ApiError::loading(), "overloaded_error"),
            (ApiError::internal("boom"), "api_error"),
        ] {
            let body = AnthropicError(err).body();
            assert_eq!(body["type"], "error");
            assert_eq!(body["error"]["type"], kind);
        }
    }

    #[test]
    fn the_field_is_named_in_the_message() {
        let body = AnthropicError(ApiError::invalid_param("max_tokens", "required")).body();
        assert_eq!(body["error"]["message"], "max_tokens: required");
        let body = AnthropicError(ApiError::invalid_param(
            "top_k",
            "'top_k' must be an integer",
        ))
        .body();
        assert_eq!(body["error"]["message"], "'top_k' must be an integer");
    }
}
