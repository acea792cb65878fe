//! The `inferencecache.v1alpha1` wire types.
//!
//! The proto lives in `proto/inferencecache/v1alpha1/inferencecache.proto` and
//! is compiled at build time without `protoc`. With default features the crate
//! also carries the tonic client and server stubs ([`v1alpha1::inference_cache_client`],
//! [`v1alpha1::inference_cache_server`]) and [`FILE_DESCRIPTOR_SET`] for gRPC
//! reflection. Without them (`--no-default-features`) it holds the prost
//! messages alone and builds for `wasm32-wasip1`, which is what the proxy-wasm
//! filter links against.

/// `inferencecache.v1alpha1`: messages, enums and (with `grpc`) the service stubs.
#[allow(missing_docs, clippy::all)]
pub mod v1alpha1 {
    include!(concat!(env!("OUT_DIR"), "/inferencecache.v1alpha1.rs"));
}

/// `envoy.config.core.v3.GrpcService`, the subset a proxy-wasm plugin passes to
/// `dispatch_grpc_call` to name a cluster together with the `:authority` of
/// the call (`proto/envoy/config/core/v3/grpc_service.proto`).
#[allow(missing_docs, clippy::all)]
pub mod envoy {
    include!(concat!(env!("OUT_DIR"), "/envoy.config.core.v3.rs"));
}

/// Encoded `FileDescriptorSet` of the proto, for gRPC reflection.
#[cfg(feature = "grpc")]
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/inferencecache_descriptor.bin"));

/// Fully qualified service name, as gRPC health and reflection report it.
pub const SERVICE_NAME: &str = "inferencecache.v1alpha1.InferenceCache";

/// `LookupRouteResponse.reason_code` vocabulary.
pub mod reason {
    /// Ranked replicas holding a leading run of the prompt's blocks.
    pub const PREFIX_MATCH: &str = "PREFIX_MATCH";
    /// Replicas warm for the (tenant, model, hash_scheme) scope, no prefix evidence.
    pub const TENANT_HOT: &str = "TENANT_HOT";
    /// One stable replica chosen from the prompt fingerprint.
    pub const AFFINITY_HINT: &str = "AFFINITY_HINT";
    /// Nothing to say; route normally.
    pub const NO_HINT: &str = "NO_HINT";
    /// The tenant's policy requires a block-hash chain.
    pub const POLICY_REQUIRES_CHAIN: &str = "POLICY_REQUIRES_CHAIN";
    /// The lookup exceeded its deadline.
    pub const TIMEOUT: &str = "TIMEOUT";
    /// tenant_id is set but unknown to a non-empty index.
    pub const UNKNOWN_TENANT: &str = "UNKNOWN_TENANT";
    /// (tenant_id, model_id) has no entries.
    pub const UNKNOWN_MODEL: &str = "UNKNOWN_MODEL";
    /// (tenant_id, model_id) has entries, none under hash_scheme.
    pub const UNKNOWN_HASH_SCHEME: &str = "UNKNOWN_HASH_SCHEME";
    /// RenderTemplate / Ack success.
    pub const OK: &str = "OK";
    /// RenderTemplate: no template with that name (or revision).
    pub const TEMPLATE_NOT_FOUND: &str = "TEMPLATE_NOT_FOUND";
    /// RenderTemplate: the template could not be rendered with the variables.
    pub const RENDER_ERROR: &str = "RENDER_ERROR";
}

/// Reserved tenant id of the server's self-test; never readable or writable over the API.
pub const PROBE_TENANT: &str = "inferencecache.io/probe";

#[cfg(test)]
mod tests {
    use super::v1alpha1::*;
    use prost::Message;

    #[test]
    fn lookup_request_round_trips_with_fixed_field_numbers() {
        let request = LookupRouteRequest {
            model_id: "m".into(),
            tenant_id: "t".into(),
            prefix_hash: vec![1; 8],
            prefix_token_count: 16,
            hash_scheme: "vllm".into(),
            slo: Some(Slo {
                ttft_ms: 100,
                tbt_ms: 20,
            }),
            block_hashes: vec![vec![2; 8]],
            block_token_counts: vec![16],
            token_ids: vec![1, 2, 3],
            prompt_text: "hi".into(),
            adapter_id: "sql-lora".into(),
            messages: vec![ChatMessage {
                role: "user".into(),
                content: "x".into(),
            }],
            raw_prompt: "raw".into(),
            messages_json: r#"[{"role":"user","content":"x"}]"#.into(),
            tools_json: "[]".into(),
            chat_template_kwargs_json: r#"{"enable_thinking":false}"#.into(),
            add_generation_prompt: Some(false),
            continue_final_message: true,
            documents_json: "[]".into(),
            cache_salt: "salt".into(),
        };
        let bytes = request.encode_to_vec();
        assert_eq!(
            LookupRouteRequest::decode(bytes.as_slice()).ok(),
            Some(request)
        );
        // adapter_id = 11, wire type 2 → tag byte 0x5a.
        let only_adapter = LookupRouteRequest {
            adapter_id: "a".into(),
            ..Default::default()
        };
        assert_eq!(only_adapter.encode_to_vec(), vec![0x5a, 1, b'a']);
    }

