//! Command-line flags of `inference-cache subscribe` and the validated
//! [`Settings`] they resolve into.
//!
//! Flags are parsed once by clap ([`SubscribeArgs`]), then checked and
//! normalised by [`SubscribeArgs::resolve`]; the rest of the crate only sees
//! [`Settings`]. Environment variables are read by clap at parse time
//! (`POD_NAMESPACE` for the tenant, among others), never deeper in the logic.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;

/// Default `--endpoint`: vLLM's default KV-event publisher on this host.
pub const DEFAULT_ENDPOINT: &str = "tcp://127.0.0.1:5557";
/// Default `--topic`: every topic.
pub const DEFAULT_TOPIC: &str = "";
/// Default `--server`.
pub const DEFAULT_SERVER: &str = "http://127.0.0.1:9090";
/// Default `--hash-scheme`.
pub const DEFAULT_HASH_SCHEME: &str = "vllm";
/// Default `--block-size` (the server's `--engine-block-size` default too).
pub const DEFAULT_BLOCK_SIZE: u32 = inference_cache_fingerprint::DEFAULT_BLOCK_SIZE;
/// Default `--buffer-size`.
pub const DEFAULT_BUFFER_SIZE: usize = 200_000;
/// Default `--max-tracked-blocks`.
pub const DEFAULT_MAX_TRACKED_BLOCKS: usize = 1_000_000;
/// Default `--max-blocks-per-update`.
pub const DEFAULT_MAX_BLOCKS_PER_UPDATE: usize = 4096;
/// Default `--replay-timeout`.
pub const DEFAULT_REPLAY_TIMEOUT: &str = "2s";
/// Default `--refresh-interval`.
pub const DEFAULT_REFRESH_INTERVAL: &str = "10m";
/// Default `--heartbeat-interval`.
pub const DEFAULT_HEARTBEAT_INTERVAL: &str = "5s";
/// Default `--metrics-interval`.
pub const DEFAULT_METRICS_INTERVAL: &str = "1s";
/// Default `--metrics-listen`.
pub const DEFAULT_METRICS_LISTEN: &str = "0.0.0.0:9091";

