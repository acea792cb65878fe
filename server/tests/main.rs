//! The integration tests of this crate, in one binary: each file of
//! `tests/` is a module of it, so the crate links once, not once per file.
//! They start the server in-process (`inference_cache_server::start`); the
//! tests that run the `inference-cache` binary are those of `cli/tests/`.
//!
//! One file's tests: `cargo test -p inference-cache-server --test integration contract_lookup::`.

mod contract_support;
#[path = "../../tests/src/http.rs"]
mod http;
mod nats_support;

mod accuracy_watch;
mod chat_requests;
mod configmap_reload;
mod contract_ingest;
mod contract_lookup;
mod contract_policy;
mod hardening;
mod membership;
mod monitoring;
mod pd_route;
mod scale_out;

#[path = "../../tests/src/test_files.rs"]
mod test_files;

/// The root of this crate's test binary (its `[[test]]` target).
const HARNESSES: &[&str] = &["main.rs"];

/// Cargo's automatic test targets are off (`autotests = false`): a file of
/// `tests/` runs only when a harness declares it with `mod <file>;`.
#[test]
fn every_test_file_is_compiled() {
    test_files::assert_every_test_file_is_compiled(env!("CARGO_MANIFEST_DIR"), HARNESSES);
}
