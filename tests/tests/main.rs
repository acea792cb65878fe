//! The integration tests of this crate, in two binaries: this one, and
//! `tests/envoy.rs` for the tests that start an Envoy (one at a time). Each
//! file of `tests/` is a module of one of them, so the crate links twice,
//! not once per file.
//!
//! One file's tests: `cargo test -p inference-cache-tests --test integration grpc_rpcs::`.

#[path = "../src/proxy_wasm_host.rs"]
mod proxy_wasm_host;

mod canary;
mod filter_wasm;
mod grpc_outcomes;
mod grpc_prompts;
mod grpc_rpcs;

/// The roots of this crate's test binaries (its `[[test]]` targets).
const HARNESSES: &[&str] = &["main.rs", "envoy.rs"];

/// Cargo's automatic test targets are off (`autotests = false`): a file of
/// `tests/` runs only when a harness declares it with `mod <file>;`.
#[test]
fn every_test_file_is_compiled() {
    inference_cache_tests::test_files::assert_every_test_file_is_compiled(
        env!("CARGO_MANIFEST_DIR"),
        HARNESSES,
    );
}
