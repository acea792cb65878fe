//! Criterion benchmarks of the cache index: 64-block chain lookup and chain
//! ingest over 8 replicas.
//!
//! Run: `cargo bench -p inference-cache-index --bench index`
//! (the full-scale table with memory figures is `--bench table`).

use std::hint::black_box;
use std::sync::Arc;

use criterion::{Criterion, Throughput, criterion_main};
use inference_cache_index::{CacheIndex, SystemClock};

mod support;
use support::{CHAIN_BLOCKS, Workload};

fn lookup(c: &mut Criterion) {
    let work = Workload::new(200_000, 3);
    let index = CacheIndex::new(Arc::new(SystemClock), u64::MAX);
    for u in work.updates() {
        index.ingest(&u);
    }
    let mut i = 0usize;
    c.bench_function("lookup_64_block_chain_200k_entries", |b| {
        b.iter(|| {
            i = (i + 7919) % work.chains.len();
            let r = work.request(i);
            black_box(index.lookup(&r))
        })
    });
}

fn ingest(c: &mut Criterion) {
    let work = Workload::new(64 * 1000, 1);
    let updates = work.updates();
    let mut group = c.benchmark_group("ingest");
    group.throughput(Throughput::Elements((updates.len() * CHAIN_BLOCKS) as u64));
    group.sample_size(10);
    group.bench_function("ingest_64k_block_entries", |b| {
        b.iter(|| {
            let index = CacheIndex::new(Arc::new(SystemClock), u64::MAX);
            for u in &updates {
                index.ingest(u);
            }
            black_box(index.entry_count())
        })
    });
    group.finish();
}

mod groups {
    use criterion::criterion_group;
    criterion_group!(benches, super::lookup, super::ingest);
}
criterion_main!(groups::benches);
