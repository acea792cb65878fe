//! The integration tests of the `inference-cache` binary, in two test
//! binaries: this one, and `tests/container_image.rs`, whose static musl
//! build of the binary takes both cores for minutes and so runs alone. Each
//! file of `tests/` is a module of one of them. They run the binary of this
//! package (`env!("CARGO_BIN_EXE_inference-cache")`), which Cargo builds
//! before them.
//!
//! One file's tests: `cargo test -p inference-cache --test integration cli::`.

#[path = "../../tests/src/http.rs"]
mod http;
#[path = "../../server/tests/nats_support/mod.rs"]
mod nats_support;
mod process_support;

mod cli;
mod deploy_manifests;
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
