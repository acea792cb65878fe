//! The shared event log: many servers, one index, on a NATS JetStream stream.
//!
//! With `--nats-url` every accepted ingest (a `ReportCacheState` update, a
//! `PublishEvent` event) is applied to the local index at once and appended
//! to one JetStream stream; every server consumes that stream from its start
//! and applies what the *other* servers appended. A write to any server thus
//! reaches every server's index, and a new or restarted server rebuilds its
//! index from the stream before `/readyz` answers 200.
//!
//! Wire form (language-neutral): subject `<prefix>.update.<origin>` carries a
//! protobuf `CacheStateUpdate`, `<prefix>.event.<origin>` a `CacheEvent`, and
//! `<prefix>.batch.<origin>` several of them in the order they were accepted,
//! as the protobuf message `LogBatch { repeated LogRecord records = 1; }`,
//! `LogRecord { oneof record { CacheStateUpdate update = 1; CacheEvent event = 2; } }`.
//! `<origin>` is the appending server's instance id, random per process.
//! `Nats-Msg-Id` is `<origin>-<n>` (`n` counts the messages of the origin) so
//! a retried message is stored once. A server writes one append as a single
//! message and several appends that are queued together as one batch of at
//! most [`MAX_BATCH_BYTES`]; it reads all three forms.
//!
//! Apply-once rule: the receiving server applies its own writes locally
//! (read-your-writes, and writes keep working while NATS is down) and skips
//! messages of its own origin when they come back from the stream.
//!
//! Concurrency: ingest calls [`LogSink::append`], a non-blocking `try_send`
//! into a bounded queue (`--nats-buffer`); a full queue drops the append and
//! counts it. One publisher task drains the queue — everything queued at
//! that moment goes into one message, so under load the per-message costs
//! (a publish, an acknowledgement, a stored and delivered message) are paid
//! once per batch, and an idle server still sends each append at once — with
//! up to `--nats-max-in-flight` unacknowledged publishes, and retries a failed
//! one with the same message id. One consumer task applies the stream in order;
//! while catching up it sets the index clock to each message's publish time so
//! replayed entries keep their age (see [`ReplayClock`]).
//!
//! Cost: one protobuf encode (written straight from the index update into
//! one buffer, see [`encode_update`]) and one queue send per ingest on the
//! hot path; everything else runs on the two background tasks. A batch is
//! framed by copying the encoded appends, and read back record by record
//! (see [`batch_records`]) without materialising the whole batch. docs/scale-out.md has
//! the operator's view and the measured numbers.

use std::collections::VecDeque;
use std::hash::BuildHasher as _;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ::bytes::Bytes;
use async_nats::jetstream::{self, consumer, stream};
use futures::stream::FuturesOrdered;
use futures::{Future, StreamExt as _};
use inference_cache_index::{self as index, Clock};
use inference_cache_proto::v1alpha1::{CacheEvent, CacheStateUpdate, ReplicaStats};
use inference_cache_runtime::Backoff;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use prost::Message as _;
use prost::encoding::{
    WireType, bytes as pb_bytes, decode_key, decode_varint, encode_key, encode_varint,
    encoded_len_varint, int32, int64, key_len, message, string,
};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::index_runtime::IndexState;

/// Default `--nats-stream`.
pub const DEFAULT_STREAM: &str = "INFERENCE_CACHE";
/// Default `--nats-subject-prefix`.
pub const DEFAULT_SUBJECT_PREFIX: &str = "inferencecache.v1";
/// Default `--nats-max-age`: the default eviction TTL (30 min) with margin.
pub const DEFAULT_MAX_AGE: &str = "1h";
/// Default `--nats-max-bytes` (JetStream reserves it out of the NATS
/// server's storage limit when the stream is created).
pub const DEFAULT_MAX_BYTES: i64 = 1 << 30;
/// Default `--nats-duplicate-window`.
pub const DEFAULT_DUPLICATE_WINDOW: &str = "2m";
/// Default `--nats-buffer`.
pub const DEFAULT_BUFFER: u64 = 65_536;
/// Default `--nats-max-in-flight`.
pub const DEFAULT_MAX_IN_FLIGHT: u64 = 1_024;
/// Default `--nats-catch-up-timeout`.
pub const DEFAULT_CATCH_UP_TIMEOUT: &str = "5m";
/// Default `--nats-ack-timeout`.
pub const DEFAULT_ACK_TIMEOUT: &str = "5s";

/// The first wait of the publisher and consumer before retrying after an error.
const INITIAL_BACKOFF: Duration = Duration::from_millis(50);
/// How long the publisher and consumer wait before retrying after an error, at most.
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// Encoded size of a batch message at most (a single append larger than
/// this is sent alone); well under NATS's default 1 MiB `max_payload`.
pub const MAX_BATCH_BYTES: usize = 256 * 1024;

/// A decoded log record.
enum Record {
    Update(CacheStateUpdate),
    Event(CacheEvent),
}

/// Wire-format tags of a batch: `LogBatch.records` and, inside a
/// `LogRecord`, `update` and `event`.
const BATCH_RECORDS_TAG: u32 = 1;
const RECORD_UPDATE_TAG: u32 = 1;
const RECORD_EVENT_TAG: u32 = 2;

/// Flags of the shared event log, flattened into `inference-cache serve`.
#[derive(Debug, Clone, clap::Args)]
pub struct ReplicationArgs {
    /// NATS server URL(s), comma-separated (e.g. nats://nats:4222); enables the shared JetStream event log. Off by default.
    #[arg(long, env = "INFERENCE_CACHE_NATS_URL")]
    pub nats_url: Option<String>,

    /// JetStream stream holding the log (created if missing).
    #[arg(long, default_value = DEFAULT_STREAM, env = "INFERENCE_CACHE_NATS_STREAM")]
    pub nats_stream: String,

    /// Subject prefix of the log: <prefix>.update.<origin> and <prefix>.event.<origin>.
    #[arg(long, default_value = DEFAULT_SUBJECT_PREFIX, env = "INFERENCE_CACHE_NATS_SUBJECT_PREFIX")]
    pub nats_subject_prefix: String,

    /// Stream retention by age, set when the stream is created; keep it at least the longest evictionTTL.
    #[arg(long, default_value = DEFAULT_MAX_AGE, value_parser = crate::limits::parse_duration, env = "INFERENCE_CACHE_NATS_MAX_AGE")]
    pub nats_max_age: Duration,

