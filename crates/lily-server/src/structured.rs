//! What a request asks of the shape of the output, beyond sampling: a forced tool call
//! (`tool_choice`) or a JSON answer (`response_format`).

/// Which tool calls the answer must make. Both APIs map onto this: OpenAI `"auto"` / `"none"` /
/// `"required"` / `{"type": "function", …}`, Anthropic `auto` / `none` / `any` / `tool`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model decides.
    Auto,
    /// No tools are offered.
    None,
    /// At least one call, to any of the tools.
    Required,
    /// A call to this tool.
    Named(String),
}
