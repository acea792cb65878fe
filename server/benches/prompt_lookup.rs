//! Latency of `prompt_text` → LookupRoute against a bare `tokenizers` encode
//! of the same text, in one process.
//!
//! Starts the server in-process with the real Qwen3 tokenizer (fetched by
//! `scripts/setup-tokenizers.sh` into `.cache/tokenizers/`, or the directory
//! in `INFERENCE_CACHE_TOKENIZERS_DIR`), reports the prompt's token chain
//! through ReportCacheState so that every lookup is a real `PREFIX_MATCH`,
//! then times, for a 1k- and an 8k-token English prompt:
//! - `raw encode`: `tokenizers::Tokenizer::encode` of the chat-templated text
//!   the server tokenizes for that `prompt_text`, `add_special_tokens = false`,
//!   ids copied out as the server does; timed on a thread of its own, as the
//!   server encodes on its blocking pool rather than on the thread that loaded
//!   the tokenizer (on this bench's main thread the same encode ran up to 2×
//!   slower, in glibc's allocator, whose main arena holds the loaded vocabularies);
//! - `prompt_text → LookupRoute`: one unary call over a loopback gRPC socket
//!   with the generated client, from sending the request to the decoded
//!   response (template rendering, tokenization on the server's blocking
//!   pool, fingerprinting, index lookup, token ids echoed back).
//!
//! The two are sampled alternately (the order flips every iteration) so
//! drift in machine load hits both. Overhead is the lookup percentile over
//! the raw-encode percentile of the same rank.
//!
//! Run: `cargo bench -p inference-cache-server --bench prompt_lookup`.
//! Without `--bench` on the command line (as under `cargo test --benches`)
//! it makes a short smoke pass with the same assertions.

use std::path::{Path, PathBuf};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use anyhow::{Context as _, ensure};
use inference_cache_proto::reason;
use inference_cache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;
use inference_cache_proto::v1alpha1::{CacheStateUpdate, LookupRouteRequest, PrefixEntry};
use inference_cache_server::{ServeConfig, start};
use inference_cache_tokenizer::{ChatMessage, TokenizerRegistry};
use tokenizers::Tokenizer;
use tonic::transport::Channel;

const MODEL: &str = "qwen3";
const TENANT: &str = "bench";

/// One prompt size: target tokens, timed samples and untimed warm-up rounds.
struct Size {
    tokens: usize,
    samples: usize,
    warmup: usize,
}

const FULL: [Size; 2] = [
    Size {
        tokens: 1_000,
        samples: 1_000,
        warmup: 50,
    },
    Size {
        tokens: 8_000,
        samples: 300,
        warmup: 10,
    },
];

const SMOKE: [Size; 2] = [
    Size {
        tokens: 1_000,
        samples: 3,
        warmup: 1,
    },
    Size {
        tokens: 8_000,
        samples: 2,
        warmup: 1,
    },
];

fn tokenizers_dir() -> PathBuf {
    match std::env::var_os("INFERENCE_CACHE_TOKENIZERS_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../.cache/tokenizers"),
    }
}

/// Deterministic English prose: sentences of 6–17 words drawn by a fixed
/// xorshift from a small vocabulary, a paragraph break every 6 sentences.
fn english(min_bytes: usize) -> String {
    const WORDS: [&str; 48] = [
        "the",
        "cache",
        "replica",
        "request",
        "prefix",
        "server",
        "routes",
        "every",
        "prompt",
        "to",
        "a",
        "model",
        "that",
        "already",
        "holds",
        "its",
        "longest",
        "matching",
        "blocks",
        "and",
        "answers",
        "faster",
        "because",
        "prefill",
        "is",
        "skipped",
        "when",
        "memory",
        "pressure",
        "rises",
        "old",
        "entries",
        "are",
        "evicted",
        "first",
        "while",
        "gateway",
        "keeps",
        "latency",
        "low",
        "for",
        "users",
        "who",
        "send",
        "long",
        "documents",
        "with",
        "questions",
    ];
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut text = String::with_capacity(min_bytes + 128);
    let mut sentence = 0usize;
    while text.len() < min_bytes {
        let words = 6 + (next() % 12) as usize;
        for w in 0..words {
            let word = WORDS[(next() % WORDS.len() as u64) as usize];
            if w == 0 {
                let mut chars = word.chars();
                text.extend(chars.next().map(|c| c.to_ascii_uppercase()));
                text.push_str(chars.as_str());
            } else {
                text.push(' ');
                text.push_str(word);
            }
        }
        sentence += 1;
        text.push_str(if sentence.is_multiple_of(6) {
            ".\n\n"
        } else {
            ". "
        });
    }
    text
}