    /// Stream retention by size in bytes (oldest messages go first), set when the stream is created; JetStream reserves it, so it must fit the NATS server's storage limit.
    #[arg(long, default_value_t = DEFAULT_MAX_BYTES, env = "INFERENCE_CACHE_NATS_MAX_BYTES")]
    pub nats_max_bytes: i64,

    /// Window in which JetStream drops a re-sent append with the same Nats-Msg-Id.
    #[arg(long, default_value = DEFAULT_DUPLICATE_WINDOW, value_parser = crate::limits::parse_duration, env = "INFERENCE_CACHE_NATS_DUPLICATE_WINDOW")]
    pub nats_duplicate_window: Duration,

    /// Keep the stream in memory instead of on disk (lost when NATS restarts).
    #[arg(long, env = "INFERENCE_CACHE_NATS_MEMORY_STORAGE")]
    pub nats_memory_storage: bool,

    /// Appends queued for the publisher; past it appends are dropped and counted (replication_appends_dropped_total{reason="buffer_full"}).
    #[arg(long, default_value_t = DEFAULT_BUFFER, value_parser = clap::value_parser!(u64).range(1..), env = "INFERENCE_CACHE_NATS_BUFFER")]
    pub nats_buffer: u64,

    /// Log messages (one append, or a batch of queued appends) published and not yet acknowledged by JetStream; past it the publisher waits (counted as replication_publish_window_full_total).
    #[arg(long, default_value_t = DEFAULT_MAX_IN_FLIGHT, value_parser = clap::value_parser!(u64).range(1..), env = "INFERENCE_CACHE_NATS_MAX_IN_FLIGHT")]
    pub nats_max_in_flight: u64,

    /// How long one append waits for JetStream's acknowledgement before it is retried.
    #[arg(long, default_value = DEFAULT_ACK_TIMEOUT, value_parser = crate::limits::parse_duration, env = "INFERENCE_CACHE_NATS_ACK_TIMEOUT")]
    pub nats_ack_timeout: Duration,

    /// Longest /readyz waits for the catch-up from the stream; then the server reports ready anyway (counted, fail open).
    #[arg(long, default_value = DEFAULT_CATCH_UP_TIMEOUT, value_parser = crate::limits::parse_duration, env = "INFERENCE_CACHE_NATS_CATCH_UP_TIMEOUT")]
    pub nats_catch_up_timeout: Duration,
}

impl ReplicationArgs {
    /// Resolves the flags: `None` without `--nats-url`.
    pub fn into_settings(self) -> Option<ReplicationSettings> {
        let url = self.nats_url.filter(|u| !u.trim().is_empty())?;
        Some(ReplicationSettings {
            url,
            stream: self.nats_stream,
            subject_prefix: self.nats_subject_prefix,
            max_age: self.nats_max_age,
            max_bytes: self.nats_max_bytes,
            duplicate_window: self.nats_duplicate_window,
            memory_storage: self.nats_memory_storage,
            buffer: usize::try_from(self.nats_buffer).unwrap_or(usize::MAX),
            max_in_flight: usize::try_from(self.nats_max_in_flight).unwrap_or(usize::MAX),
            ack_timeout: self.nats_ack_timeout,
            catch_up_timeout: self.nats_catch_up_timeout,
        })
    }
}

/// Resolved settings of the shared event log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicationSettings {
    /// NATS server URL(s), comma-separated.
    pub url: String,
    /// Stream name.
    pub stream: String,
    /// Subject prefix.
    pub subject_prefix: String,
    /// Retention by age.
    pub max_age: Duration,
    /// Retention by size.
    pub max_bytes: i64,
    /// De-duplication window.
    pub duplicate_window: Duration,
    /// Memory instead of file storage.
    pub memory_storage: bool,
    /// Queue of appends waiting for the publisher.
    pub buffer: usize,
    /// Unacknowledged publishes.
    pub max_in_flight: usize,
    /// Acknowledgement timeout of one publish.
    pub ack_timeout: Duration,
    /// Longest wait for the catch-up before reporting ready anyway.
    pub catch_up_timeout: Duration,
}

