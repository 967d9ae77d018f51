//! OpenAI error objects: `{"error": {"message", "type", "param", "code"}}` with the HTTP status the
//! official API uses for each kind, so clients raise the exception they expect
//! (`BadRequestError`, `AuthenticationError`, `RateLimitError`, …).

use axum::extract::rejection::BytesRejection;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    /// 400: the request itself is wrong; `param` names the offending field.
    pub fn invalid(param: impl Into<Option<String>>, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.into(),
            code: None,
        }
    }

    pub fn invalid_param(param: &str, message: impl Into<String>) -> Self {
        Self::invalid(Some(param.to_string()), message)
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn unauthorized(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("not_found"),
        }
    }

    pub fn queue_full(capacity: usize) -> Self {
        ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: format!(
                "the server is busy: {capacity} requests are already waiting; retry later"
            ),
            kind: "rate_limit_error",
            param: None,
            code: Some("queue_full"),
        }
    }

    /// 405, with the method and path the request used.
    pub fn method_not_allowed(method: &str, path: &str) -> Self {
        ApiError {
            status: StatusCode::METHOD_NOT_ALLOWED,
            message: format!("{method} is not allowed on {path}"),
            kind: "invalid_request_error",
            param: None,
            code: Some("method_not_allowed"),
        }
    }

    /// 413, naming the limit.
    pub fn body_too_large(limit: usize) -> Self {
        ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!("the request body is larger than the {limit} bytes accepted"),
            kind: "invalid_request_error",
            param: None,
            code: Some("request_too_large"),
        }
    }

    /// Why a request body could not be read: 413 over the size limit (named), 400 for a body the
    /// connection broke off or framed wrongly (a malformed chunk), with what hyper said.
    pub fn unreadable_body(rejection: &BytesRejection, limit: usize) -> Self {
        let status = rejection.status();
        if status == StatusCode::PAYLOAD_TOO_LARGE {
            Self::body_too_large(limit)
        } else {
            ApiError {
                status: if status.is_client_error() {
                    status
                } else {
                    StatusCode::BAD_REQUEST
                },
                message: format!("cannot read the request body: {}", rejection.body_text()),
                kind: "invalid_request_error",
                param: None,
                code: None,
            }
        }
    }

    /// 400: the body broke off or was framed wrongly (a malformed chunk), with what hyper said.
    pub fn unreadable(detail: impl std::fmt::Display) -> Self {
        Self::invalid(None, format!("cannot read the request body: {detail}"))
    }

    /// 408: the body did not arrive in time.
    pub fn body_timeout(limit: std::time::Duration) -> Self {
        ApiError {
            status: StatusCode::REQUEST_TIMEOUT,
            message: format!(
                "the request body did not arrive within {} seconds of its headers",
                limit.as_secs()
            ),
            kind: "invalid_request_error",
            param: None,
            code: Some("request_timeout"),
        }
    }

    pub fn loading() -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: "the model is still loading; poll GET /health until it answers 200".into(),
            kind: "service_unavailable",
            param: None,
            code: Some("model_loading"),
        }
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            kind: "service_unavailable",
            param: None,
            code: None,
        }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status.as_u16(), self.message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(self.body())).into_response();
        let headers = response.headers_mut();
        match self.status {
            StatusCode::UNAUTHORIZED => {
                headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            }
            // The queue drains a request at a time; a second is as good a guess as any, and
            // clients that honour the header (the openai SDK does) back off instead of hammering.
            StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE => {
                headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            }
            _ => {}
        }
        response
    }
}
