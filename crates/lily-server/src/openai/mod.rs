//! The OpenAI wire format: request parsing with field-level errors, response and chunk bodies.

pub mod chat_request;
pub mod completion_request;
pub mod error;
pub mod response;