    #[test]
    fn chat_request_fields_have_fixed_numbers() {
        let only = |request: LookupRouteRequest| request.encode_to_vec();
        // Wire type 2 (length-delimited), the tag as a varint, then "a".
        let text = |field: u8| {
            let tag = field << 3 | 2;
            if tag < 0x80 {
                vec![tag, 1, b'a']
            } else {
                vec![tag | 0x80, tag >> 7, 1, b'a']
            }
        };
        assert_eq!(
            only(LookupRouteRequest {
                messages_json: "a".into(),
                ..Default::default()
            }),
            text(14)
        );
        assert_eq!(
            only(LookupRouteRequest {
                tools_json: "a".into(),
                ..Default::default()
            }),
            text(15)
        );
        assert_eq!(
            only(LookupRouteRequest {
                chat_template_kwargs_json: "a".into(),
                ..Default::default()
            }),
            text(16)
        );
        assert_eq!(
            only(LookupRouteRequest {
                documents_json: "a".into(),
                ..Default::default()
            }),
            text(19)
        );
        assert_eq!(
            only(LookupRouteRequest {
                cache_salt: "a".into(),
                ..Default::default()
            }),
            text(20)
        );
        // Tags from field 16 on take two varint bytes.
        assert_eq!(text(14), vec![0x72, 1, b'a']);
        assert_eq!(text(20), vec![0xa2, 0x01, 1, b'a']);
        // proto3 `optional`: an explicit false is on the wire, unset is not.
        assert_eq!(
            only(LookupRouteRequest {
                add_generation_prompt: Some(false),
                ..Default::default()
            }),
            vec![0x88, 0x01, 0]
        );
        assert!(only(LookupRouteRequest::default()).is_empty());
        assert_eq!(
            only(LookupRouteRequest {
                continue_final_message: true,
                ..Default::default()
            }),
            vec![0x90, 0x01, 1]
        );
        // An old client's bytes decode with every new field at its default.
        let old = LookupRouteRequest {
            model_id: "m".into(),
            messages: vec![ChatMessage {
                role: "user".into(),
                content: "x".into(),
            }],
            ..Default::default()
        };
        let decoded = LookupRouteRequest::decode(old.encode_to_vec().as_slice()).expect("decodes");
        assert_eq!(decoded.add_generation_prompt, None);
        assert!(decoded.messages_json.is_empty() && decoded.cache_salt.is_empty());
    }

    #[test]
    fn outcome_reports_round_trip_with_fixed_field_numbers() {
        let report = OutcomeReport {
            outcomes: vec![RouteOutcome {
                tenant_id: "t".into(),
                model_id: "m".into(),
                replica_id: "r".into(),
                reason_code: "PREFIX_MATCH".into(),
                predicted_tokens: 128,
                cached_tokens: 112,
                prompt_tokens: 168,
                routed: true,
                shadow: false,
            }],
            dropped: 3,
        };
        let bytes = report.encode_to_vec();
        assert_eq!(OutcomeReport::decode(bytes.as_slice()).ok(), Some(report));
        let only = |outcome: RouteOutcome| outcome.encode_to_vec();
        assert_eq!(
            only(RouteOutcome {
                predicted_tokens: 1,
                ..Default::default()
            }),
            vec![0x28, 1]
        );
        assert_eq!(
            only(RouteOutcome {
                cached_tokens: 1,
                ..Default::default()
            }),
            vec![0x30, 1]
        );
        assert_eq!(
            only(RouteOutcome {
                shadow: true,
                ..Default::default()
            }),
            vec![0x48, 1]
        );
        let dropped = OutcomeReport {
            dropped: 2,
            ..Default::default()
        };
        assert_eq!(dropped.encode_to_vec(), vec![0x10, 2]);
    }

