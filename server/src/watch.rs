//! `inference-cache watch`: prints a server's `StreamCacheEvents` feed, one
//! line per index change, until the server ends the stream or Ctrl-C.
//!
//! The feed of any one server shows the whole fleet when the servers share a
//! log (`--nats-url`). Tenant, model and type filters are applied by the
//! server; the replica filter here, on the client.

use std::fmt::Write as _;

use anyhow::Context as _;
use inference_cache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;
use inference_cache_proto::v1alpha1::{CacheEvent, StreamEventsRequest, cache_event};

/// Flags of `inference-cache watch`.
#[derive(Debug, Clone, clap::Args)]
pub struct WatchArgs {
    /// gRPC address of the policy server.
    #[arg(
        long,
        default_value = "http://127.0.0.1:9090",
        env = "INFERENCE_CACHE_SERVER"
    )]
    pub server: String,

    /// Only this tenant's changes.
    #[arg(long)]
    pub tenant: Option<String>,

    /// Only this model's changes.
    #[arg(long)]
    pub model: Option<String>,

    /// Only these event types (repeatable): PREFIX_ADDED, PREFIX_EVICTED, REPLICA_UPDATED, ALL_CLEARED.
    #[arg(long = "type", value_parser = parse_type)]
    pub types: Vec<cache_event::Type>,

    /// Only this replica's changes.
    #[arg(long)]
    pub replica: Option<String>,

    /// Bearer token, when the server runs with --auth-file.
    #[arg(long, env = "INFERENCE_CACHE_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
}

fn parse_type(text: &str) -> Result<cache_event::Type, String> {
    cache_event::Type::from_str_name(text)
        .filter(|t| *t != cache_event::Type::Unspecified)
        .ok_or_else(|| {
            "one of PREFIX_ADDED, PREFIX_EVICTED, REPLICA_UPDATED, ALL_CLEARED".to_owned()
        })
}

/// One event as a line: time, type, tenant, model, replica, adapter, prefix (hex).
pub fn format_event(event: &CacheEvent) -> String {
    let kind = cache_event::Type::try_from(event.r#type).map_or("UNKNOWN", |t| t.as_str_name());
    let seconds = event.timestamp_us.div_euclid(1_000_000);
    let micros = event.timestamp_us.rem_euclid(1_000_000);
    let mut line = format!(
        "{seconds}.{micros:06} {kind:<15} tenant={} model={} replica={}",
        event.tenant_id, event.model_id, event.replica_id
    );
    if !event.adapter_id.is_empty() {
        let _ = write!(line, " adapter={}", event.adapter_id);
    }
    if !event.prefix_hash.is_empty() {
        line.push_str(" prefix=");
        for b in &event.prefix_hash {
            let _ = write!(line, "{b:02x}");
        }
    }
    line
}

/// Connects and prints events until the stream ends.
pub async fn run(args: WatchArgs) -> anyhow::Result<()> {
    let mut client = InferenceCacheClient::connect(args.server.clone())
        .await
        .with_context(|| format!("connecting to {}", args.server))?;
    let mut request = tonic::Request::new(StreamEventsRequest {
        tenant_id: args.tenant.unwrap_or_default(),
        model_id: args.model.unwrap_or_default(),
        types: args.types.iter().map(|t| *t as i32).collect(),
    });
    if let Some(token) = &args.token {
        let value = format!("Bearer {token}")
            .parse()
            .context("--token is not a valid header value")?;
        request.metadata_mut().insert("authorization", value);
    }
    let mut events = client
        .stream_cache_events(request)
        .await
        .context("StreamCacheEvents")?
        .into_inner();
    while let Some(event) = events.message().await.context("StreamCacheEvents")? {
        if args
            .replica
            .as_deref()
            .is_some_and(|r| r != event.replica_id)
        {
            continue;
        }
        println!("{}", format_event(&event));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_print_as_one_readable_line() {
        let event = CacheEvent {
            r#type: cache_event::Type::PrefixEvicted as i32,
            replica_id: "10.0.0.1:8000".into(),
            model_id: "llama".into(),
            tenant_id: "team-a".into(),
            prefix_hash: vec![0xab, 0x01],
            timestamp_us: 1_700_000_000_000_042,
            adapter_id: "sql-lora".into(),
        };
        assert_eq!(
            format_event(&event),
            "1700000000.000042 PREFIX_EVICTED  tenant=team-a model=llama replica=10.0.0.1:8000 adapter=sql-lora prefix=ab01"
        );
        assert_eq!(parse_type("ALL_CLEARED"), Ok(cache_event::Type::AllCleared));
        assert!(parse_type("TYPE_UNSPECIFIED").is_err());
        assert!(parse_type("nope").is_err());
    }
}
