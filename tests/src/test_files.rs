//! The workspace's crates turn Cargo's automatic test targets off
//! (`autotests = false`) and compile each file of `tests/` as a module of one
//! harness (`tests/main.rs`), so a crate links once rather than once per
//! file. A file no harness declares would silently never run; each harness
//! has a test that calls [`assert_every_test_file_is_compiled`]. Crates other
//! than this one include this file with `#[path]`.

/// Panics naming every `tests/*.rs` file of the crate at `manifest_dir` that
/// none of `harnesses` (file names in `tests/`) declares with `mod <file>;`.
pub fn assert_every_test_file_is_compiled(manifest_dir: &str, harnesses: &[&str]) {
    let dir = std::path::Path::new(manifest_dir).join("tests");
    let roots: String = harnesses
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
            && !harnesses.contains(&name)
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