/// The prefix of `text` that ends right before token `tokens`.
fn first_tokens<'a>(
    tokenizer: &Tokenizer,
    text: &'a str,
    tokens: usize,
) -> anyhow::Result<&'a str> {
    let encoding = tokenizer
        .encode(text, false)
        .map_err(|e| anyhow::anyhow!("encoding the corpus: {e}"))?;
    let end = encoding
        .get_offsets()
        .get(tokens)
        .map_or(text.len(), |(start, _)| *start);
    Ok(&text[..end])
}

fn percentile(sorted: &[Duration], q: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

fn overhead(lookup: Duration, raw: Duration) -> String {
    format!(
        "{:+.1} % ({:+.0} µs)",
        (lookup.as_secs_f64() / raw.as_secs_f64() - 1.0) * 100.0,
        us(lookup) - us(raw)
    )
}

/// A bare `tokenizers` encoder on its own thread, timed inside that thread.
struct RawEncoder {
    jobs: mpsc::Sender<Arc<str>>,
    done: mpsc::Receiver<Result<(Duration, Vec<u32>), String>>,
}

impl RawEncoder {
    fn spawn(tokenizer: Tokenizer) -> std::io::Result<Self> {
        let (jobs, job_rx) = mpsc::channel::<Arc<str>>();
        let (done_tx, done) = mpsc::channel();
        std::thread::Builder::new()
            .name("raw-encode".into())
            .spawn(move || {
                for text in job_rx {
                    let started = Instant::now();
                    let ids = tokenizer
                        .encode(std::hint::black_box(&*text), false)
                        .map(|encoding| encoding.get_ids().to_vec());
                    let elapsed = started.elapsed();
                    let sent =
                        done_tx.send(ids.map(|ids| (elapsed, ids)).map_err(|e| e.to_string()));
                    if sent.is_err() {
                        break;
                    }
                }
            })?;
        Ok(Self { jobs, done })
    }

    /// Encodes `text` without special tokens: the time it took and the ids.
    fn encode(&self, text: &Arc<str>) -> anyhow::Result<(Duration, Vec<u32>)> {
        self.jobs
            .send(Arc::clone(text))
            .context("raw encode thread stopped")?;
        self.done
            .recv()
            .context("raw encode thread stopped")?
            .map_err(|e| anyhow::anyhow!("raw encode: {e}"))
    }
}

/// Samples of one prompt size, sorted.
struct Measured {
    tokens: usize,
    raw: Vec<Duration>,
    lookup: Vec<Duration>,
    in_server: Vec<Duration>,
    /// Per sample: round trip minus the server's own `lookup_latency_us`.
    transport: Vec<Duration>,
}

/// Reports `tokens`' chain as held by one replica, as an engine would.
async fn ingest(
    client: &mut InferenceCacheClient<Channel>,
    tokens: &[u32],
    block_size: usize,
) -> anyhow::Result<()> {
    let chain = inference_cache_fingerprint::request_chain(tokens, block_size);
    let update = CacheStateUpdate {
        replica_id: "holder".into(),
        model_id: MODEL.into(),
        tenant_id: TENANT.into(),
        hash_scheme: "vllm".into(),
        prefixes: vec![PrefixEntry {
            block_hashes: chain.block_hashes.iter().map(|h| h.to_vec()).collect(),
            block_token_counts: chain.block_token_counts,
            ..Default::default()
        }],
        ..Default::default()
    };
    let ack = client
        .report_cache_state(tokio_stream::iter([update]))
        .await?
        .into_inner();
    ensure!(ack.accepted, "ReportCacheState rejected: {ack:?}");
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--list") {
        return Ok(());
    }
    let full = args.iter().any(|a| a == "--bench");
    let sizes = if full { &FULL } else { &SMOKE };

    let source = tokenizers_dir();
    ensure!(
        source.join(MODEL).join("tokenizer.json").is_file()
            && source.join(MODEL).join("tokenizer_config.json").is_file(),
        "{MODEL} tokenizer files missing under {}: run scripts/setup-tokenizers.sh",
        source.display()
    );
    // A models directory with only Qwen3, so start-up loads one tokenizer.
    let models = tempfile::tempdir()?;
    std::fs::create_dir(models.path().join(MODEL))?;
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(
            source.join(MODEL).join(file),
            models.path().join(MODEL).join(file),
        )
        .with_context(|| format!("copying {MODEL}/{file}"))?;
    }

    // The baseline's own tokenizer and the renderer of the server's chat template.
    let tokenizer = Tokenizer::from_file(models.path().join(MODEL).join("tokenizer.json"))
        .map_err(|e| anyhow::anyhow!("loading the {MODEL} tokenizer: {e}"))?;
    let (registry, failures) = TokenizerRegistry::load_dir(models.path())?;
    ensure!(failures.is_empty(), "{failures:?}");

    let mut config = ServeConfig::ephemeral();
    config.prompts.tokenizer_models_dir = Some(models.path().to_path_buf());
    // Measure latency, not the fail-open bound: no sample may time out.
    config.prompts.tokenize_timeout = Duration::from_secs(30);
    let block_size = config.index.engine_block_size;

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let server = runtime.block_on(start(config))?;
    let mut client = runtime.block_on(InferenceCacheClient::connect(format!(
        "http://{}",
        server.grpc_addr
    )))?;

    let corpus = english(80_000);
    let texts = sizes
        .iter()
        .map(|size| first_tokens(&tokenizer, &corpus, size.tokens))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let raw_encoder = RawEncoder::spawn(tokenizer)?;
    let mut results = Vec::new();
    for (size, text) in sizes.iter().zip(texts) {
        let rendered: Arc<str> = registry
            .render_messages(MODEL, &[ChatMessage::new("user", text)])?
            .into();
        let (_, expected) = raw_encoder.encode(&rendered)?;
        runtime.block_on(ingest(&mut client, &expected, block_size))?;
        let request = LookupRouteRequest {
            model_id: MODEL.into(),
            tenant_id: TENANT.into(),
            hash_scheme: "vllm".into(),
            prompt_text: text.to_owned(),
            ..Default::default()
        };

        let mut measured = Measured {
            tokens: expected.len(),
            raw: Vec::with_capacity(size.samples),
            lookup: Vec::with_capacity(size.samples),
            in_server: Vec::with_capacity(size.samples),
            transport: Vec::with_capacity(size.samples),
        };
        for round in 0..size.warmup + size.samples {
            let keep = round >= size.warmup;
            let time_raw = || -> anyhow::Result<Duration> {
                let (elapsed, ids) = raw_encoder.encode(&rendered)?;
                ensure!(ids == expected, "raw encode drifted");
                Ok(elapsed)
            };
            let mut time_lookup = || -> anyhow::Result<(Duration, Duration)> {
                let request = request.clone();
                let started = Instant::now();
                let response = runtime.block_on(client.lookup_route(request))?.into_inner();
                let elapsed = started.elapsed();
                ensure!(
                    response.reason_code == reason::PREFIX_MATCH,
                    "expected PREFIX_MATCH, got {}",
                    response.reason_code
                );
                ensure!(
                    response.token_ids == expected,
                    "the server's token ids differ from the raw encode of the rendered prompt"
                );
                let in_server = Duration::from_micros(response.lookup_latency_us.max(0) as u64);
                Ok((elapsed, in_server))
            };
            let (raw, (lookup, in_server)) = if round.is_multiple_of(2) {
                let raw = time_raw()?;
                (raw, time_lookup()?)
            } else {
                let lookup = time_lookup()?;
                (time_raw()?, lookup)
            };
            if keep {
                measured.raw.push(raw);
                measured.lookup.push(lookup);
                measured.in_server.push(in_server);
                measured.transport.push(lookup.saturating_sub(in_server));
            }
        }
        measured.raw.sort_unstable();
        measured.lookup.sort_unstable();
        measured.in_server.sort_unstable();
        measured.transport.sort_unstable();
        results.push(measured);
    }
    runtime.block_on(server.shutdown())?;

    if !full {
        println!("prompt_lookup: smoke pass ok (run with `cargo bench` for the full table)");
    }
    println!(
        "| prompt | tokens (templated) | samples | raw encode p50 | raw encode p99 \
         | prompt_text → LookupRoute p50 | prompt_text → LookupRoute p99 \
         | overhead p50 | overhead p99 |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (size, m) in sizes.iter().zip(&results) {
        let (raw50, raw99) = (percentile(&m.raw, 0.5), percentile(&m.raw, 0.99));
        let (lk50, lk99) = (percentile(&m.lookup, 0.5), percentile(&m.lookup, 0.99));
        println!(
            "| {}k tokens | {} | {} | {} | {} | {} | {} | {} | {} |",
            size.tokens / 1_000,
            m.tokens,
            m.raw.len(),
            ms(raw50),
            ms(raw99),
            ms(lk50),
            ms(lk99),
            overhead(lk50, raw50),
            overhead(lk99, raw99),
        );
    }
    println!();
    println!(
        "| prompt | in-server p50 (lookup_latency_us) | in-server p99 \
         | round trip − in-server p50 | round trip − in-server p99 |"
    );
    println!("|---|---:|---:|---:|---:|");
    for (size, m) in sizes.iter().zip(&results) {
        println!(
            "| {}k tokens | {} | {} | {:.0} µs | {:.0} µs |",
            size.tokens / 1_000,
            ms(percentile(&m.in_server, 0.5)),
            ms(percentile(&m.in_server, 0.99)),
            us(percentile(&m.transport, 0.5)),
            us(percentile(&m.transport, 0.99)),
        );
    }
    Ok(())
}