impl ReplicationSettings {
    /// Settings with every default and `url`.
    pub fn new(url: impl Into<String>) -> Self {
        let duration = |text| crate::limits::parse_duration(text).unwrap_or_default();
        Self {
            url: url.into(),
            stream: DEFAULT_STREAM.to_owned(),
            subject_prefix: DEFAULT_SUBJECT_PREFIX.to_owned(),
            max_age: duration(DEFAULT_MAX_AGE),
            max_bytes: DEFAULT_MAX_BYTES,
            duplicate_window: duration(DEFAULT_DUPLICATE_WINDOW),
            memory_storage: false,
            buffer: usize::try_from(DEFAULT_BUFFER).unwrap_or(usize::MAX),
            max_in_flight: usize::try_from(DEFAULT_MAX_IN_FLIGHT).unwrap_or(usize::MAX),
            ack_timeout: duration(DEFAULT_ACK_TIMEOUT),
            catch_up_timeout: duration(DEFAULT_CATCH_UP_TIMEOUT),
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: String,
}

/// Metrics of the shared log (prefix `inferencecache_replication_`).
#[derive(Debug, Clone, Default)]
struct ReplicationMetrics {
    appends: Counter,
    dropped: Family<ReasonLabel, Counter>,
    published: Counter,
    publish_failures: Counter,
    window_full: Counter,
    applied: Family<KindLabel, Counter>,
    /// `applied{kind="update"}` and `{kind="event"}`, looked up once.
    applied_update: Counter,
    applied_event: Counter,
    skipped_own: Counter,
    decode_errors: Counter,
    consumer_restarts: Counter,
    last_sequence: Gauge,
    caught_up: Gauge,
    catch_up_ms: Gauge,
    catch_up_timeouts: Counter,
    connected: Gauge,
}

impl ReplicationMetrics {
    /// Counts `n` appends dropped for `reason`.
    fn drop(&self, reason: &str, n: u64) {
        self.dropped
            .get_or_create(&ReasonLabel {
                reason: reason.to_owned(),
            })
            .inc_by(n);
    }

    fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        let r = registry.sub_registry_with_prefix("replication");
        r.register(
            "appends",
            "Accepted ingests queued for the shared log",
            m.appends.clone(),
        );
        r.register(
            "appends_dropped",
            "Appends to the shared log dropped, by reason (buffer_full: --nats-buffer reached; stopped: publisher gone)",
            m.dropped.clone(),
        );
        r.register(
            "published",
            "Appends acknowledged by JetStream (a batch message counts its appends)",
            m.published.clone(),
        );
        r.register(
            "publish_failures",
            "Publishes (single or batch messages) not acknowledged in --nats-ack-timeout or refused; each is retried with its message id",
            m.publish_failures.clone(),
        );
        r.register(
            "publish_window_full",
            "Times the publisher waited because --nats-max-in-flight publishes were unacknowledged",
            m.window_full.clone(),
        );
        r.register(
            "applied",
            "Updates and events of other servers applied from the log, by kind (update, event; each record of a batch counts)",
            m.applied.clone(),
        );
        r.register(
            "skipped_own",
            "Log messages of this server skipped when read back (already applied locally)",
            m.skipped_own.clone(),
        );
        r.register(
            "decode_errors",
            "Log messages (or records of a batch) that were not a valid CacheStateUpdate / CacheEvent / LogBatch on a known subject",
            m.decode_errors.clone(),
        );
        r.register(
            "consumer_restarts",
            "Times the stream consumer was (re)opened after an error or a lost connection",
            m.consumer_restarts.clone(),
        );
        r.register(
            "last_sequence",
            "Stream sequence of the last log message read",
            m.last_sequence.clone(),
        );
        r.register(
            "caught_up",
            "1 once the index has applied the stream up to where it was at start-up",
            m.caught_up.clone(),
        );
        r.register(
            "catch_up_milliseconds",
            "Time from start-up to caught up",
            m.catch_up_ms.clone(),
        );
        r.register(
            "catch_up_timeouts",
            "Start-ups that reported ready after --nats-catch-up-timeout without catching up",
            m.catch_up_timeouts.clone(),
        );
        r.register(
            "connected",
            "1 while connected to NATS",
            m.connected.clone(),
        );
        for reason in ["buffer_full", "stopped"] {
            let _ = m.dropped.get_or_create(&ReasonLabel {
                reason: reason.to_owned(),
            });
        }
        let applied = |kind: &str| {
            m.applied
                .get_or_create(&KindLabel {
                    kind: kind.to_owned(),
                })
                .clone()
        };
        let (applied_update, applied_event) = (applied(KIND_UPDATE), applied(KIND_EVENT));
        Self {
            applied_update,
            applied_event,
            ..m
        }
    }
}

const KIND_UPDATE: &str = "update";
const KIND_EVENT: &str = "event";
const KIND_BATCH: &str = "batch";

/// The index clock while replicating: the wall clock, or, while the log is
/// replayed at start-up, the publish time of the message being applied, so
/// replayed entries and heartbeats keep their real age (and ones older than
/// the TTL expire instead of looking fresh).
pub struct ReplayClock {
    base: Arc<dyn Clock>,
    /// 0 = follow `base`.
    replaying_at_ms: AtomicU64,
}

impl ReplayClock {
    /// Wraps `base`.
    pub fn new(base: Arc<dyn Clock>) -> Self {
        Self {
            base,
            replaying_at_ms: AtomicU64::new(0),
        }
    }

    fn replay_at(&self, ms: u64) {
        // Never ahead of the wall clock.
        let ms = ms.min(self.base.now_ms()).max(1);
        self.replaying_at_ms.store(ms, Ordering::Release);
    }

    fn follow_wall_clock(&self) {
        self.replaying_at_ms.store(0, Ordering::Release);
    }
}

impl Clock for ReplayClock {
    fn now_ms(&self) -> u64 {
        match self.replaying_at_ms.load(Ordering::Acquire) {
            0 => self.base.now_ms(),
            ms => ms,
        }
    }
}

/// One append waiting for the publisher, already encoded (on the ingest
/// path: one buffer, no copy of the update's hashes).
#[derive(Debug)]
struct LogEntry {
    /// `KIND_UPDATE` (a `CacheStateUpdate`) or `KIND_EVENT` (a `CacheEvent`).
    kind: &'static str,
    payload: Vec<u8>,
}

impl LogEntry {
    fn record_tag(&self) -> u32 {
        if self.kind == KIND_EVENT {
            RECORD_EVENT_TAG
        } else {
            RECORD_UPDATE_TAG
        }
    }

    /// Size of the `LogRecord` it becomes in a batch.
    fn record_len(&self) -> usize {
        key_len(self.record_tag())
            + encoded_len_varint(self.payload.len() as u64)
            + self.payload.len()
    }

    /// Encoded size as a record of a batch (the record's own tag and length
    /// prefix included).
    fn batch_len(&self) -> usize {
        let record = self.record_len();
        key_len(BATCH_RECORDS_TAG) + encoded_len_varint(record as u64) + record
    }

    /// Appends it to `buf` as one `LogBatch.records` entry.
    fn encode_record(&self, buf: &mut Vec<u8>) {
        encode_key(BATCH_RECORDS_TAG, WireType::LengthDelimited, buf);
        encode_varint(self.record_len() as u64, buf);
        encode_key(self.record_tag(), WireType::LengthDelimited, buf);
        encode_varint(self.payload.len() as u64, buf);
        buf.extend_from_slice(&self.payload);
    }
}

/// The records of a batch message, in order: (kind, encoded message); an
/// item is `None` where the batch does not parse (the rest is then skipped).
fn batch_records(mut buf: &[u8]) -> impl Iterator<Item = Option<(&'static str, &[u8])>> {
    fn field<'a>(buf: &mut &'a [u8]) -> Option<(u32, &'a [u8])> {
        let (tag, wire_type) = decode_key(buf).ok()?;
        if wire_type != WireType::LengthDelimited {
            return None;
        }
        let len = usize::try_from(decode_varint(buf).ok()?).ok()?;
        let value = buf.get(..len)?;
        *buf = &buf[len..];
        Some((tag, value))
    }
    let mut failed = false;
    std::iter::from_fn(move || {
        if failed || buf.is_empty() {
            return None;
        }
        let record = field(&mut buf).and_then(|(tag, mut record)| {
            let (kind, value) = field(&mut record)?;
            let kind = match (tag, kind) {
                (BATCH_RECORDS_TAG, RECORD_UPDATE_TAG) => KIND_UPDATE,
                (BATCH_RECORDS_TAG, RECORD_EVENT_TAG) => KIND_EVENT,
                _ => return None,
            };
            record.is_empty().then_some((kind, value))
        });
        failed = record.is_none();
        Some(record)
    })
}

/// The append side, held by the index runtime: never blocks, never fails the caller.
pub struct LogSink {
    queue: mpsc::Sender<LogEntry>,
    metrics: ReplicationMetrics,
}

