//! What happened to one request, the decision on a `LookupRouteResponse`, and metric names.
//!
//! Every inference request ends in exactly one [`Outcome`]: routed to a
//! replica, a routable hint in shadow mode (measured, not routed), a hint
//! that is not routed (any reason code outside the routable set), or a [`FailureKind`] after which the request continues untouched
//! (fail open). The outcome is what the response header reports and which
//! counters move. Metric names are `&'static str` from a fixed list, so the
//! adapter can define them all up front and a misbehaving server cannot
//! create unbounded metrics: unknown reason codes count as `OTHER`.

use inference_cache_proto::reason;
use inference_cache_proto::v1alpha1::LookupRouteResponse;

use crate::config::Settings;

/// Why the filter left a request untouched.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailureKind {
    /// `Content-Length` or the buffered body exceeded `max_body_bytes`.
    BodyTooLarge,
    /// The body is not JSON of the API's request shape.
    InvalidJson,
    /// No `model` in the body.
    MissingModel,
    /// Batch prompts, empty prompts, non-text chat parts.
    UnsupportedPrompt,
    /// A token-id prompt shorter than one block.
    PromptTooShort,
    /// The host refused the gRPC call (unknown cluster, no capacity).
    DispatchFailed,
    /// The gRPC call ended with a non-zero status (including its timeout).
    GrpcError,
    /// The gRPC response was not a `LookupRouteResponse`.
    DecodeError,
    /// A routable hint whose replica list is empty.
    NoReplica,
    /// A routable hint naming a replica with no known endpoint.
    UnknownReplica,
}

impl FailureKind {
    /// Every kind, for defining metrics up front.
    pub const ALL: [FailureKind; 10] = [
        FailureKind::BodyTooLarge,
        FailureKind::InvalidJson,
        FailureKind::MissingModel,
        FailureKind::UnsupportedPrompt,
        FailureKind::PromptTooShort,
        FailureKind::DispatchFailed,
        FailureKind::GrpcError,
        FailureKind::DecodeError,
        FailureKind::NoReplica,
        FailureKind::UnknownReplica,
    ];

    /// Upper-case code, as the reason header reports it.
    pub fn code(self) -> &'static str {
        match self {
            FailureKind::BodyTooLarge => "BODY_TOO_LARGE",
            FailureKind::InvalidJson => "INVALID_JSON",
            FailureKind::MissingModel => "MISSING_MODEL",
            FailureKind::UnsupportedPrompt => "UNSUPPORTED_PROMPT",
            FailureKind::PromptTooShort => "PROMPT_TOO_SHORT",
            FailureKind::DispatchFailed => "DISPATCH_FAILED",
            FailureKind::GrpcError => "GRPC_ERROR",
            FailureKind::DecodeError => "DECODE_ERROR",
            FailureKind::NoReplica => "NO_REPLICA",
            FailureKind::UnknownReplica => "UNKNOWN_REPLICA",
        }
    }

    /// Counter name of this kind.
    pub fn metric(self) -> &'static str {
        match self {
            FailureKind::BodyTooLarge => "inferencecache_filter.failure.body_too_large",
            FailureKind::InvalidJson => "inferencecache_filter.failure.invalid_json",
            FailureKind::MissingModel => "inferencecache_filter.failure.missing_model",
            FailureKind::UnsupportedPrompt => "inferencecache_filter.failure.unsupported_prompt",
            FailureKind::PromptTooShort => "inferencecache_filter.failure.prompt_too_short",
            FailureKind::DispatchFailed => "inferencecache_filter.failure.dispatch_failed",
            FailureKind::GrpcError => "inferencecache_filter.failure.grpc_error",
            FailureKind::DecodeError => "inferencecache_filter.failure.decode_error",
            FailureKind::NoReplica => "inferencecache_filter.failure.no_replica",
            FailureKind::UnknownReplica => "inferencecache_filter.failure.unknown_replica",
        }
    }
}

/// Reason codes with their own counter; anything else counts as `OTHER`.
pub const KNOWN_REASONS: [&str; 9] = [
    reason::PREFIX_MATCH,
    reason::TENANT_HOT,
    reason::AFFINITY_HINT,
    reason::NO_HINT,
    reason::POLICY_REQUIRES_CHAIN,
    reason::TIMEOUT,
    reason::UNKNOWN_TENANT,
    reason::UNKNOWN_MODEL,
    reason::UNKNOWN_HASH_SCHEME,
];