/// Flags of `inference-cache subscribe`: which engine to listen to, which
/// server to report to, and under which identity.
#[derive(Debug, Clone, clap::Args)]
pub struct SubscribeArgs {
    /// Engine KV-event publisher endpoints (ZMQ PUB), one per data-parallel
    /// rank; comma-separated or repeated.
    #[arg(
        long = "endpoint",
        env = "KV_EVENTS_ENDPOINTS",
        value_delimiter = ',',
        default_value = DEFAULT_ENDPOINT
    )]
    pub endpoints: Vec<String>,

    /// Engine replay endpoints (ZMQ ROUTER), paired with `--endpoint` by
    /// position. Used to fetch batches missed in a sequence gap.
    #[arg(
        long = "replay-endpoint",
        env = "KV_EVENTS_REPLAY_ENDPOINTS",
        value_delimiter = ','
    )]
    pub replay_endpoints: Vec<String>,

    /// ZMQ topic prefix to subscribe to (empty: every topic).
    #[arg(long, env = "KV_EVENTS_TOPIC", default_value = DEFAULT_TOPIC)]
    pub topic: String,

    /// Address of the inference-cache gRPC server.
    #[arg(
        long = "server",
        env = "INFERENCE_CACHE_SERVER",
        default_value = DEFAULT_SERVER
    )]
    pub server: String,

    /// Replica id reported for this engine (the id gateways route to).
    #[arg(long, env = "REPLICA_ID")]
    pub replica_id: String,

    /// Tenant the engine's blocks belong to.
    #[arg(long, env = "POD_NAMESPACE")]
    pub tenant: String,

    /// Model id served by the engine.
    #[arg(long, env = "MODEL_ID")]
    pub model: String,

    /// Hash scheme (compatibility domain) the fingerprints are reported under.
    #[arg(long, env = "HASH_SCHEME", default_value = DEFAULT_HASH_SCHEME)]
    pub hash_scheme: String,

    /// Tokens per KV block; must equal the engine's block size and the
    /// server's `--engine-block-size`. Checked against the engine's
    /// `vllm:cache_config_info` (with `--engine-metrics-url`) and the
    /// `block_size` of its events; a mismatch is logged, exported as
    /// `inferencecache_subscriber_config_mismatch` and fails `/readyz`.
    #[arg(long, env = "ENGINE_BLOCK_SIZE", default_value_t = DEFAULT_BLOCK_SIZE)]
    pub block_size: u32,

    /// Stable adapter names for the engine's LoRA ids, `id=name,...`
    /// (e.g. `1=sql-lora,2=chat-lora`). Blocks of an unmapped id are dropped.
    #[arg(long, env = "LORA_ADAPTER_NAMES", value_delimiter = ',', value_parser = parse_lora_pair)]
    pub lora_adapter_names: Vec<(i64, String)>,

    /// An offload tier (e.g. LMCache) keeps blocks the engine evicts from GPU:
    /// re-report them at T2 instead of removing them.
    #[arg(long, env = "OFFLOAD_TIER")]
    pub offload_tier: bool,

    /// Pending blocks and events held while the server is slow or away; the
    /// oldest are dropped (and counted) beyond this.
    #[arg(long, env = "SUBSCRIBER_BUFFER_SIZE", default_value_t = DEFAULT_BUFFER_SIZE)]
    pub buffer_size: usize,

    /// Engine block hashes remembered for parent chaining and removals.
    #[arg(
        long,
        env = "SUBSCRIBER_MAX_TRACKED_BLOCKS",
        default_value_t = DEFAULT_MAX_TRACKED_BLOCKS
    )]
    pub max_tracked_blocks: usize,

    /// Most blocks carried by one CacheStateUpdate message.
    #[arg(long, default_value_t = DEFAULT_MAX_BLOCKS_PER_UPDATE)]
    pub max_blocks_per_update: usize,

    /// How long to wait for each message of the engine's replay socket
    /// (connect, first reply, every next reply).
    #[arg(long, default_value = DEFAULT_REPLAY_TIMEOUT, value_parser = inference_cache_index::parse_duration)]
    pub replay_timeout: Duration,

    /// How often every block still held is re-reported (keeping it inside
    /// the server's eviction TTL) along with a replica liveness event; `0s`
    /// disables it.
    #[arg(long, env = "SUBSCRIBER_REFRESH_INTERVAL", default_value = DEFAULT_REFRESH_INTERVAL, value_parser = inference_cache_index::parse_duration)]
    pub refresh_interval: Duration,

    /// How often the replica's liveness is sent (`PublishEvent(REPLICA_UPDATED)`
    /// naming tenant and model). Keep it well below the server's
    /// `replicaTimeout` (default 30s), e.g. a sixth of it, or the replica
    /// drops out of the serving set between heartbeats; `0s` disables it.
    #[arg(long, env = "SUBSCRIBER_HEARTBEAT_INTERVAL", default_value = DEFAULT_HEARTBEAT_INTERVAL, value_parser = inference_cache_index::parse_duration)]
    pub heartbeat_interval: Duration,

    /// The engine's Prometheus endpoint (`http://127.0.0.1:8000/metrics` for
    /// vLLM and SGLang), scraped every `--metrics-interval` and reported as
    /// the replica's load (`ReplicaStats`). Plain HTTP only.
    #[arg(long, env = "ENGINE_METRICS_URL")]
    pub engine_metrics_url: Option<String>,

    /// Scrape interval of `--engine-metrics-url`; each good scrape sends one
    /// stats-only `ReportCacheState` update.
    #[arg(long, env = "ENGINE_METRICS_INTERVAL", default_value = DEFAULT_METRICS_INTERVAL, value_parser = inference_cache_index::parse_duration)]
    pub metrics_interval: Duration,

    /// PEM CA bundle that verifies the server's certificate (`--server
    /// https://...`); the system's trust store otherwise.
    #[arg(long, env = "INFERENCE_CACHE_TLS_CA")]
    pub tls_ca: Option<PathBuf>,

    /// PEM client certificate (chain) presented to the server for mutual
    /// TLS; needs `--tls-key`.
    #[arg(long, env = "INFERENCE_CACHE_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,

    /// PEM private key of `--tls-cert`.
    #[arg(long, env = "INFERENCE_CACHE_TLS_KEY")]
    pub tls_key: Option<PathBuf>,

    /// Name the server's certificate must carry, when it differs from the
    /// host in `--server` (e.g. connecting by IP address).
    #[arg(long, env = "INFERENCE_CACHE_TLS_SERVER_NAME")]
    pub tls_server_name: Option<String>,

    /// File holding a bearer token sent as `authorization: Bearer <token>`
    /// on every call to the server; re-read on each (re)connect, so a
    /// rotated token is picked up.
    #[arg(long, env = "INFERENCE_CACHE_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,

    /// Listen address of the subscriber's own `/metrics`, `/healthz` and
    /// `/readyz` (503 while the engine's cache configuration disagrees with
    /// `--block-size` or prefix caching is off); `off` disables it.
    #[arg(
        long,
        env = "SUBSCRIBER_METRICS_LISTEN",
        default_value = DEFAULT_METRICS_LISTEN
    )]
    pub metrics_listen: String,
}