impl LogSink {
    /// Queues an accepted update (after limits).
    pub fn append_update(&self, update: &index::CacheUpdate) {
        self.append(LogEntry {
            kind: KIND_UPDATE,
            payload: encode_update(update, crate::streams::now_us()),
        });
    }

    /// Queues an accepted event.
    pub fn append_event(&self, event: &index::CacheEvent) {
        self.append(LogEntry {
            kind: KIND_EVENT,
            payload: crate::streams::wire_event(event).encode_to_vec(),
        });
    }

    fn append(&self, entry: LogEntry) {
        let reason = match self.queue.try_send(entry) {
            Ok(()) => {
                self.metrics.appends.inc();
                return;
            }
            Err(mpsc::error::TrySendError::Full(_)) => "buffer_full",
            Err(mpsc::error::TrySendError::Closed(_)) => "stopped",
        };
        self.metrics.drop(reason, 1);
    }
}

/// The index update as the wire message the log carries, stamped
/// `timestamp_us`: the bytes `wire_update(update).encode_to_vec()` gives,
/// written without building the message (which would copy every hash).
/// An entry the edge refused travels as the smallest entry refused for the
/// same reason ([`refused_entry`]), so every server counts it as dropped.
fn encode_update(update: &index::CacheUpdate, timestamp_us: i64) -> Vec<u8> {
    let strings = |buf: &mut Vec<u8>, fields: &[(u32, &String)]| {
        for (tag, value) in fields {
            if !value.is_empty() {
                string::encode(*tag, value, buf);
            }
        }
    };
    let stats = update.stats.as_ref().map(wire_stats);
    let prefixes: Vec<usize> = update.prefixes.iter().map(prefix_len).collect();
    let mut buf = Vec::with_capacity(
        128 + update.replica_id.len()
            + update.model_id.len()
            + update.tenant_id.len()
            + update.hash_scheme.len()
            + update.adapter_id.len()
            + prefixes.iter().map(|len| len + 6).sum::<usize>()
            + update.rejected.len() * 7
            + stats.as_ref().map_or(0, |s| s.encoded_len() + 6),
    );
    strings(
        &mut buf,
        &[
            (1, &update.replica_id),
            (2, &update.model_id),
            (3, &update.tenant_id),
            (4, &update.hash_scheme),
        ],
    );
    if timestamp_us != 0 {
        int64::encode(5, &timestamp_us, &mut buf);
    }
    for (p, len) in update.prefixes.iter().zip(prefixes) {
        encode_key(6, WireType::LengthDelimited, &mut buf);
        encode_varint(len as u64, &mut buf);
        if !p.prefix_hash.is_empty() {
            pb_bytes::encode(1, &p.prefix_hash, &mut buf);
        }
        let token_count = wire_count(p.token_count);
        if token_count != 0 {
            int32::encode(2, &token_count, &mut buf);
        }
        for hash in p.chain.hashes() {
            encode_key(3, WireType::LengthDelimited, &mut buf);
            encode_varint(hash.len() as u64, &mut buf);
            buf.extend_from_slice(hash);
        }
        if !p.chain.is_empty() {
            encode_key(4, WireType::LengthDelimited, &mut buf);
            encode_varint(counts_len(&p.chain) as u64, &mut buf);
            for &n in p.chain.token_counts() {
                encode_varint(u64::from(wire_count(n).unsigned_abs()), &mut buf);
            }
        }
        let tier = p.tier as i32;
        if tier != 0 {
            int32::encode(5, &tier, &mut buf);
        }
        strings(&mut buf, &[(6, &p.adapter_id)]);
    }
    for &reason in &update.rejected {
        let entry = refused_entry(reason);
        encode_key(6, WireType::LengthDelimited, &mut buf);
        encode_varint(entry.len() as u64, &mut buf);
        buf.extend_from_slice(entry);
    }
    if let Some(stats) = &stats {
        message::encode(7, stats, &mut buf);
    }
    strings(&mut buf, &[(8, &update.adapter_id)]);
    buf
}

/// The encoded `PrefixEntry` a refused entry travels as: one token count
/// and no hash (`block_token_counts: [0]`) for a malformed chain, one empty
/// hash (`block_hashes: [""]`, `block_token_counts: [0]`) for an empty one.
fn refused_entry(reason: index::DropReason) -> &'static [u8] {
    match reason {
        index::DropReason::MalformedChain => &[0x22, 0x01, 0x00],
        _ => &[0x1a, 0x00, 0x22, 0x01, 0x00],
    }
}

/// A token count as the wire's `int32` (the index's counts came from it).
fn wire_count(n: u32) -> i32 {
    i32::try_from(n).unwrap_or(i32::MAX)
}

/// Encoded size of a chain's packed token counts (without tag and length).
fn counts_len(chain: &index::BlockChain) -> usize {
    chain
        .token_counts()
        .iter()
        .map(|&n| encoded_len_varint(u64::from(wire_count(n).unsigned_abs())))
        .sum()
}

/// Encoded size of a chain's `block_hashes` and `block_token_counts`.
fn chain_len(chain: &index::BlockChain) -> usize {
    let hashes: usize = chain
        .hashes()
        .map(|h| key_len(3) + encoded_len_varint(h.len() as u64) + h.len())
        .sum();
    if chain.is_empty() {
        return hashes;
    }
    let counts = counts_len(chain);
    hashes + key_len(4) + encoded_len_varint(counts as u64) + counts
}

/// Encoded size of a `PrefixEntry` (without its tag and length).
fn prefix_len(p: &index::PrefixReport) -> usize {
    let tier = p.tier as i32;
    let token_count = wire_count(p.token_count);
    (if p.prefix_hash.is_empty() {
        0
    } else {
        pb_bytes::encoded_len(1, &p.prefix_hash)
    }) + (if token_count == 0 {
        0
    } else {
        int32::encoded_len(2, &token_count)
    }) + chain_len(&p.chain)
        + (if tier == 0 {
            0
        } else {
            int32::encoded_len(5, &tier)
        })
        + (if p.adapter_id.is_empty() {
            0
        } else {
            string::encoded_len(6, &p.adapter_id)
        })
}

fn wire_stats(s: &index::ReplicaStatsReport) -> ReplicaStats {
    ReplicaStats {
        replica_id: s.replica_id.clone(),
        cache_memory_bytes: s.cache_memory_bytes,
        hit_rate: s.hit_rate,
        pressure: s.pressure,
        client_version: s.client_version.clone(),
        t2_hit_tokens: s.t2_hit_tokens,
        t2_query_tokens: s.t2_query_tokens,
        requests_waiting: s.requests_waiting,
        requests_running: s.requests_running,
        kv_cache_usage: s.kv_cache_usage,
    }
}

