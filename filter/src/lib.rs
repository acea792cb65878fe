//! proxy-wasm filter that asks the policy server where to route each inference request.