/// Wrapper so the flags can be parsed on their own (tests, the bench).
#[derive(Debug, Parser)]
#[command(name = "subscribe")]
struct StandaloneArgs {
    #[command(flatten)]
    args: SubscribeArgs,
}

impl SubscribeArgs {
    /// Parses the flags from an argument list whose first item is the
    /// program name, as `inference-cache subscribe` would.
    pub fn try_parse_from<I, T>(args: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        StandaloneArgs::try_parse_from(args).map(|parsed| parsed.args)
    }

    /// Checks the flags and resolves them into [`Settings`], one step per
    /// group of flags; the first bad flag is the error.
    pub fn resolve(&self) -> Result<Settings, SettingsError> {
        self.check_identity()?;
        let endpoints = self.endpoints()?;
        self.check_sizes()?;
        let lora_names = self.lora_names()?;
        let metrics_listen = self.metrics_listen()?;
        let ServerConnection { server, tls } = self.server_connection()?;
        let engine_metrics_url = self.engine_metrics_url()?;
        Ok(Settings {
            endpoints,
            topic: self.topic.clone(),
            server,
            replica_id: self.replica_id.clone(),
            tenant: self.tenant.clone(),
            model: self.model.clone(),
            hash_scheme: self.hash_scheme.clone(),
            block_size: self.block_size,
            lora_names,
            offload_tier: self.offload_tier,
            buffer_size: self.buffer_size,
            max_tracked_blocks: self.max_tracked_blocks,
            max_blocks_per_update: self.max_blocks_per_update,
            replay_timeout: self.replay_timeout,
            refresh_interval: (!self.refresh_interval.is_zero()).then_some(self.refresh_interval),
            heartbeat_interval: (!self.heartbeat_interval.is_zero())
                .then_some(self.heartbeat_interval),
            engine_metrics_url,
            metrics_interval: self.metrics_interval,
            tls,
            token_file: self.token_file.clone(),
            metrics_listen,
        })
    }

    /// Who reports, and where to: none of these may be blank.
    fn check_identity(&self) -> Result<(), SettingsError> {
        non_empty("--replica-id", &self.replica_id)?;
        non_empty("--tenant", &self.tenant)?;
        non_empty("--model", &self.model)?;
        non_empty("--hash-scheme", &self.hash_scheme)?;
        non_empty("--server", &self.server)
    }

    /// The publishers, each paired by position with its replay socket.
    fn endpoints(&self) -> Result<Vec<EndpointSettings>, SettingsError> {
        let endpoints: Vec<String> = self
            .endpoints
            .iter()
            .map(|e| e.trim().to_owned())
            .filter(|e| !e.is_empty())
            .collect();
        if endpoints.is_empty() {
            return Err(SettingsError::Empty("--endpoint"));
        }
        if self.replay_endpoints.len() > endpoints.len() {
            return Err(SettingsError::TooManyReplayEndpoints {
                endpoints: endpoints.len(),
                replay: self.replay_endpoints.len(),
            });
        }
        Ok(endpoints
            .into_iter()
            .enumerate()
            .map(|(index, endpoint)| EndpointSettings {
                endpoint,
                replay: self
                    .replay_endpoints
                    .get(index)
                    .map(|r| r.trim().to_owned())
                    .filter(|r| !r.is_empty()),
            })
            .collect())
    }