/// The index update as the wire message the log carries, stamped now.
#[cfg(test)]
fn wire_update(update: &index::CacheUpdate) -> CacheStateUpdate {
    use inference_cache_proto::v1alpha1::PrefixEntry;
    CacheStateUpdate {
        replica_id: update.replica_id.clone(),
        model_id: update.model_id.clone(),
        tenant_id: update.tenant_id.clone(),
        hash_scheme: update.hash_scheme.clone(),
        timestamp_us: crate::streams::now_us(),
        prefixes: update
            .prefixes
            .iter()
            .map(|p| PrefixEntry {
                prefix_hash: p.prefix_hash.clone(),
                token_count: wire_count(p.token_count),
                block_hashes: p.chain.hashes().map(<[u8]>::to_vec).collect(),
                block_token_counts: p
                    .chain
                    .token_counts()
                    .iter()
                    .map(|&n| wire_count(n))
                    .collect(),
                tier: p.tier as i32,
                adapter_id: p.adapter_id.clone(),
            })
            .chain(update.rejected.iter().map(|&reason| PrefixEntry {
                block_hashes: match reason {
                    index::DropReason::MalformedChain => Vec::new(),
                    _ => vec![Vec::new()],
                },
                block_token_counts: vec![0],
                ..Default::default()
            }))
            .collect(),
        stats: update.stats.as_ref().map(wire_stats),
        adapter_id: update.adapter_id.clone(),
    }
}

/// Catch-up state shared by the consumer, the timeout and `/readyz`.
struct CatchUp {
    done: AtomicBool,
    started: Instant,
    ready: Arc<AtomicBool>,
    not_ready: CancellationToken,
}

impl CatchUp {
    fn finish(&self, metrics: &ReplicationMetrics, clock: &ReplayClock, timed_out: bool) {
        if self.done.swap(true, Ordering::AcqRel) {
            return;
        }
        clock.follow_wall_clock();
        let ms = i64::try_from(self.started.elapsed().as_millis()).unwrap_or(i64::MAX);
        if timed_out {
            metrics.catch_up_timeouts.inc();
            tracing::warn!(
                ms,
                "not caught up with the shared log in --nats-catch-up-timeout; reporting ready anyway"
            );
        } else {
            metrics.caught_up.set(1);
            metrics.catch_up_ms.set(ms);
            tracing::info!(ms, "caught up with the shared log");
        }
        // A shutdown already under way keeps /readyz at 503.
        if !self.not_ready.is_cancelled() {
            self.ready.store(true, Ordering::Release);
        }
    }
}

/// Connects to NATS (in the background: a server that cannot reach NATS
/// still starts and serves), hooks the log sink into `state`, and starts the
/// publisher and the consumer. `ready` is set once the stream is caught up
/// (or the catch-up timeout passed) unless `shutdown` was cancelled first;
/// both tasks stop with `stop`. The returned publisher task ends once what
/// was queued at `stop` is acknowledged (or one ack timeout passed).
pub async fn start(
    settings: ReplicationSettings,
    state: Arc<IndexState>,
    clock: Arc<ReplayClock>,
    registry: &mut Registry,
    ready: Arc<AtomicBool>,
    shutdown: CancellationToken,
    stop: CancellationToken,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let metrics = ReplicationMetrics::register(registry);
    let origin = instance_id();
    let connected = metrics.connected.clone();
    let client = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .max_reconnects(None)
        .connection_timeout(Duration::from_secs(2))
        .event_callback(move |event| {
            let connected = connected.clone();
            async move {
                match event {
                    async_nats::Event::Connected => {
                        connected.set(1);
                    }
                    async_nats::Event::Disconnected => {
                        connected.set(0);
                    }
                    _ => {}
                }
            }
        })
        .connect(settings.url.as_str())
        .await
        .map_err(|e| anyhow::anyhow!("NATS {}: {e}", settings.url))?;
    let mut js = jetstream::new(client);
    js.set_timeout(settings.ack_timeout);

    let (queue, rx) = mpsc::channel(settings.buffer);
    state.set_log_sink(Arc::new(LogSink {
        queue,
        metrics: metrics.clone(),
    }));
    let catch_up = Arc::new(CatchUp {
        done: AtomicBool::new(false),
        started: Instant::now(),
        ready,
        not_ready: shutdown,
    });
    tracing::info!(url = %settings.url, stream = %settings.stream, %origin, "shared log enabled");
    let log = Arc::new(Log {
        js,
        settings,
        origin,
        metrics,
    });
    let publisher = {
        let log = Arc::clone(&log);
        let stop = stop.clone();
        tokio::spawn(async move { log.publish_loop(rx, stop).await })
    };
    {
        let (log, catch_up, clock) = (Arc::clone(&log), Arc::clone(&catch_up), clock.clone());
        let stop = stop.clone();
        tokio::spawn(async move {
            tokio::select! {
                () = stop.cancelled() => {}
                () = tokio::time::sleep(log.settings.catch_up_timeout) => {
                    catch_up.finish(&log.metrics, &clock, true);
                }
            }
        });
    }
    tokio::spawn(async move { log.consume_loop(state, clock, catch_up, stop).await });
    Ok(publisher)
}

/// A random instance id: 16 hex digits.
fn instance_id() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let seed = std::collections::hash_map::RandomState::new().hash_one((nanos, std::process::id()));
    format!("{seed:016x}")
}

type AckFuture = Pin<Box<dyn Future<Output = (Outgoing, bool)> + Send>>;

/// An encoded log message: one append, or a batch of them.
#[derive(Clone)]
struct Outgoing {
    subject: String,
    msg_id: String,
    payload: Bytes,
    /// Appends it carries.
    records: u64,
}

/// The appends of the next message: `first` and whatever is queued behind
/// it, up to [`MAX_BATCH_BYTES`]; the append that would overflow that waits
/// in `held` for the message after.
fn gather(
    first: LogEntry,
    rx: &mut mpsc::Receiver<LogEntry>,
    held: &mut Option<LogEntry>,
) -> Vec<LogEntry> {
    let mut size = first.batch_len();
    let mut batch = vec![first];
    while size < MAX_BATCH_BYTES {
        let Ok(next) = rx.try_recv() else { break };
        let len = next.batch_len();
        if size + len > MAX_BATCH_BYTES {
            *held = Some(next);
            break;
        }
        size += len;
        batch.push(next);
    }
    batch
}