/// Counter of requests whose destination header was set.
pub const ROUTED_METRIC: &str = "inferencecache_filter.routed";
/// Counter of routable hints not routed because the answer was in shadow mode.
pub const SHADOW_METRIC: &str = "inferencecache_filter.shadow";
/// Counter of client-supplied destination headers removed.
pub const SPOOFED_DESTINATION_METRIC: &str = "inferencecache_filter.destination_header_removed";
/// Counter of LookupRoute calls dispatched.
pub const LOOKUPS_METRIC: &str = "inferencecache_filter.lookups";

/// Counter name of a reason code from the server.
pub fn reason_metric(code: &str) -> &'static str {
    match code {
        reason::PREFIX_MATCH => "inferencecache_filter.reason.PREFIX_MATCH",
        reason::TENANT_HOT => "inferencecache_filter.reason.TENANT_HOT",
        reason::AFFINITY_HINT => "inferencecache_filter.reason.AFFINITY_HINT",
        reason::NO_HINT => "inferencecache_filter.reason.NO_HINT",
        reason::POLICY_REQUIRES_CHAIN => "inferencecache_filter.reason.POLICY_REQUIRES_CHAIN",
        reason::TIMEOUT => "inferencecache_filter.reason.TIMEOUT",
        reason::UNKNOWN_TENANT => "inferencecache_filter.reason.UNKNOWN_TENANT",
        reason::UNKNOWN_MODEL => "inferencecache_filter.reason.UNKNOWN_MODEL",
        reason::UNKNOWN_HASH_SCHEME => "inferencecache_filter.reason.UNKNOWN_HASH_SCHEME",
        _ => "inferencecache_filter.reason.OTHER",
    }
}

/// Every counter the filter may increment.
pub fn all_metrics() -> Vec<&'static str> {
    let mut names = vec![
        ROUTED_METRIC,
        SHADOW_METRIC,
        SPOOFED_DESTINATION_METRIC,
        LOOKUPS_METRIC,
    ];
    names.extend(KNOWN_REASONS.iter().map(|code| reason_metric(code)));
    names.push(reason_metric(""));
    names.extend(FailureKind::ALL.iter().map(|kind| kind.metric()));
    names.extend(crate::accuracy::accuracy_counters());
    names.extend(crate::report::report_counters());
    names
}

/// Every histogram the filter may record into.
pub fn all_histograms() -> Vec<&'static str> {
    crate::accuracy::accuracy_histograms()
}

/// How one inference request ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The destination header was set to `endpoint` of `replica_id`.
    Routed {
        /// The server's reason code.
        reason: String,
        /// The top replica.
        replica_id: String,
        /// Its `ip:port`.
        endpoint: String,
    },
    /// A routable hint in shadow mode (`LookupRouteResponse.shadow`): not
    /// routed, only measured.
    Shadow {
        /// The server's reason code.
        reason: String,
        /// The top replica, where routing would have sent the request.
        replica_id: String,
    },
    /// The server answered with a reason code the filter does not route on.
    NotRouted {
        /// The server's reason code.
        reason: String,
    },
    /// The filter failed open.
    Failed(FailureKind),
}

impl Outcome {
    /// The value of the reason response header.
    pub fn header_value(&self) -> &str {
        match self {
            Outcome::Routed { reason, .. }
            | Outcome::Shadow { reason, .. }
            | Outcome::NotRouted { reason } => {
                if is_header_safe(reason) {
                    reason
                } else {
                    "OTHER"
                }
            }
            Outcome::Failed(kind) => kind.code(),
        }
    }
}

fn is_header_safe(code: &str) -> bool {
    !code.is_empty()
        && code.len() <= 64
        && code
            .bytes()
            .all(|byte| byte.is_ascii_alphanumeric() || byte == b'_' || byte == b'-')
}