    /// Sizes that must be positive.
    fn check_sizes(&self) -> Result<(), SettingsError> {
        positive("--block-size", u64::from(self.block_size))?;
        positive("--buffer-size", self.buffer_size as u64)?;
        positive("--max-tracked-blocks", self.max_tracked_blocks as u64)?;
        positive("--max-blocks-per-update", self.max_blocks_per_update as u64)
    }

    /// Engine LoRA id → adapter name, each id named once.
    fn lora_names(&self) -> Result<HashMap<i64, Arc<str>>, SettingsError> {
        let mut lora_names = HashMap::new();
        for (id, name) in &self.lora_adapter_names {
            if lora_names
                .insert(*id, Arc::<str>::from(name.as_str()))
                .is_some()
            {
                return Err(SettingsError::DuplicateLoraId(*id));
            }
        }
        Ok(lora_names)
    }

    /// The subscriber's own `/metrics` listener, unless turned off.
    fn metrics_listen(&self) -> Result<Option<SocketAddr>, SettingsError> {
        match self.metrics_listen.trim() {
            "" | "off" | "none" => Ok(None),
            addr => addr
                .parse::<SocketAddr>()
                .map(Some)
                .map_err(|_| SettingsError::BadAddress(addr.to_owned())),
        }
    }

    /// The server's URI (`http://` added when no scheme is given) and, for
    /// `https://`, its TLS settings; TLS flags need `https://`.
    fn server_connection(&self) -> Result<ServerConnection, SettingsError> {
        let server = if self.server.contains("://") {
            self.server.trim().to_owned()
        } else {
            format!("http://{}", self.server.trim())
        };
        let https = server.starts_with("https://");
        if !https && !server.starts_with("http://") {
            return Err(SettingsError::BadServer(server));
        }
        if !https {
            tls_flag_unset("--tls-ca", self.tls_ca.is_some())?;
            tls_flag_unset("--tls-cert", self.tls_cert.is_some())?;
            tls_flag_unset("--tls-key", self.tls_key.is_some())?;
            tls_flag_unset("--tls-server-name", self.tls_server_name.is_some())?;
        }
        if self.tls_cert.is_some() != self.tls_key.is_some() {
            return Err(SettingsError::CertWithoutKey);
        }
        let tls = https.then(|| TlsSettings {
            ca: self.tls_ca.clone(),
            cert: self.tls_cert.clone(),
            key: self.tls_key.clone(),
            server_name: self
                .tls_server_name
                .as_deref()
                .map(str::trim)
                .filter(|n| !n.is_empty())
                .map(str::to_owned),
        });
        Ok(ServerConnection { server, tls })
    }

    /// The engine's Prometheus endpoint, unless off, and a scrape interval for it.
    fn engine_metrics_url(&self) -> Result<Option<MetricsUrl>, SettingsError> {
        let url = match self.engine_metrics_url.as_deref().map(str::trim) {
            None | Some("") | Some("off") => None,
            Some(url) => Some(MetricsUrl::parse(url)?),
        };
        if url.is_some() && self.metrics_interval.is_zero() {
            return Err(SettingsError::Zero("--metrics-interval"));
        }
        Ok(url)
    }
}

/// Where the subscriber reports: the server's URI and its TLS settings.
struct ServerConnection {
    /// `http://` or `https://` URI.
    server: String,
    /// `Some` exactly for `https://`.
    tls: Option<TlsSettings>,
}

fn non_empty(flag: &'static str, value: &str) -> Result<(), SettingsError> {
    if value.trim().is_empty() {
        return Err(SettingsError::Empty(flag));
    }
    Ok(())
}

fn positive(flag: &'static str, value: u64) -> Result<(), SettingsError> {
    if value == 0 {
        return Err(SettingsError::Zero(flag));
    }
    Ok(())
}

/// A TLS flag given for a plaintext server is an error.
fn tls_flag_unset(flag: &'static str, set: bool) -> Result<(), SettingsError> {
    if set {
        return Err(SettingsError::TlsWithoutHttps(flag));
    }
    Ok(())
}

