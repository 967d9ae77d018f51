//! `lily-engine serve`: bind first, load the model in the background (`/health` says "loading"
//! meanwhile), then serve the OpenAI API until SIGTERM / Ctrl-C, which stops accepting, lets
//! in-flight requests finish for a grace period, then cancels what is left and exits.

use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use anyhow::{Context, Result};

use crate::connections::{self, ConnectionLimits};
use crate::device::BackendArgs;
use crate::load::{self, Device, LoadOptions};
use crate::metrics::Metrics;
use crate::openai::response::unix_now;
use crate::routes;
use crate::state::{AppState, Phase};

/// How long in-flight requests may run on after a shutdown signal before they are cancelled.
const DRAIN_GRACE: Duration = Duration::from_secs(10);

#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// Model directory (config.json, safetensors, tokenizer files).
    #[arg(long)]
    pub model: String,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on /v1/* (surrounding whitespace is ignored; an empty
    /// key is refused rather than taken to mean "no authentication").
    #[arg(long)]
    pub api_key: Option<String>,
    /// Tokens per sequence, prompt plus output [default: on a GPU the model's maximum when a
    /// quarter of the free device memory holds its KV cache; on the CPU min(model maximum, 32768)].
    #[arg(long)]
    pub ctx_size: Option<usize>,
    /// Requests that may wait behind the running ones; more get 429.
    #[arg(long, default_value_t = 64)]
    pub max_queue: usize,
    /// Conversations decoded together at most, one batched step for all; more wait in the queue
    /// (or until their sequence fits in memory) [default: the backend's: 8 on CUDA with its
    /// batched step (`--no-batched-decode`: 1), 1 on wgpu and the CPU, which batches for real at
    /// any N asked].
    #[arg(long, value_name = "N")]
    pub max_batch: Option<usize>,
    /// MiB of device memory (host memory on the CPU backend) for conversation states kept for
    /// reuse by later requests: sequences' KV caches and their snapshots, least recently used
    /// evicted first (0 = prefix reuse off).
    #[arg(long, default_value_t = 8192)]
    pub prefix_cache_mib: usize,
    /// Also snapshot every this many prompt tokens of a long prefill, so a prompt that differs
    /// from an earlier one only after that point resumes there (0 = only at the ends of
    /// conversations, prompts and generated turns). A multiple of the backends' prefill chunks
    /// (CUDA 8,192, wgpu 4,096, CPU 512), so a long prompt is fed in whole chunks.
    #[arg(long, default_value_t = 8192)]
    pub snapshot_every: usize,
    /// Connections open at once; more are answered 503 and closed.
    #[arg(long, default_value_t = 512)]
    pub max_connections: usize,
    /// Seconds a client has to send a request's headers, counted from when it connects or from
    /// the previous response (so also how long an idle keep-alive connection is kept).
    #[arg(long, default_value_t = 30)]
    pub header_timeout: u64,
    /// Seconds a client has to send a request's body once its headers are in; a body still
    /// unfinished then is answered 408.
    #[arg(long, default_value_t = 60)]
    pub body_timeout: u64,
    /// Requests served on one keep-alive connection before it is closed (1: one per connection).
    #[arg(long, default_value_t = 1000)]
    pub keep_alive_requests: usize,
    #[arg(long, value_enum, default_value = "auto")]
    pub device: Device,
    /// Serve an HF bf16 checkpoint as bf16. By default it is quantised at load to 4-bit groups of
    /// 64 (routers 8-bit), as MLX would: a quarter of the memory and the kernels' fast path.
    #[arg(long)]
    pub keep_bf16: bool,
    /// Do not serve the chat page at `/` (only the API is served then).
    #[arg(long)]
    pub no_webui: bool,
    #[command(flatten)]
    pub backend: BackendArgs,
}

pub fn run(args: ServeArgs) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(serve(args))
}

async fn serve(args: ServeArgs) -> Result<()> {
    if args.max_queue == 0 {
        anyhow::bail!("--max-queue must be at least 1 (requests wait in the queue until the engine takes them)");
    }
    if args.max_batch == Some(0) {
        anyhow::bail!("--max-batch must be at least 1");
    }
    let limits = connection_limits(&args)?;
    let api_key = api_key(args.api_key.as_deref())?;
    let addr = listen_address(&args.host, args.port).await?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))?;
    let state = Arc::new(AppState {
        model_id: load::model_id(&args.model),
        api_key,
        phase: RwLock::new(Phase::Loading("starting")),
        metrics: Arc::new(Metrics::default()),
        created: unix_now(),
        body_timeout: Duration::from_secs(args.body_timeout),
    });
    tracing::info!(
        "listening on http://{addr} (model {} loading)",
        state.model_id
    );
    if !args.no_webui {
        tracing::info!("chat page at http://{addr}/ (--no-webui turns it off)");
    }

    let opts = LoadOptions {
        model: args.model.clone(),
        device: args.device,
        ctx_size: args.ctx_size,
        max_queue: args.max_queue,
        max_batch: args.max_batch,
        prefix_cache_bytes: args.prefix_cache_mib.saturating_mul(1 << 20),
        snapshot_every: args.snapshot_every,
        quantize: !args.keep_bf16,
        backend: args.backend.clone(),
    };
    let loader_state = state.clone();
    std::thread::Builder::new()
        .name("lily-load".into())
        .spawn(move || {
            match load::load(&opts, &|stage| {
                loader_state.set_phase(Phase::Loading(stage))
            }) {
                Ok(model) => {
                    tracing::info!(
                        "model {} ready (context {} tokens)",
                        loader_state.model_id,
                        model.ctx_size
                    );
                    loader_state.set_phase(Phase::Ready(Arc::new(model)));
                }
                Err(e) => {
                    // A server that can never answer is worse than one that exits: supervisors
                    // (and `lily serve`) see the exit status and the message.
                    tracing::error!("cannot load the model: {e:#}");
                    eprintln!("error: cannot load the model: {e:#}");
                    std::process::exit(1);
                }
            }
        })
        .context("cannot start the loader thread")?;

    let app = routes::router(state.clone(), !args.no_webui);
    let (signal_tx, signal_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(connections::serve(listener, app, limits, async {
        let _ = signal_rx.await;
    }));

    shutdown_signal().await;
    tracing::info!(
        "shutting down: draining in-flight requests (up to {}s)",
        DRAIN_GRACE.as_secs()
    );
    let _ = signal_tx.send(());
    let mut server = server;
    let drained = tokio::time::timeout(DRAIN_GRACE, &mut server).await.is_ok();
    // Cancel whatever is still queued or running so their streams end with an error, then give
    // the connections a moment to flush.
    let model = state.model().ok();
    state.set_phase(Phase::ShuttingDown);
    if let Some(model) = model {
        tokio::task::spawn_blocking(move || model.engine.shutdown())
            .await
            .ok();
    }
    if !drained {
        let _ = tokio::time::timeout(Duration::from_secs(2), server).await;
    }
    tracing::info!("stopped");
    Ok(())
}

/// Where `--host --port` listen: an IPv4 or IPv6 literal (bare `::1` or bracketed `[::1]`) or a
/// host name, resolved. A name with several addresses (`localhost`: 127.0.0.1 and ::1) listens on
/// the first IPv4 one, which every client tries; a `--host` of each address serves one of them.
async fn listen_address(host: &str, port: u16) -> Result<SocketAddr> {
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    if let Ok(ip) = bare.parse::<std::net::IpAddr>() {
        return Ok(SocketAddr::new(ip, port));
    }
    let resolved: Vec<SocketAddr> = tokio::net::lookup_host((bare, port))
        .await
        .with_context(|| format!("--host {host}: not an address or a host name that resolves"))?
        .collect();
    resolved
        .iter()
        .find(|a| a.is_ipv4())
        .or(resolved.first())
        .copied()
        .with_context(|| format!("--host {host}: the name resolves to no address"))
}

/// The connection limits the options set; zero is refused for each (it would serve nothing).
fn connection_limits(args: &ServeArgs) -> Result<ConnectionLimits> {
    for (name, value) in [
        ("--max-connections", args.max_connections as u64),
        ("--header-timeout", args.header_timeout),
        ("--body-timeout", args.body_timeout),
        ("--keep-alive-requests", args.keep_alive_requests as u64),
    ] {
        if value == 0 {
            anyhow::bail!("{name} must be at least 1");
        }
    }
    Ok(ConnectionLimits {
        max_connections: args.max_connections,
        header_timeout: Duration::from_secs(args.header_timeout),
        keep_alive_requests: args.keep_alive_requests,
    })
}

/// The key `--api-key` configures, trimmed as clients' keys are. An empty or blank key is refused:
/// `--api-key "$UNSET"` would otherwise turn authentication off without a word.
fn api_key(given: Option<&str>) -> Result<Option<String>> {
    match given.map(str::trim) {
        None => Ok(None),
        Some("") => anyhow::bail!(
            "--api-key is empty (an unset shell variable?): give a key, or leave --api-key out to serve without authentication"
        ),
        Some(key) => Ok(Some(key.to_string())),
    }
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn hosts_are_literals_or_resolved_names() {
        let at =
            |h: &'static str| async move { listen_address(h, 8000).await.map(|a| a.to_string()) };
        assert_eq!(at("127.0.0.1").await.unwrap(), "127.0.0.1:8000");
        assert_eq!(at("::1").await.unwrap(), "[::1]:8000");
        assert_eq!(at("[::1]").await.unwrap(), "[::1]:8000");
        assert_eq!(at("0.0.0.0").await.unwrap(), "0.0.0.0:8000");
        assert_eq!(at("localhost").await.unwrap(), "127.0.0.1:8000");
        let err = format!("{:#}", at("no-such-host.invalid").await.unwrap_err());
        assert!(err.contains("--host no-such-host.invalid"), "{err}");
        assert!(at("1.2.3.4:80").await.is_err());
    }

    #[test]
    fn api_key_is_trimmed_and_never_empty() {
        assert_eq!(api_key(None).unwrap(), None);
        assert_eq!(api_key(Some("  k1 \n")).unwrap().as_deref(), Some("k1"));
        for blank in ["", "  ", "\t\n"] {
            let err = api_key(Some(blank)).unwrap_err().to_string();
            assert!(err.contains("--api-key is empty"), "{err}");
        }
    }
}