/// Decides what to do with a decoded lookup response.
pub fn decide(settings: &Settings, response: &LookupRouteResponse) -> Outcome {
    let reason = response.reason_code.clone();
    if !settings.routable_reasons.contains(&reason) {
        return Outcome::NotRouted { reason };
    }
    let Some(top) = response.replica_scores.first() else {
        return Outcome::Failed(FailureKind::NoReplica);
    };
    if response.shadow {
        return Outcome::Shadow {
            reason,
            replica_id: top.replica_id.clone(),
        };
    }
    match settings.endpoint_of(&top.replica_id) {
        Some(endpoint) => Outcome::Routed {
            reason,
            replica_id: top.replica_id.clone(),
            endpoint,
        },
        None => Outcome::Failed(FailureKind::UnknownReplica),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use inference_cache_proto::v1alpha1::ReplicaScore;

    fn settings() -> Settings {
        let mut settings = Settings::with_cluster("ic");
        settings
            .replica_endpoints
            .insert("a".into(), "10.0.0.1:8000".into());
        settings.replica_id_is_endpoint = true;
        settings
    }

    fn response(reason: &str, replicas: &[&str]) -> LookupRouteResponse {
        LookupRouteResponse {
            reason_code: reason.into(),
            replica_scores: replicas
                .iter()
                .map(|id| ReplicaScore {
                    replica_id: (*id).into(),
                    score: 1.0,
                    ..ReplicaScore::default()
                })
                .collect(),
            ..LookupRouteResponse::default()
        }
    }

    #[test]
    fn routable_reasons_route_to_the_top_replica() {
        for code in DEFAULT_ROUTABLE {
            assert_eq!(
                decide(&settings(), &response(code, &["a", "127.0.0.1:1"])),
                Outcome::Routed {
                    reason: code.into(),
                    replica_id: "a".into(),
                    endpoint: "10.0.0.1:8000".into()
                }
            );
        }
        assert_eq!(
            decide(&settings(), &response("PREFIX_MATCH", &["127.0.0.1:9"])),
            Outcome::Routed {
                reason: "PREFIX_MATCH".into(),
                replica_id: "127.0.0.1:9".into(),
                endpoint: "127.0.0.1:9".into()
            }
        );
    }

    const DEFAULT_ROUTABLE: [&str; 3] = ["PREFIX_MATCH", "TENANT_HOT", "AFFINITY_HINT"];

    #[test]
    fn other_reasons_are_not_routed_even_with_replicas() {
        for code in ["NO_HINT", "TIMEOUT", "UNKNOWN_MODEL", "SOMETHING_NEW", ""] {
            assert_eq!(
                decide(&settings(), &response(code, &["a"])),
                Outcome::NotRouted {
                    reason: code.into()
                }
            );
        }
        let mut only_prefix = settings();
        only_prefix.routable_reasons = ["PREFIX_MATCH".to_owned()].into_iter().collect();
        assert_eq!(
            decide(&only_prefix, &response("AFFINITY_HINT", &["a"])),
            Outcome::NotRouted {
                reason: "AFFINITY_HINT".into()
            }
        );
    }

    #[test]
    fn shadow_answers_are_never_routed() {
        let mut shadow = response("PREFIX_MATCH", &["a"]);
        shadow.shadow = true;
        assert_eq!(
            decide(&settings(), &shadow),
            Outcome::Shadow {
                reason: "PREFIX_MATCH".into(),
                replica_id: "a".into()
            }
        );
        assert_eq!(decide(&settings(), &shadow).header_value(), "PREFIX_MATCH");
        let mut not_routable = response("NO_HINT", &[]);
        not_routable.shadow = true;
        assert_eq!(
            decide(&settings(), &not_routable),
            Outcome::NotRouted {
                reason: "NO_HINT".into()
            }
        );
    }

    #[test]
    fn empty_or_unknown_replicas_fail_open() {
        assert_eq!(
            decide(&settings(), &response("PREFIX_MATCH", &[])),
            Outcome::Failed(FailureKind::NoReplica)
        );
        assert_eq!(
            decide(&settings(), &response("PREFIX_MATCH", &["replica-z"])),
            Outcome::Failed(FailureKind::UnknownReplica)
        );
    }

    #[test]
    fn header_values_are_bounded() {
        assert_eq!(
            Outcome::NotRouted {
                reason: "NO_HINT".into()
            }
            .header_value(),
            "NO_HINT"
        );
        assert_eq!(
            Outcome::NotRouted {
                reason: "bad\r\nvalue".into()
            }
            .header_value(),
            "OTHER"
        );
        assert_eq!(
            Outcome::Failed(FailureKind::GrpcError).header_value(),
            "GRPC_ERROR"
        );
    }

    #[test]
    fn metric_names_are_unique_and_bounded() {
        let names = all_metrics();
        let unique: std::collections::HashSet<_> = names.iter().collect();
        assert_eq!(unique.len(), names.len());
        assert_eq!(reason_metric("NEW_CODE"), reason_metric("x"));
        assert_eq!(
            reason_metric("PREFIX_MATCH"),
            "inferencecache_filter.reason.PREFIX_MATCH"
        );
    }
}