/// One `id=name` item of `--lora-adapter-names`.
fn parse_lora_pair(item: &str) -> Result<(i64, String), String> {
    let (id, name) = item
        .split_once('=')
        .ok_or_else(|| format!("expected id=name, got {item:?}"))?;
    let id = id
        .trim()
        .parse::<i64>()
        .map_err(|_| format!("LoRA id must be an integer, got {:?}", id.trim()))?;
    let name = name.trim();
    if name.is_empty() {
        return Err(format!("empty adapter name for LoRA id {id}"));
    }
    Ok((id, name.to_owned()))
}

/// A flag combination that cannot run.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum SettingsError {
    /// A required value is empty.
    #[error("{0} must not be empty")]
    Empty(&'static str),
    /// A size that must be positive is zero.
    #[error("{0} must be greater than zero")]
    Zero(&'static str),
    /// More replay endpoints than event endpoints.
    #[error("{replay} replay endpoints for {endpoints} endpoints (they pair by position)")]
    TooManyReplayEndpoints {
        /// Number of `--endpoint` values.
        endpoints: usize,
        /// Number of `--replay-endpoint` values.
        replay: usize,
    },
    /// The same LoRA id is named twice.
    #[error("LoRA id {0} appears twice in --lora-adapter-names")]
    DuplicateLoraId(i64),
    /// `--metrics-listen` is not a socket address.
    #[error("--metrics-listen: {0:?} is not an ip:port address")]
    BadAddress(String),
    /// `--server` is neither `http://` nor `https://`.
    #[error("--server: {0:?} must be an http:// or https:// URI")]
    BadServer(String),
    /// A TLS flag was given for a plaintext server.
    #[error("{0} needs an https:// --server")]
    TlsWithoutHttps(&'static str),
    /// Only one of `--tls-cert` and `--tls-key`.
    #[error("--tls-cert and --tls-key go together")]
    CertWithoutKey,
    /// `--engine-metrics-url` is not a usable `http://host[:port]/path` URL.
    #[error("--engine-metrics-url: {url:?}: {reason}")]
    BadMetricsUrl {
        /// The value given.
        url: String,
        /// What is wrong with it.
        reason: &'static str,
    },
}

/// The engine's Prometheus endpoint, checked: plain HTTP, a host, a path
/// (`/metrics` when none is given).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetricsUrl {
    /// `host:port` to connect to (and send as `Host`).
    pub authority: String,
    /// Host part, for the TCP connect.
    pub host: String,
    /// TCP port (80 when the URL names none).
    pub port: u16,
    /// Path and query sent in the request line.
    pub path: String,
}

impl MetricsUrl {
    /// Parses `http://host[:port][/path]`.
    pub fn parse(url: &str) -> Result<Self, SettingsError> {
        let bad = |reason| SettingsError::BadMetricsUrl {
            url: url.to_owned(),
            reason,
        };
        let uri: hyper::Uri = url.parse().map_err(|_| bad("not a URL"))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some("https") => return Err(bad("only plain http:// is supported")),
            _ => return Err(bad("expected http://host:port/path")),
        }
        let authority = uri.authority().ok_or_else(|| bad("no host"))?;
        let host = authority.host();
        if host.is_empty() {
            return Err(bad("no host"));
        }
        // IPv6 literals come bracketed in the authority; connect without brackets.
        let host = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let path = match uri.path_and_query().map(|p| p.as_str()) {
            None | Some("") | Some("/") => "/metrics".to_owned(),
            Some(path) => path.to_owned(),
        };
        Ok(Self {
            authority: authority.as_str().to_owned(),
            host,
            port: authority.port_u16().unwrap_or(80),
            path,
        })
    }
}

impl std::fmt::Display for MetricsUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "http://{}{}", self.authority, self.path)
    }
}

/// TLS towards the server (`--server https://...`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsSettings {
    /// CA bundle verifying the server; the system's roots when `None`.
    pub ca: Option<PathBuf>,
    /// Client certificate for mutual TLS.
    pub cert: Option<PathBuf>,
    /// Key of `cert`.
    pub key: Option<PathBuf>,
    /// Expected server name, overriding the URI's host.
    pub server_name: Option<String>,
}

