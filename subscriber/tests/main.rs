//! The integration tests of this crate, in one binary: each file of
//! `tests/` is a module here, so the crate links once, not once per file.
//!
//! One file's tests: `cargo test -p inference-cache-subscriber --test integration e2e::`.

mod common;
#[path = "../../tests/src/http.rs"]
mod http;

mod e2e;
mod load;
mod membership;
mod report;
mod tls;

#[path = "../../tests/src/test_files.rs"]
mod test_files;

/// The roots of this crate's test binaries (its `[[test]]` targets).
const HARNESSES: &[&str] = &["main.rs"];

/// Cargo's automatic test targets are off (`autotests = false`): a file of
/// `tests/` runs only when a harness declares it with `mod <file>;`.
#[test]
fn every_test_file_is_compiled() {
    test_files::assert_every_test_file_is_compiled(env!("CARGO_MANIFEST_DIR"), HARNESSES);
}
