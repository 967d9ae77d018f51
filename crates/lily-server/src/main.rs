//! `lily-engine`: the one binary. Subcommands: serve (the OpenAI-compatible HTTP API), synth
//! (write a synthetic checkpoint), generate (greedy generation from token ids), bench, score,
//! selftest (every device against the CPU, for bug reports).

mod anthropic;
mod cli_bench;
mod cli_generate;
mod cli_score;
mod cli_selftest;
mod cli_synth;
mod connections;
mod device;
mod generate;
mod load;
mod metrics;
mod openai;
mod output;
mod request;
mod routes;
#[cfg(feature = "scripted")]
mod scripted;
mod serve;
mod state;
mod structured;
mod webui;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "lily-engine",
    version,
    about = "Lily: an inference engine for Qwen3.6-35B-A3B"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the OpenAI-compatible HTTP API.
    Serve(serve::ServeArgs),
    /// Write a synthetic checkpoint of the model family's shape.
    Synth(cli_synth::SynthArgs),
    /// Greedy generation from token ids (text comes with the tokenizer).
    Generate(cli_generate::GenerateArgs),
    /// Prefill and decode throughput sweep (PERFORMANCE.md §1).
    Bench(cli_bench::BenchArgs),
    /// Teacher-forced logits of every position (backend and peer comparisons).
    Score(cli_score::ScoreArgs),
    /// Every device against the CPU reference, then a short bench: a report for bug reports.
    Selftest(cli_selftest::SelftestArgs),
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("LILY_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(args) => serve::run(args),
        Command::Synth(args) => cli_synth::run(args),
        Command::Generate(args) => cli_generate::run(args),
        Command::Bench(args) => cli_bench::run(args),
        Command::Score(args) => cli_score::run(args),
        Command::Selftest(args) => cli_selftest::run(args),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
