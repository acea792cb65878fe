//! msgpack KV-event batches as the subscriber receives them from an engine's ZMQ socket.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // Any answer is fine (a batch or a DecodeError); a panic or a hang is a bug.
    let _ = inference_cache_subscriber::decode_batch(data);
});
