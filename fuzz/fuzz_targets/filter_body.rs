//! The filter's parsers of client and operator bytes, selected by the first
//! input byte (the rest is the payload):
//!
//! - `0`: the plugin configuration, `Settings::from_json`;
//! - `1`: a `/v1/completions` body, `parse_body` then `lookup_request`;
//! - `2`: a `/v1/chat/completions` body, likewise;
//! - `3`: an engine's JSON response body, `json_usage`;
//! - `4`: an engine's event-stream response, fed to `EventStreamReader` in
//!   chunks split at the payload's `\n` bytes.
#![no_main]

use std::sync::OnceLock;

use inference_cache_filter::{
    Api, EventStreamReader, Settings, json_usage, lookup_request, parse_body,
};
use libfuzzer_sys::fuzz_target;

/// The settings a shipped configuration produces (chain fingerprinting on).
fn settings() -> &'static Settings {
    static SETTINGS: OnceLock<Settings> = OnceLock::new();
    SETTINGS.get_or_init(|| {
        Settings::from_json(br#"{"grpc_cluster":"ic","replica_id_is_endpoint":true}"#)
            .expect("the fixed configuration is valid")
    })
}

fn body(api: Api, payload: &[u8]) {
    if let Ok(parsed) = parse_body(api, payload) {
        let _ = lookup_request(settings(), "tenant-a", parsed);
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&selector, payload)) = data.split_first() else {
        return;
    };
    match selector % 5 {
        0 => {
            if let Ok(settings) = Settings::from_json(payload) {
                // A configuration that parsed must also serve requests.
                let _ = settings.model_target("llama");
                let _ = settings.endpoint_of("10.0.0.1:8000");
                if let Ok(parsed) = parse_body(Api::Completions, br#"{"model":"m","prompt":"hi"}"#)
                {
                    let _ = lookup_request(&settings, "t", parsed);
                }
            }
        }
        1 => body(Api::Completions, payload),
        2 => body(Api::ChatCompletions, payload),
        3 => {
            let _ = json_usage(payload);
        }
        _ => {
            let mut reader = EventStreamReader::new(64 * 1024);
            for chunk in payload.split_inclusive(|&b| b == b'\n') {
                if reader.push(chunk).is_err() {
                    return;
                }
            }
            let _ = reader.finish();
        }
    }
});
