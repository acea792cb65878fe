//! The integration tests of this crate, in two binaries: this one, and
//! `tests/container_image.rs`, whose static musl build of the server takes
//! both cores for minutes and so runs alone. Each file of `tests/` is a
//! module of one of them, so the crate links twice, not once per file.
//!
//! One file's tests: `cargo test -p inference-cache-server --test integration contract_lookup::`.

mod contract_support;
mod nats_support;

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

/// The roots of this crate's test binaries (its `[[test]]` targets).
const HARNESSES: &[&str] = &["main.rs", "container_image.rs"];

/// Cargo's automatic test targets are off (`autotests = false`): a file of
/// `tests/` runs only when a harness declares it with `mod <file>;`.
#[test]
fn every_test_file_is_compiled() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
    let roots: String = HARNESSES
        .iter()
        .map(|h| std::fs::read_to_string(dir.join(h)).expect("reading a harness"))
        .collect();
    let mut missing = Vec::new();
    for entry in std::fs::read_dir(&dir).expect("reading tests/") {
        let path = entry.expect("a directory entry").path();
        let Some(name) = path.file_name().and_then(|s| s.to_str()) else {
            continue;
        };
        if let Some(stem) = name.strip_suffix(".rs")
            && !HARNESSES.contains(&name)
            && !roots.contains(&format!("\nmod {stem};\n"))
        {
            missing.push(format!("tests/{name}"));
        }
    }
    assert!(
        missing.is_empty(),
        "{missing:?} not compiled: declare each with `mod <file>;` in tests/main.rs \
         (and take shared helpers with `use crate::<helper>;`)"
    );
}
