//! The tests that start a real Envoy, in one binary of their own (the other
//! integration tests are in `tests/main.rs`, which checks that every file of
//! `tests/` is a module of one of the two).
//!
//! One file's tests: `cargo test -p inference-cache-tests --test envoy envoy_e2e::`.

#[path = "../src/istio_gateway.rs"]
mod istio_gateway;
#[path = "../src/proxy_wasm_host.rs"]
mod proxy_wasm_host;
#[path = "../src/proxy_wasm_host_envoy.rs"]
mod proxy_wasm_host_envoy;

/// Tests that start an Envoy (end to end, Istio gateway) run one at a time:
/// the fail-open timing bound must not measure a busy machine. They have this
/// binary to themselves for the same reason.
static ENVOY_SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

mod envoy_e2e;
mod envoy_overhead;
mod istio_e2e;
