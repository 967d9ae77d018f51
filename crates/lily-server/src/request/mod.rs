//! Reading request bodies, shared by both wire formats (the OpenAI routes and the Anthropic
//! Messages API): typed reads of fields with errors that name the field (`fields`), and the
//! sampling, generation and prompt-size fields they have in common (`params`).

pub mod fields;
pub mod params;
