//! The `sim-provider` subcommand: options from flags or a file, then serve until shutdown.

use super::options::*;
use super::*;
use tokio_util::sync::CancellationToken;

/// Errors of the `sim-provider` subcommand.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("--rules is not a valid JSON array of rules")]
    Rules(#[source] serde_json::Error),
    #[error("--options-file {path}: cannot read")]
    OptionsFileRead {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("--options-file {path}: not valid SimOptions JSON")]
    OptionsFileJson {
        path: std::path::PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("--listen {addr}: cannot bind")]
    Bind {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("sim provider server failed")]
    Serve(#[source] std::io::Error),
}

/// Arguments of the `sim-provider` subcommand.
#[derive(clap::Args, Debug, Clone)]
pub struct SimArgs {
    /// Address to listen on. The default is loopback; any other address is bound as given.
    #[arg(long, default_value = "127.0.0.1:8089")]
    pub listen: String,
    /// Base latency of every call (ignored when --options-file is given).
    #[arg(long, default_value_t = 200)]
    pub latency_ms: u64,
    /// Uniform random extra latency 0..=jitter (ignored when --options-file is given).
    #[arg(long, default_value_t = 100)]
    pub jitter_ms: u64,
    /// JSON array of rules, e.g. '[{"model":"deepseek-v3.2","fault":{"kind":"status","status":503},"probability":0.3}]'
    /// (replaces the rules of --options-file when both are given)
    #[arg(long)]
    pub rules: Option<String>,
    /// JSON file with a whole SimOptions
    #[arg(long)]
    pub options_file: Option<std::path::PathBuf>,
}

/// Options from the CLI: the options file if given (else latency/jitter flags), then
/// `--rules` replacing its rules.
pub fn options_from_args(args: &SimArgs) -> Result<SimOptions, SimError> {
    let mut opts = match &args.options_file {
        Some(path) => {
            let text =
                std::fs::read_to_string(path).map_err(|source| SimError::OptionsFileRead {
                    path: path.clone(),
                    source,
                })?;
            serde_json::from_str(&text).map_err(|source| SimError::OptionsFileJson {
                path: path.clone(),
                source,
            })?
        }
        None => SimOptions {
            latency_ms: args.latency_ms,
            jitter_ms: args.jitter_ms,
            ..SimOptions::default()
        },
    };
    if let Some(rules) = &args.rules {
        opts.rules = serde_json::from_str(rules).map_err(SimError::Rules)?;
    }
    Ok(opts)
}

/// Run the `sim-provider` subcommand until `shutdown` is cancelled.
pub async fn run_cli(args: SimArgs, shutdown: CancellationToken) -> Result<(), SimError> {
    let opts = options_from_args(&args)?;
    let bind_err = |source| SimError::Bind {
        addr: args.listen.clone(),
        source,
    };
    let listener = super::bind(args.listen.as_str()).await.map_err(bind_err)?;
    let addr = listener.local_addr().map_err(bind_err)?;
    if !addr.ip().is_loopback() {
        tracing::warn!(%addr, "sim provider listening on a non-loopback address");
    }
    tracing::info!(%addr, rules = opts.rules.len(), "sim provider listening");
    println!("sim-provider listening on http://{addr}/v1");
    Sim::new(opts)
        .serve(listener, shutdown)
        .await
        .map_err(SimError::Serve)
}