    #[test]
    fn fixed_field_numbers_on_responses_and_entries() {
        let response = LookupRouteResponse {
            token_ids: vec![7],
            ..Default::default()
        };
        assert_eq!(response.encode_to_vec(), vec![0x22, 1, 7]); // field 4, packed
        let response = LookupRouteResponse {
            adapter_id: "a".into(),
            ..Default::default()
        };
        assert_eq!(response.encode_to_vec(), vec![0x2a, 1, b'a']); // field 5
        let response = LookupRouteResponse {
            shadow: true,
            ..Default::default()
        };
        assert_eq!(response.encode_to_vec(), vec![0x30, 1]); // field 6, varint
        let state = GetCacheStateResponse {
            accuracy: vec![ReplicaAccuracy::default()],
            ..Default::default()
        };
        assert_eq!(state.encode_to_vec(), vec![0x1a, 0]); // field 3, empty message
        let score = ReplicaScore {
            tier: CacheTier::T2 as i32,
            ..Default::default()
        };
        assert_eq!(score.encode_to_vec(), vec![0x28, 2]); // field 5, varint
        let entry = PrefixEntry {
            adapter_id: "a".into(),
            ..Default::default()
        };
        assert_eq!(entry.encode_to_vec(), vec![0x32, 1, b'a']); // field 6
        let update = CacheStateUpdate {
            adapter_id: "a".into(),
            ..Default::default()
        };
        assert_eq!(update.encode_to_vec(), vec![0x42, 1, b'a']); // field 8
        let stats = ReplicaStats {
            t2_query_tokens: 3,
            ..Default::default()
        };
        assert_eq!(stats.encode_to_vec(), vec![0x38, 3]); // field 7
        let event = CacheEvent {
            adapter_id: "a".into(),
            ..Default::default()
        };
        assert_eq!(event.encode_to_vec(), vec![0x3a, 1, b'a']); // field 7
    }

    #[test]
    fn cache_state_update_round_trips() {
        let update = CacheStateUpdate {
            replica_id: "r1".into(),
            model_id: "m".into(),
            tenant_id: "t".into(),
            hash_scheme: "vllm".into(),
            timestamp_us: 42,
            prefixes: vec![PrefixEntry {
                prefix_hash: vec![9; 8],
                token_count: 32,
                block_hashes: vec![vec![1; 8], vec![2; 8]],
                block_token_counts: vec![16, 16],
                tier: CacheTier::T1 as i32,
                adapter_id: String::new(),
            }],
            stats: Some(ReplicaStats {
                replica_id: "r1".into(),
                cache_memory_bytes: 1 << 30,
                hit_rate: 0.5,
                pressure: 0.25,
                client_version: "lmcache-0.3".into(),
                t2_hit_tokens: 10,
                t2_query_tokens: 20,
                requests_waiting: 3,
                requests_running: 7,
                kv_cache_usage: 0.5,
            }),
            adapter_id: "lora-a".into(),
        };
        let bytes = update.encode_to_vec();
        assert_eq!(
            CacheStateUpdate::decode(bytes.as_slice()).ok(),
            Some(update)
        );
        assert!(CacheStateUpdate::decode(&[0xff, 0xff, 0xff][..]).is_err());
    }

    #[test]
    fn event_type_values() {
        assert_eq!(cache_event::Type::PrefixAdded as i32, 1);
        assert_eq!(cache_event::Type::PrefixEvicted as i32, 2);
        assert_eq!(cache_event::Type::ReplicaUpdated as i32, 3);
        assert_eq!(cache_event::Type::AllCleared as i32, 4);
        assert_eq!(
            CacheTier::from_str_name("CACHE_TIER_T3"),
            Some(CacheTier::T3)
        );
    }

    #[test]
    fn envoy_grpc_service_uses_envoys_field_numbers() {
        use super::envoy::{GrpcService, grpc_service};
        let service = GrpcService {
            target_specifier: Some(grpc_service::TargetSpecifier::EnvoyGrpc(
                grpc_service::EnvoyGrpc {
                    cluster_name: "c".into(),
                    authority: "a".into(),
                },
            )),
        };
        // envoy_grpc = 1 { cluster_name = 1, authority = 2 }
        assert_eq!(
            service.encode_to_vec(),
            [0x0a, 0x06, 0x0a, 0x01, b'c', 0x12, 0x01, b'a']
        );
    }
}
