//! Cost of server-side tokenization: the chat-template path against a bare
//! `tokenizers` encode of the same text.
//!
//! Run (after `scripts/setup-tokenizers.sh` fetched the real tokenizers):
//!
//! ```text
//! cargo bench -p inference-cache-tokenizer --bench encode
//! ```
//!
//! For prompts of about 1k and 8k tokens (Qwen3 and Llama-3 tokenizers) it
//! measures:
//! - `prompt_text`: `TokenizerRegistry::encode_prompt_text` — wrap as one user
//!   message, render the chat template with minijinja, encode without special
//!   tokens (what a `prompt_text` LookupRoute costs before fingerprinting);
//! - `render_only`: the template rendering alone;
//! - `raw_tokenizers`: `tokenizers::Tokenizer::encode` of the same text, no
//!   template (the floor the template path is compared with).

use criterion::{BenchmarkId, Criterion, Throughput, criterion_main};
use inference_cache_tokenizer::{ChatMessage, TokenizerRegistry};
use std::hint::black_box;
use std::path::{Path, PathBuf};
use tokenizers::Tokenizer;

const MODELS: [&str; 2] = ["qwen3", "llama3"];
const SIZES: [usize; 2] = [1_000, 8_000];

fn tokenizers_dir() -> PathBuf {
    match std::env::var_os("INFERENCE_CACHE_TOKENIZERS_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../.cache/tokenizers"),
    }
}

/// Deterministic prose with some code and numbers, long enough for 8k tokens.
fn corpus() -> String {
    let sentences = [
        "The gateway fingerprints each prompt into blocks of sixteen tokens.",
        "A replica that already holds the longest matching prefix answers faster,",
        "because its KV cache skips the prefill of those blocks entirely.",
        "Eviction under memory pressure drops the least recently used entries first;",
        "latency percentiles (p50 = 1.8 ms, p99 = 7.25 ms) are exported as metrics.",
        "fn chain(tokens: &[u32]) -> Vec<u64> { tokens.chunks(16).map(hash).collect() }",
        "Café, naïve, 東京, and emoji 🚀 appear in real user traffic too.",
    ];
    let mut text = String::new();
    let mut i = 0usize;
    while text.len() < 120_000 {
        text.push_str(sentences[i % sentences.len()]);
        text.push(if i % 5 == 4 { '\n' } else { ' ' });
        i += 1;
    }
    text
}

/// The longest prefix of `text` that encodes to about `tokens` tokens.
fn prefix_with_tokens<'a>(tokenizer: &Tokenizer, text: &'a str, tokens: usize) -> &'a str {
    let encoding = tokenizer.encode(text, false).expect("corpus encodes");
    let offsets = encoding.get_offsets();
    let end = offsets.get(tokens).map_or(text.len(), |(start, _)| *start);
    &text[..end]
}

fn bench_encode(c: &mut Criterion) {
    let dir = tokenizers_dir();
    for model in MODELS {
        assert!(
            dir.join(model).join("tokenizer.json").is_file(),
            "missing {model} tokenizer in {}: run scripts/setup-tokenizers.sh",
            dir.display()
        );
    }
    let (registry, failures) = TokenizerRegistry::load_dir(&dir).expect("tokenizers dir");
    assert!(failures.is_empty(), "{failures:?}");
    let corpus = corpus();

    for model in MODELS {
        let tokenizer =
            Tokenizer::from_file(dir.join(model).join("tokenizer.json")).expect("tokenizer");
        let mut group = c.benchmark_group(format!("encode/{model}"));
        group.sample_size(30);
        for size in SIZES {
            let text = prefix_with_tokens(&tokenizer, &corpus, size);
            group.throughput(Throughput::Elements(size as u64));
            group.bench_with_input(BenchmarkId::new("prompt_text", size), text, |b, text| {
                b.iter(|| {
                    registry
                        .encode_prompt_text(model, black_box(text))
                        .expect("encodes")
                });
            });
            let messages = [ChatMessage::new("user", text)];
            group.bench_with_input(
                BenchmarkId::new("render_only", size),
                &messages,
                |b, messages| {
                    b.iter(|| {
                        registry
                            .render_messages(model, black_box(messages))
                            .expect("renders")
                    });
                },
            );
            group.bench_with_input(BenchmarkId::new("raw_tokenizers", size), text, |b, text| {
                b.iter(|| tokenizer.encode(black_box(text), false).expect("encodes"));
            });
        }
        group.finish();
    }
}

mod group {
    //! Criterion's generated group function (private, so it needs no docs).
    criterion::criterion_group!(benches, super::bench_encode);
}

criterion_main!(group::benches);