struct Log {
    js: jetstream::Context,
    settings: ReplicationSettings,
    origin: String,
    metrics: ReplicationMetrics,
}

impl Log {
    /// One append as its own message; several as a batch.
    fn encode(&self, mut batch: Vec<LogEntry>, n: u64) -> Outgoing {
        let records = batch.len() as u64;
        let (kind, payload) = match (batch.pop(), batch.is_empty()) {
            (Some(one), true) => (one.kind, one.payload),
            (last, _) => {
                batch.extend(last);
                let mut payload = Vec::with_capacity(batch.iter().map(LogEntry::batch_len).sum());
                for entry in &batch {
                    entry.encode_record(&mut payload);
                }
                (KIND_BATCH, payload)
            }
        };
        Outgoing {
            subject: format!("{}.{kind}.{}", self.settings.subject_prefix, self.origin),
            msg_id: format!("{}-{n}", self.origin),
            payload: Bytes::from(payload),
            records,
        }
    }

    /// Sends one publish and returns the future of its acknowledgement.
    fn send(&self, out: Outgoing) -> AckFuture {
        let js = self.js.clone();
        let timeout = self.settings.ack_timeout;
        Box::pin(async move {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert(async_nats::header::NATS_MESSAGE_ID, out.msg_id.as_str());
            let acked = tokio::time::timeout(timeout, async {
                let ack = js
                    .publish_with_headers(out.subject.clone(), headers, out.payload.clone())
                    .await
                    .map_err(|e| e.to_string())?;
                ack.await.map_err(|e| e.to_string())
            })
            .await;
            let ok = match acked {
                Ok(Ok(_)) => true,
                Ok(Err(error)) => {
                    tracing::debug!(%error, msg_id = %out.msg_id, "append not acknowledged");
                    false
                }
                Err(_) => false,
            };
            (out, ok)
        })
    }

    /// Drains the queue into JetStream, everything queued at once in one
    /// message (see [`gather`]): up to `max_in_flight` unacknowledged
    /// publishes; a failed one is retried (same message id) after a jittered
    /// backoff that doubles up to [`MAX_BACKOFF`] while failures go on.
    async fn publish_loop(&self, mut rx: mpsc::Receiver<LogEntry>, stop: CancellationToken) {
        let window = self.settings.max_in_flight;
        let mut in_flight: FuturesOrdered<AckFuture> = FuturesOrdered::new();
        let mut retry: VecDeque<Outgoing> = VecDeque::new();
        let mut held: Option<LogEntry> = None;
        // Appends in the messages of `in_flight`.
        let mut unacked: u64 = 0;
        let mut backoff = Backoff::new(INITIAL_BACKOFF, MAX_BACKOFF);
        let mut delay = Duration::ZERO;
        let mut waiting = false;
        let mut n: u64 = 0;
        loop {
            // Retries go first; the queue only when nothing waits for a retry.
            if !waiting {
                while in_flight.len() < window {
                    let Some(out) = retry.pop_front() else { break };
                    unacked += out.records;
                    in_flight.push_back(self.send(out));
                }
            }
            while retry.is_empty() && in_flight.len() < window {
                let Some(first) = held.take() else { break };
                n += 1;
                let out = self.encode(gather(first, &mut rx, &mut held), n);
                unacked += out.records;
                in_flight.push_back(self.send(out));
            }
            let take_new = retry.is_empty() && in_flight.len() < window;
            if retry.is_empty() && in_flight.len() >= window {
                self.metrics.window_full.inc();
            }
            tokio::select! {
                biased;
                () = stop.cancelled() => {
                    self.flush(rx, (in_flight, unacked), retry, held, n).await;
                    break;
                }
                Some((out, ok)) = in_flight.next(), if !in_flight.is_empty() => {
                    unacked -= out.records;
                    if ok {
                        self.metrics.published.inc_by(out.records);
                        backoff.reset();
                    } else {
                        self.metrics.publish_failures.inc();
                        retry.push_back(out);
                        delay = backoff.next_delay();
                        waiting = true;
                    }
                }
                () = tokio::time::sleep(delay), if waiting && in_flight.is_empty() => {
                    waiting = false;
                }
                entry = rx.recv(), if take_new => {
                    let Some(first) = entry else { break };
                    n += 1;
                    let out = self.encode(gather(first, &mut rx, &mut held), n);
                    unacked += out.records;
                    in_flight.push_back(self.send(out));
                }
            }
        }
    }

    /// On a graceful stop: publishes what is still queued or waiting for a
    /// retry and waits for the acknowledgements, for at most one
    /// `--nats-ack-timeout`; what is left then is counted as dropped.
    async fn flush(
        &self,
        mut rx: mpsc::Receiver<LogEntry>,
        (mut in_flight, mut unacked): (FuturesOrdered<AckFuture>, u64),
        retry: VecDeque<Outgoing>,
        mut held: Option<LogEntry>,
        mut n: u64,
    ) {
        rx.close();
        for out in retry {
            unacked += out.records;
            in_flight.push_back(self.send(out));
        }
        while let Some(first) = held.take().or_else(|| rx.try_recv().ok()) {
            n += 1;
            let out = self.encode(gather(first, &mut rx, &mut held), n);
            unacked += out.records;
            in_flight.push_back(self.send(out));
        }
        let pending = unacked;
        let drained = tokio::time::timeout(self.settings.ack_timeout, async {
            while let Some((out, ok)) = in_flight.next().await {
                unacked -= out.records;
                if ok {
                    self.metrics.published.inc_by(out.records);
                } else {
                    self.metrics.publish_failures.inc();
                    self.metrics.drop("stopped", out.records);
                }
            }
        })
        .await;
        if drained.is_err() {
            let lost = unacked;
            self.metrics.drop("stopped", lost);
            tracing::warn!(
                lost,
                pending,
                "stopping: appends not acknowledged in time are lost to the other servers"
            );
        }
    }

    async fn open_stream(&self) -> anyhow::Result<stream::Stream> {
        let config = stream::Config {
            name: self.settings.stream.clone(),
            subjects: vec![format!("{}.>", self.settings.subject_prefix)],
            max_age: self.settings.max_age,
            max_bytes: self.settings.max_bytes,
            duplicate_window: self.settings.duplicate_window,
            storage: if self.settings.memory_storage {
                stream::StorageType::Memory
            } else {
                stream::StorageType::File
            },
            discard: stream::DiscardPolicy::Old,
            ..Default::default()
        };
        self.js
            .get_or_create_stream(config)
            .await
            .map_err(|e| anyhow::anyhow!("stream {}: {e}", self.settings.stream))
    }

