//! Operator policy files: `PolicySet::from_yaml` on arbitrary UTF-8.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|text: &str| {
    let _ = inference_cache_index::PolicySet::from_yaml(text);
});
