//! `inference-cache`: the KV-cache-aware routing policy server.
//!
//! Parses the command line, sets up logging, runs the chosen subcommand, and
//! maps errors to a non-zero exit code.

use std::net::SocketAddr;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Parser, Subcommand, ValueEnum};
use inference_cache_replay::ReplayArgs;
use inference_cache_server::{
    AccuracyArgs, DEFAULT_ADMIN_ADDR, DEFAULT_GRPC_ADDR, IndexArgs, LimitArgs, PromptArgs,
    ReplicationArgs, SecurityArgs, ServeConfig, ShutdownArgs, WatchArgs, start,
};
use inference_cache_subscriber::SubscribeArgs;
use tracing_subscriber::EnvFilter;

/// KV-cache-aware routing hints for LLM gateways.
#[derive(Debug, Parser)]
#[command(name = "inference-cache", version, about, long_about = None)]
struct Cli {
    /// Log output format.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = "INFERENCE_CACHE_LOG_FORMAT")]
    log_format: LogFormat,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the policy server (gRPC InferenceCache service + admin HTTP).
    Serve(Box<ServeArgs>),
    /// Feed the server's index from an engine's ZMQ KV events (vLLM, SGLang).
    Subscribe(SubscribeArgs),
    /// Replay a request trace through routing policies over simulated replicas.
    Replay(ReplayArgs),
    /// Print a server's index changes (StreamCacheEvents) as they happen.
    Watch(WatchArgs),
    /// See it work: simulated engines routed by inference-cache vs round-robin, side by side.
    Demo(inference_cache_demo::DemoArgs),
}

/// Flags of `inference-cache serve`.
#[derive(Debug, clap::Args)]
struct ServeArgs {
    /// gRPC listen address (HTTP/2, TLS with --tls-cert): InferenceCache, grpc.health.v1, reflection.
    #[arg(long, default_value = DEFAULT_GRPC_ADDR, env = "INFERENCE_CACHE_GRPC_ADDR")]
    grpc_addr: SocketAddr,

    /// Admin HTTP listen address: /healthz, /readyz, /metrics, /snapshot/accuracy, /policy, /snapshot.
    #[arg(long, default_value = DEFAULT_ADMIN_ADDR, env = "INFERENCE_CACHE_ADMIN_ADDR")]
    admin_addr: SocketAddr,

    #[command(flatten)]
    index: IndexArgs,

    #[command(flatten)]
    prompts: PromptArgs,

    #[command(flatten)]
    limits: LimitArgs,

    #[command(flatten)]
    security: SecurityArgs,

    #[command(flatten)]
    shutdown: ShutdownArgs,

    #[command(flatten)]
    replication: ReplicationArgs,

    #[command(flatten)]
    accuracy: AccuracyArgs,
}

impl ServeArgs {
    fn into_config(self) -> ServeConfig {
        ServeConfig {
            grpc_addr: self.grpc_addr,
            admin_addr: self.admin_addr,
            index: self.index.into_settings(),
            prompts: self.prompts.into_settings(),
            limits: self.limits.into_settings(),
            security: self.security.into_settings(),
            shutdown: self.shutdown.into_settings(),
            replication: self.replication.into_settings(),
            outcomes: self.accuracy.into_settings(),
        }
    }
}

fn init_logging(format: LogFormat, default_level: &str) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    // Colour only on a terminal: logs piped to a file or a collector stay plain.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    // Installed before the listeners bind: a SIGTERM right after start-up
    // runs the shutdown sequence instead of killing the process.
    let signal =
        inference_cache_runtime::termination_signal().context("installing signal handlers")?;
    let server = start(args.into_config()).await?;
    let token = server.shutdown_token();
    tokio::spawn(async move {
        signal.await;
        tracing::info!("shutdown signal received");
        token.cancel();
    });
    server.wait().await
}

/// Runs the demo against a policy server started in-process with the embedded defaults.
async fn demo(args: inference_cache_demo::DemoArgs) -> anyhow::Result<()> {
    let server = start(ServeConfig::ephemeral()).await?;
    let policy_server = inference_cache_demo::PolicyServer {
        grpc_addr: server.grpc_addr,
    };
    let result = inference_cache_demo::run(args, policy_server).await;
    server.shutdown_token().cancel();
    server.wait().await?;
    result.map(drop)
}

/// Every allocation of the binary goes through mimalloc, whichever C library
/// it is linked against: musl's allocator (the static image's) serialises
/// threads on one lock, and glibc's ran with one arena; server CPU per
/// LookupRoute dropped by a tenth to more than half (docs/performance.md,
/// "Allocator", with the figures and why it is built without huge-page
/// advice). The server's sweep has it hand emptied pages back
/// (`release_free_memory` in the server crate).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime.block_on(run()),
        Err(e) => {
            eprintln!("inference-cache: starting the async runtime: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> ExitCode {
    let cli = Cli::parse();
    // The demo's own output is the point: only warnings unless RUST_LOG says otherwise.
    let default_level = match cli.command {
        Command::Demo(_) => "warn",
        _ => "info",
    };
    init_logging(cli.log_format, default_level);
    let result = match cli.command {
        Command::Serve(args) => serve(*args).await,
        Command::Subscribe(args) => inference_cache_subscriber::run(args).await,
        Command::Replay(args) => inference_cache_replay::run(args).await.map_err(Into::into),
        Command::Watch(args) => inference_cache_server::watch(args).await,
        Command::Demo(args) => demo(args).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            tracing::error!("{error:#}");
            eprintln!("inference-cache: {error:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use inference_cache_server::ReplicationSettings;

    fn serve_config(args: &[&str]) -> ServeConfig {
        let argv = ["inference-cache", "serve"].iter().chain(args);
        match Cli::try_parse_from(argv).expect("flags parse").command {
            Command::Serve(args) => args.into_config(),
            other => panic!("not serve: {other:?}"),
        }
    }

    /// Every flag's default and the library's `Default` come from the same constants.
    #[test]
    fn serve_without_flags_is_the_default_configuration() {
        assert_eq!(serve_config(&[]), ServeConfig::default());
        let with_log = serve_config(&["--nats-url", "nats://127.0.0.1:4222"]);
        assert_eq!(
            with_log.replication,
            Some(ReplicationSettings::new("nats://127.0.0.1:4222"))
        );
    }
}
