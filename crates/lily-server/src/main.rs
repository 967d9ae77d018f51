//! `lily-engine`: the OpenAI-compatible server and the engine's subcommands.

mod generate;
mod load;
mod metrics;
mod openai;
mod output;
mod routes;
mod scripted;
mod serve;
mod state;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "lily-engine", version, about = "Lily: a local inference engine for Qwen3.6-35B-A3B")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the OpenAI-compatible HTTP API.
    Serve(serve::ServeArgs),
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(args) => serve::run(args),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