    /// Reads the stream from `next_sequence` and applies it, forever: on any
    /// error the consumer is reopened where it stopped, after a jittered backoff.
    async fn consume_loop(
        &self,
        state: Arc<IndexState>,
        clock: Arc<ReplayClock>,
        catch_up: Arc<CatchUp>,
        stop: CancellationToken,
    ) {
        let mut next_sequence: u64 = 1;
        let mut backoff = Backoff::new(INITIAL_BACKOFF, MAX_BACKOFF);
        let mut warned = false;
        loop {
            let opened = tokio::select! {
                () = stop.cancelled() => return,
                opened = self.open_consumer(next_sequence) => opened,
            };
            let (mut messages, target) = match opened {
                Ok(opened) => opened,
                Err(error) => {
                    // Once per streak at WARN (e.g. a stream JetStream refuses), then quieter.
                    if warned {
                        tracing::debug!(%error, "shared log not reachable, retrying");
                    } else {
                        tracing::warn!(%error, "shared log not reachable, retrying");
                        warned = true;
                    }
                    tokio::select! {
                        () = stop.cancelled() => return,
                        () = tokio::time::sleep(backoff.next_delay()) => {}
                    }
                    continue;
                }
            };
            self.metrics.consumer_restarts.inc();
            backoff.reset();
            warned = false;
            if target < next_sequence {
                catch_up.finish(&self.metrics, &clock, false);
            }
            loop {
                let message = tokio::select! {
                    () = stop.cancelled() => return,
                    m = messages.next() => m,
                };
                let message = match message {
                    Some(Ok(m)) => m,
                    Some(Err(error)) => {
                        tracing::debug!(%error, "shared log consumer error, reopening");
                        break;
                    }
                    None => break,
                };
                let Ok(info) = message.info() else {
                    self.metrics.decode_errors.inc();
                    continue;
                };
                let sequence = info.stream_sequence;
                let pending = info.pending;
                let published_ms =
                    u64::try_from(info.published.unix_timestamp_nanos() / 1_000_000).unwrap_or(0);
                if !catch_up.done.load(Ordering::Acquire) {
                    clock.replay_at(published_ms);
                }
                self.apply(&state, &message.subject, &message.payload);
                next_sequence = sequence + 1;
                self.metrics
                    .last_sequence
                    .set(i64::try_from(sequence).unwrap_or(i64::MAX));
                if sequence >= target || pending == 0 {
                    catch_up.finish(&self.metrics, &clock, false);
                }
            }
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(backoff.next_delay()) => {}
            }
        }
    }

    /// An ordered consumer from `start` and the stream's last sequence now.
    async fn open_consumer(&self, start: u64) -> anyhow::Result<(consumer::pull::Ordered, u64)> {
        let mut stream = self.open_stream().await?;
        let target = stream
            .info()
            .await
            .map_err(|e| anyhow::anyhow!("stream info: {e}"))?
            .state
            .last_sequence;
        let consumer = stream
            .create_consumer(consumer::pull::OrderedConfig {
                deliver_policy: consumer::DeliverPolicy::ByStartSequence {
                    start_sequence: start,
                },
                filter_subject: format!("{}.>", self.settings.subject_prefix),
                ..Default::default()
            })
            .await
            .map_err(|e| anyhow::anyhow!("consumer: {e}"))?;
        let messages = consumer
            .messages()
            .await
            .map_err(|e| anyhow::anyhow!("consumer messages: {e}"))?;
        Ok((messages, target))
    }

    /// Applies one log message of another server; skips this server's own.
    fn apply(&self, state: &IndexState, subject: &str, payload: &[u8]) {
        let Some((kind, origin)) = subject
            .strip_prefix(self.settings.subject_prefix.as_str())
            .and_then(|rest| rest.strip_prefix('.'))
            .and_then(|rest| rest.split_once('.'))
        else {
            self.metrics.decode_errors.inc();
            return;
        };
        if origin == self.origin {
            self.metrics.skipped_own.inc();
            return;
        }
        if kind == KIND_BATCH {
            for record in batch_records(payload) {
                match record {
                    Some((kind, message)) => self.apply_one(state, kind, message),
                    None => {
                        self.metrics.decode_errors.inc();
                    }
                }
            }
        } else {
            self.apply_one(state, kind, payload);
        }
    }

    /// Applies one encoded update or event of another server.
    fn apply_one(&self, state: &IndexState, kind: &str, message: &[u8]) {
        let record = match kind {
            KIND_UPDATE => CacheStateUpdate::decode(message).ok().map(Record::Update),
            KIND_EVENT => CacheEvent::decode(message).ok().map(Record::Event),
            _ => None,
        };
        self.apply_record(state, record);
    }

    /// Applies one decoded update or event of another server (`None`: one
    /// that did not decode).
    fn apply_record(&self, state: &IndexState, record: Option<Record>) {
        let applied = match record {
            Some(Record::Update(u)) => {
                state.apply_replicated_update(&crate::grpc::cache_update(u));
                &self.metrics.applied_update
            }
            Some(Record::Event(e)) => match crate::streams::index_event(&e) {
                Some(e) => {
                    state.apply_replicated_event(&e);
                    &self.metrics.applied_event
                }
                None => &self.metrics.decode_errors,
            },
            None => &self.metrics.decode_errors,
        };
        applied.inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use inference_cache_index::ManualClock;
    use inference_cache_proto::v1alpha1::PrefixEntry;

    #[test]
    fn replay_clock_follows_message_time_then_the_wall_clock() {
        let base = ManualClock::new(1_000_000);
        let clock = ReplayClock::new(Arc::new(base.clone()));
        assert_eq!(clock.now_ms(), 1_000_000);
        clock.replay_at(400_000);
        assert_eq!(clock.now_ms(), 400_000);
        // Never ahead of the wall clock.
        clock.replay_at(2_000_000);
        assert_eq!(clock.now_ms(), 1_000_000);
        clock.follow_wall_clock();
        base.advance(Duration::from_secs(1));
        assert_eq!(clock.now_ms(), 1_001_000);
    }

    #[test]
    fn wire_update_round_trips_through_the_index_conversion() {
        let update = index::CacheUpdate {
            replica_id: "r".into(),
            model_id: "m".into(),
            tenant_id: "t".into(),
            hash_scheme: "vllm".into(),
            adapter_id: "lora".into(),
            prefixes: vec![index::PrefixReport {
                prefix_hash: vec![1; 8],
                token_count: 32,
                chain: index::BlockChain::new(&[vec![2; 8], vec![3; 8]], vec![16, 16])
                    .expect("a valid chain"),
                tier: index::Tier::T2,
                adapter_id: "a".into(),
            }],
            rejected: vec![
                index::DropReason::MalformedChain,
                index::DropReason::EmptyHash,
            ],
            stats: Some(index::ReplicaStatsReport {
                replica_id: "r".into(),
                pressure: 0.5,
                hit_rate: 0.25,
                requests_waiting: 3,
                ..Default::default()
            }),
        };
        let wire = wire_update(&update);
        assert!(wire.timestamp_us > 0);
        let bytes = wire.encode_to_vec();
        let back = crate::grpc::cache_update(CacheStateUpdate::decode(&bytes[..]).expect("decode"));
        assert_eq!(back, update);
    }

    /// The batch form, as protobuf messages (the server writes and reads it
    /// without them).
    #[derive(Clone, PartialEq, prost::Message)]
    struct LogBatch {
        #[prost(message, repeated, tag = "1")]
        records: Vec<LogRecord>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    struct LogRecord {
        #[prost(oneof = "WireRecord", tags = "1, 2")]
        record: Option<WireRecord>,
    }

    #[derive(Clone, PartialEq, prost::Oneof)]
    enum WireRecord {
        #[prost(message, tag = "1")]
        Update(CacheStateUpdate),
        #[prost(message, tag = "2")]
        Event(CacheEvent),
    }

    fn wire(id: u8, blocks: usize) -> CacheStateUpdate {
        CacheStateUpdate {
            replica_id: format!("r{id:03}"),
            timestamp_us: 7,
            prefixes: vec![PrefixEntry {
                block_hashes: vec![vec![id; 8]; blocks],
                block_token_counts: vec![16; blocks],
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    fn entry(id: u8, blocks: usize) -> LogEntry {
        LogEntry {
            kind: KIND_UPDATE,
            payload: wire(id, blocks).encode_to_vec(),
        }
    }

    #[test]
    fn the_direct_encoding_is_the_messages_encoding() {
        let mut update = index::CacheUpdate {
            replica_id: "r".into(),
            model_id: "m".into(),
            tenant_id: "t".into(),
            hash_scheme: "vllm".into(),
            adapter_id: "lora".into(),
            prefixes: vec![
                index::PrefixReport {
                    prefix_hash: vec![1; 8],
                    token_count: 32,
                    chain: index::BlockChain::new(
                        &[vec![2; 8], vec![3; 8], vec![5]],
                        vec![16, 1 << 31, 0],
                    )
                    .expect("a valid chain"),
                    tier: index::Tier::T2,
                    adapter_id: "a".into(),
                },
                index::PrefixReport {
                    chain: index::BlockChain::new(&[vec![4; 300]], vec![300])
                        .expect("a valid chain"),
                    ..Default::default()
                },
                index::PrefixReport {
                    prefix_hash: vec![6; 8],
                    token_count: u32::MAX,
                    ..Default::default()
                },
            ],
            rejected: vec![
                index::DropReason::MalformedChain,
                index::DropReason::EmptyHash,
            ],
            stats: Some(index::ReplicaStatsReport {
                replica_id: "r".into(),
                pressure: 0.5,
                requests_waiting: 3,
                ..Default::default()
            }),
        };
        let expected = |u: &index::CacheUpdate| {
            let mut wire = wire_update(u);
            wire.timestamp_us = 1_234;
            wire.encode_to_vec()
        };
        assert_eq!(encode_update(&update, 1_234), expected(&update));
        update.stats = None;
        update.prefixes.clear();
        update.adapter_id.clear();
        assert_eq!(encode_update(&update, 1_234), expected(&update));
    }

    #[test]
    fn a_batch_is_a_log_batch_of_the_queued_appends_in_order() {
        let event = CacheEvent {
            replica_id: "r2".into(),
            ..Default::default()
        };
        let entries = [
            entry(1, 4),
            LogEntry {
                kind: KIND_EVENT,
                payload: event.encode_to_vec(),
            },
            entry(3, 200),
        ];
        let mut payload = Vec::new();
        for e in &entries {
            e.encode_record(&mut payload);
        }
        assert_eq!(
            payload.len(),
            entries.iter().map(LogEntry::batch_len).sum::<usize>()
        );
        // Any protobuf reader sees a LogBatch.
        let batch = LogBatch::decode(&payload[..]).expect("decode");
        let expected = vec![
            LogRecord {
                record: Some(WireRecord::Update(wire(1, 4))),
            },
            LogRecord {
                record: Some(WireRecord::Event(event)),
            },
            LogRecord {
                record: Some(WireRecord::Update(wire(3, 200))),
            },
        ];
        assert_eq!(batch.records, expected);
        // And the server's reader gives back each record as it was queued.
        let read: Vec<_> = batch_records(&payload).collect();
        assert_eq!(read.len(), 3);
        for (record, entry) in read.iter().zip(&entries) {
            assert_eq!(*record, Some((entry.kind, &entry.payload[..])));
        }
        // A cut batch yields what parses, then one failure, then nothing.
        let cut: Vec<_> = batch_records(&payload[..payload.len() - 1]).collect();
        assert_eq!(cut.len(), 3);
        assert!(cut[0].is_some() && cut[1].is_some() && cut[2].is_none());
    }

    #[tokio::test]
    async fn gather_takes_what_is_queued_up_to_the_size_limit() {
        let (tx, mut rx) = mpsc::channel(1024);
        let one = entry(0, 64).batch_len();
        let fit = MAX_BATCH_BYTES / one;
        for i in 0..fit + 10 {
            tx.try_send(entry((i % 200) as u8, 64)).expect("queued");
        }
        let mut held = None;
        let first = rx.recv().await.expect("first");
        let batch = gather(first, &mut rx, &mut held);
        assert_eq!(batch.len(), fit);
        assert!(held.is_some(), "the append that did not fit waits");
        let first = held.take().expect("held");
        let rest = gather(first, &mut rx, &mut held);
        assert_eq!(rest.len(), 10);
        assert!(held.is_none());
        // One append alone when nothing else is queued.
        tx.try_send(entry(1, 2)).expect("queued");
        let first = rx.recv().await.expect("first");
        assert_eq!(gather(first, &mut rx, &mut held).len(), 1);
    }

    #[test]
    fn instance_ids_differ_and_are_subject_tokens() {
        let (a, b) = (instance_id(), instance_id());
        assert_ne!(a, b);
        assert_eq!(a.len(), 16);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
    }
}
