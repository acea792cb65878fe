//! Compiles the proto with `protox` (pure Rust, no `protoc`) and generates the
//! Rust messages; with the `grpc` feature also the tonic client and server and
//! the encoded descriptor set served by gRPC reflection. The Envoy
//! `GrpcService` subset the filter passes to `dispatch_grpc_call` is compiled
//! separately, messages only, so reflection lists only our service.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "inferencecache/v1alpha1/inferencecache.proto";
    println!("cargo:rerun-if-changed={proto}");
    let descriptors = protox::compile([proto], ["."])?;
    let grpc = std::env::var_os("CARGO_FEATURE_GRPC").is_some();
    if grpc {
        let out = PathBuf::from(std::env::var("OUT_DIR")?);
        let bytes = prost::Message::encode_to_vec(&descriptors);
        std::fs::write(out.join("inferencecache_descriptor.bin"), bytes)?;
    }
    tonic_prost_build::configure()
        .btree_map(".")
        .build_client(grpc)
        .build_server(grpc)
        .compile_fds(descriptors)?;

    let envoy = "envoy/config/core/v3/grpc_service.proto";
    println!("cargo:rerun-if-changed={envoy}");
    tonic_prost_build::configure()
        .build_client(false)
        .build_server(false)
        .compile_fds(protox::compile([envoy], ["."])?)?;
    Ok(())
}
