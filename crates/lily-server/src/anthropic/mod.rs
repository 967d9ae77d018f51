//! The Anthropic Messages wire format (`POST /v1/messages`, `/v1/messages/count_tokens`): request
//! parsing into the chat template's messages, content blocks out, Anthropic error objects. The
//! generation behind it is the same as for `/v1/chat/completions`.

pub mod blocks;
pub mod error;
pub mod request;
