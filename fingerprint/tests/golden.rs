//! Byte-for-byte parity with `golden/golden_vectors.json`, the language-neutral
//! fixture produced by the independent Python generator in `golden/`.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use inference_cache_fingerprint::{
    content_hash, decode, encode, prefix_hashes_from, request_chain,
};
use serde::Deserialize;

#[derive(Deserialize)]
struct Fixture {
    seed: u64,
    vectors: Vec<Vector>,
}

#[derive(Deserialize)]
struct Vector {
    name: String,
    tokens: Vec<u32>,
    block_size: usize,
    parent: Option<Hash>,
    content_hashes: Vec<Hash>,
    prefix_hashes: Vec<Hash>,
}

#[derive(Deserialize)]
struct Hash {
    decimal: String,
    base64: String,
}

impl Hash {
    fn value(&self, vector: &str) -> u64 {
        let value: u64 = self.decimal.parse().expect("decimal u64");
        let bytes = STANDARD.decode(&self.base64).expect("base64");
        assert_eq!(
            bytes,
            value.to_be_bytes(),
            "{vector}: decimal and base64 disagree"
        );
        value
    }
}

fn fixture() -> Fixture {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../golden/golden_vectors.json");
    let text = std::fs::read_to_string(path).expect("golden/golden_vectors.json is readable");
    serde_json::from_str(&text).expect("golden_vectors.json parses")
}

#[test]
fn every_golden_vector_matches_byte_for_byte() {
    let fixture = fixture();
    assert_eq!(fixture.seed, inference_cache_fingerprint::SEED);
    assert!(fixture.vectors.len() >= 9, "fixture lost vectors");
    for v in &fixture.vectors {
        let parent = v.parent.as_ref().map(|p| p.value(&v.name));
        let prefixes = prefix_hashes_from(parent, &v.tokens, v.block_size);
        let expected: Vec<u64> = v.prefix_hashes.iter().map(|h| h.value(&v.name)).collect();
        assert_eq!(prefixes, expected, "{}: prefix hashes", v.name);

        let contents: Vec<u64> = v
            .tokens
            .chunks_exact(v.block_size)
            .map(content_hash)
            .collect();
        let expected: Vec<u64> = v.content_hashes.iter().map(|h| h.value(&v.name)).collect();
        assert_eq!(contents, expected, "{}: content hashes", v.name);

        for (hash, golden) in prefixes.iter().zip(&v.prefix_hashes) {
            let wire = encode(*hash);
            assert_eq!(
                STANDARD.encode(wire),
                golden.base64,
                "{}: wire bytes",
                v.name
            );
            assert_eq!(decode(&wire), Some(*hash));
        }
        if parent.is_none() {
            let chain = request_chain(&v.tokens, v.block_size);
            let wire: Vec<String> = chain
                .block_hashes
                .iter()
                .map(|b| STANDARD.encode(b))
                .collect();
            let golden: Vec<&str> = v.prefix_hashes.iter().map(|h| h.base64.as_str()).collect();
            assert_eq!(wire, golden, "{}: request chain", v.name);
        }
    }
}

#[test]
fn fixture_covers_the_required_cases() {
    let fixture = fixture();
    let has = |pred: &dyn Fn(&Vector) -> bool| fixture.vectors.iter().any(pred);
    assert!(has(&|v| v.parent.is_some()), "parent chain");
    assert!(
        has(&|v| v.prefix_hashes.is_empty()),
        "shorter than one block"
    );
    assert!(has(&|v| v.block_size != 16), "block size other than 16");
    assert!(
        has(&|v| v.tokens.iter().any(|&t| t >= 1 << 31)),
        "token ids >= 2^31"
    );
    assert!(
        has(&|v| v.tokens.len() % v.block_size != 0 && !v.prefix_hashes.is_empty()),
        "partial tail"
    );
    assert!(has(&|v| v.prefix_hashes.len() >= 3), "multi-block");
}
