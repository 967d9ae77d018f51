//! lily-core: everything about Qwen3.6-35B-A3B that is not a GPU or HTTP: the model description,
//! checkpoint formats, text in and out, sampling, the generation loop, and the CPU reference backend.

pub mod backend;
pub mod chat;
pub mod checkpoint;
pub mod config;
pub mod constrain;
pub mod cpu;
pub mod engine;
pub mod logprob;
pub mod options;
pub mod parse;
pub mod quant;
pub mod sampling;
pub mod stop;
pub mod synth;
pub mod text;
pub mod traffic;
pub mod weights;
