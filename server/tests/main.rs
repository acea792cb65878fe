//! The integration tests of this crate, in two binaries: this one, and
//! `tests/container_image.rs`, whose static musl build of the server takes
//! both cores for minutes and so runs alone. Each file of `tests/` is a
//! module of one of them, so the crate links twice, not once per file.
//!
//! One file's tests: `cargo test -p inference-cache-server --test integration contract_lookup::`.

mod contract_support;
mod nats_support;
mod process_support;

mod accuracy_watch;
mod chat_requests;
mod cli;
mod configmap_reload;
mod contract_ingest;
mod contract_lookup;
mod contract_policy;
mod deploy_manifests;
mod hardening;
mod membership;
mod monitoring;
mod pd_route;
mod scale_out;
mod scale_out_processes;

#[path = "../../tests/src/test_files.rs"]
mod test_files;

/// The roots of this crate's test binaries (its `[[test]]` targets).
const HARNESSES: &[&str] = &["main.rs", "container_image.rs"];

/// Cargo's automatic test targets are off (`autotests = false`): a file of
/// `tests/` runs only when a harness declares it with `mod <file>;`.
#[test]
fn every_test_file_is_compiled() {
    test_files::assert_every_test_file_is_compiled(env!("CARGO_MANIFEST_DIR"), HARNESSES);
}