/// One engine publisher and its optional replay socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointSettings {
    /// ZMQ PUB endpoint, e.g. `tcp://10.0.0.5:5557`.
    pub endpoint: String,
    /// ZMQ ROUTER replay endpoint, when the engine exposes one.
    pub replay: Option<String>,
}

/// Validated subscriber configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// Publishers to subscribe to.
    pub endpoints: Vec<EndpointSettings>,
    /// ZMQ topic prefix.
    pub topic: String,
    /// gRPC server URI (with scheme).
    pub server: String,
    /// Replica id reported to the server.
    pub replica_id: String,
    /// Tenant id reported to the server.
    pub tenant: String,
    /// Model id reported to the server.
    pub model: String,
    /// Hash scheme reported to the server.
    pub hash_scheme: String,
    /// Tokens per block.
    pub block_size: u32,
    /// Engine LoRA id → stable adapter name.
    pub lora_names: HashMap<i64, Arc<str>>,
    /// Whether GPU evictions are re-reported at T2.
    pub offload_tier: bool,
    /// Capacity of the pending-work buffer, in blocks and events.
    pub buffer_size: usize,
    /// Capacity of the engine-hash → fingerprint map.
    pub max_tracked_blocks: usize,
    /// Blocks per CacheStateUpdate.
    pub max_blocks_per_update: usize,
    /// Replay answer timeout.
    pub replay_timeout: Duration,
    /// Interval of full re-reports, if enabled.
    pub refresh_interval: Option<Duration>,
    /// `/metrics` listen address, if any.
    pub metrics_listen: Option<SocketAddr>,
    /// Interval of `REPLICA_UPDATED` heartbeats, if enabled.
    pub heartbeat_interval: Option<Duration>,
    /// The engine's Prometheus endpoint, if load is reported.
    pub engine_metrics_url: Option<MetricsUrl>,
    /// Scrape interval of `engine_metrics_url`.
    pub metrics_interval: Duration,
    /// TLS settings; `Some` exactly when the server URI is `https://`.
    pub tls: Option<TlsSettings>,
    /// Bearer-token file, if calls are authenticated.
    pub token_file: Option<PathBuf>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> Vec<&'static str> {
        vec![
            "subscribe",
            "--replica-id",
            "r1",
            "--tenant",
            "team-a",
            "--model",
            "qwen",
        ]
    }

    /// The settings `base()` must resolve to: every other flag at its default constant.
    fn defaults(replica_id: &str, tenant: &str, model: &str) -> Settings {
        let duration = |text| inference_cache_index::parse_duration(text).expect("a duration");
        let some_duration = |text| Some(duration(text)).filter(|d: &Duration| !d.is_zero());
        Settings {
            endpoints: vec![EndpointSettings {
                endpoint: DEFAULT_ENDPOINT.to_owned(),
                replay: None,
            }],
            topic: DEFAULT_TOPIC.to_owned(),
            server: DEFAULT_SERVER.to_owned(),
            replica_id: replica_id.to_owned(),
            tenant: tenant.to_owned(),
            model: model.to_owned(),
            hash_scheme: DEFAULT_HASH_SCHEME.to_owned(),
            block_size: DEFAULT_BLOCK_SIZE,
            lora_names: HashMap::new(),
            offload_tier: false,
            buffer_size: DEFAULT_BUFFER_SIZE,
            max_tracked_blocks: DEFAULT_MAX_TRACKED_BLOCKS,
            max_blocks_per_update: DEFAULT_MAX_BLOCKS_PER_UPDATE,
            replay_timeout: duration(DEFAULT_REPLAY_TIMEOUT),
            refresh_interval: some_duration(DEFAULT_REFRESH_INTERVAL),
            metrics_listen: Some(DEFAULT_METRICS_LISTEN.parse().expect("an address")),
            heartbeat_interval: some_duration(DEFAULT_HEARTBEAT_INTERVAL),
            engine_metrics_url: None,
            metrics_interval: duration(DEFAULT_METRICS_INTERVAL),
            tls: None,
            token_file: None,
        }
    }

    /// Only the engine's identity given: every flag at its default constant.
    #[test]
    fn subscribe_without_optional_flags_is_the_default_configuration() {
        let settings = SubscribeArgs::try_parse_from(base())
            .expect("parse")
            .resolve()
            .expect("resolve");
        assert_eq!(settings, defaults("r1", "team-a", "qwen"));
    }

    #[test]
    fn defaults_resolve() {
        let args = SubscribeArgs::try_parse_from(base()).expect("parse");
        let settings = args.resolve().expect("resolve");
        assert_eq!(settings.hash_scheme, "vllm");
        assert_eq!(settings.block_size, 16);
        assert_eq!(settings.endpoints.len(), 1);
        assert_eq!(settings.endpoints[0].replay, None);
        assert!(!settings.offload_tier);
        assert_eq!(settings.server, "http://127.0.0.1:9090");
    }

    #[test]
    fn durations_use_the_server_grammar() {
        let mut argv = base();
        argv.extend([
            "--refresh-interval",
            "10min",
            "--heartbeat-interval",
            "1.5s",
        ]);
        let args = SubscribeArgs::try_parse_from(argv).expect("parse");
        assert_eq!(args.refresh_interval, Duration::from_secs(600));
        assert_eq!(args.heartbeat_interval, Duration::from_millis(1500));
        let mut argv = base();
        argv.extend(["--metrics-interval", "10 fortnights"]);
        assert!(SubscribeArgs::try_parse_from(argv).is_err());
    }

    #[test]
    fn lora_names_and_replay_pairs() {
        let mut argv = base();
        argv.extend([
            "--lora-adapter-names",
            "1=sql-lora,2=chat-lora",
            "--endpoint",
            "tcp://a:5557,tcp://a:5558",
            "--replay-endpoint",
            "tcp://a:5657",
            "--server",
            "10.0.0.1:9090",
            "--metrics-listen",
            "off",
        ]);
        let settings = SubscribeArgs::try_parse_from(argv)
            .expect("parse")
            .resolve()
            .expect("resolve");
        assert_eq!(settings.lora_names.get(&1).map(|n| &**n), Some("sql-lora"));
        assert_eq!(settings.lora_names.get(&2).map(|n| &**n), Some("chat-lora"));
        assert_eq!(
            settings.endpoints[0].replay.as_deref(),
            Some("tcp://a:5657")
        );
        assert_eq!(settings.endpoints[1].replay, None);
        assert_eq!(settings.server, "http://10.0.0.1:9090");
        assert_eq!(settings.metrics_listen, None);
    }

    #[test]
    fn bad_values_are_rejected_with_the_flag_name() {
        let mut argv = base();
        argv.extend(["--lora-adapter-names", "x=a"]);
        assert!(SubscribeArgs::try_parse_from(argv).is_err());

        let mut argv = base();
        argv.extend(["--lora-adapter-names", "1=a,1=b"]);
        let args = SubscribeArgs::try_parse_from(argv).expect("parse");
        assert_eq!(
            args.resolve().err(),
            Some(SettingsError::DuplicateLoraId(1))
        );

        let mut argv = base();
        argv.extend(["--block-size", "0"]);
        let args = SubscribeArgs::try_parse_from(argv).expect("parse");
        assert_eq!(
            args.resolve().err(),
            Some(SettingsError::Zero("--block-size"))
        );

        let mut args = SubscribeArgs::try_parse_from(base()).expect("parse");
        args.tenant = String::new();
        assert_eq!(args.resolve().err(), Some(SettingsError::Empty("--tenant")));
    }

    fn resolve(extra: &[&str]) -> Result<Settings, SettingsError> {
        let mut argv = base();
        argv.extend(extra);
        SubscribeArgs::try_parse_from(argv)
            .expect("parse")
            .resolve()
    }

    #[test]
    fn membership_and_load_defaults() {
        let settings = resolve(&[]).expect("resolve");
        assert_eq!(settings.heartbeat_interval, Some(Duration::from_secs(5)));
        assert_eq!(settings.engine_metrics_url, None);
        assert_eq!(settings.metrics_interval, Duration::from_secs(1));
        assert_eq!(settings.tls, None);
        assert_eq!(settings.token_file, None);
        let settings = resolve(&["--heartbeat-interval", "0s"]).expect("resolve");
        assert_eq!(settings.heartbeat_interval, None);
    }

    #[test]
    fn engine_metrics_urls() {
        let settings =
            resolve(&["--engine-metrics-url", "http://127.0.0.1:8000/metrics"]).expect("resolve");
        let url = settings.engine_metrics_url.expect("url");
        assert_eq!(url.host, "127.0.0.1");
        assert_eq!(url.port, 8000);
        assert_eq!(url.path, "/metrics");
        assert_eq!(url.to_string(), "http://127.0.0.1:8000/metrics");
        let url = MetricsUrl::parse("http://engine").expect("url");
        assert_eq!((url.port, url.path.as_str()), (80, "/metrics"));
        let url = MetricsUrl::parse("http://[::1]:9/m?x=1").expect("url");
        assert_eq!((url.host.as_str(), url.path.as_str()), ("::1", "/m?x=1"));
        for bad in [
            "https://e:8000/metrics",
            "127.0.0.1:8000",
            "ftp://e/",
            "http://",
        ] {
            assert!(
                matches!(
                    MetricsUrl::parse(bad),
                    Err(SettingsError::BadMetricsUrl { .. })
                ),
                "{bad} accepted"
            );
        }
        assert_eq!(
            resolve(&[
                "--engine-metrics-url",
                "http://e/",
                "--metrics-interval",
                "0s"
            ])
            .err(),
            Some(SettingsError::Zero("--metrics-interval"))
        );
    }

    #[test]
    fn tls_flags() {
        let settings = resolve(&[
            "--server",
            "https://policy:9443",
            "--tls-ca",
            "/ca.pem",
            "--tls-cert",
            "/c.pem",
            "--tls-key",
            "/c.key",
            "--tls-server-name",
            "policy.svc",
            "--token-file",
            "/token",
        ])
        .expect("resolve");
        let tls = settings.tls.expect("tls");
        assert_eq!(tls.ca, Some(PathBuf::from("/ca.pem")));
        assert_eq!(tls.server_name.as_deref(), Some("policy.svc"));
        assert_eq!(settings.token_file, Some(PathBuf::from("/token")));
        assert!(
            resolve(&["--server", "https://p:1"])
                .expect("resolve")
                .tls
                .is_some()
        );
        assert_eq!(
            resolve(&["--tls-ca", "/ca.pem"]).err(),
            Some(SettingsError::TlsWithoutHttps("--tls-ca"))
        );
        assert_eq!(
            resolve(&["--server", "https://p:1", "--tls-cert", "/c.pem"]).err(),
            Some(SettingsError::CertWithoutKey)
        );
        assert!(matches!(
            resolve(&["--server", "grpc://p:1"]).err(),
            Some(SettingsError::BadServer(_))
        ));
    }

    #[test]
    fn each_step_names_its_flag_and_the_first_bad_one_wins() {
        assert_eq!(
            resolve(&["--endpoint", " "]).err(),
            Some(SettingsError::Empty("--endpoint"))
        );
        assert_eq!(
            resolve(&["--replay-endpoint", "tcp://a:1,tcp://a:2"]).err(),
            Some(SettingsError::TooManyReplayEndpoints {
                endpoints: 1,
                replay: 2
            })
        );
        assert_eq!(
            resolve(&["--max-blocks-per-update", "0"]).err(),
            Some(SettingsError::Zero("--max-blocks-per-update"))
        );
        assert_eq!(
            resolve(&["--metrics-listen", "here"]).err(),
            Some(SettingsError::BadAddress("here".into()))
        );
        assert_eq!(
            resolve(&["--tls-server-name", "p"]).err(),
            Some(SettingsError::TlsWithoutHttps("--tls-server-name"))
        );
        // Identity before endpoints before sizes before the server.
        assert_eq!(
            resolve(&["--hash-scheme", "", "--endpoint", "", "--block-size", "0"]).err(),
            Some(SettingsError::Empty("--hash-scheme"))
        );
        assert_eq!(
            resolve(&["--block-size", "0", "--server", "grpc://p:1"]).err(),
            Some(SettingsError::Zero("--block-size"))
        );
    }
}
