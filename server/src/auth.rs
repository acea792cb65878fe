//! Producer authentication and tenant scoping.
//!
//! `--auth-file` is YAML naming the principals allowed to call the server:
//!
//! ```yaml
//! principals:
//!   - name: team-a-vllm
//!     tokenFile: team-a.token        # or tokenSha256: <hex SHA-256 of the token>
//!     tenants: [team-a]              # tenants it may read and write ("*": every tenant)
//!     replicas: ["10.0.0.0/8"]       # replica ids or endpoint CIDRs it may write ("*": any)
//!   - name: mesh-producer
//!     identity: spiffe://cluster.local/ns/team-b/sa/vllm   # client certificate SAN URI, DNS SAN or CN
//!     tenants: [team-b]
//!     replicas: ["*"]
//!   - name: gateway
//!     tokenSha256: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
//!     tenants: ["*"]                 # reads only: no replicas
//! ```
//!
//! A caller presents a bearer token (`authorization: Bearer <token>`, compared
//! by SHA-256 digest in constant time) or a client certificate (with
//! `--client-ca`). Relative `tokenFile` paths are resolved against the auth
//! file's directory; token files are read when the auth file is (re)loaded.
//!
//! With an auth file, producer RPCs (ReportCacheState, PublishEvent) must come
//! from a principal granted the update's tenant and every replica it names
//! (`UNAUTHENTICATED` without a known credential, `PERMISSION_DENIED`
//! outside the grant); LookupRoute for another tenant answers the fail-open
//! `NO_HINT` envelope; GetCacheState for another tenant is `PERMISSION_DENIED`.
//!
//! Without an auth file, lookups are open and producer RPCs are accepted only
//! from loopback peers unless `--allow-unauthenticated-producers` is given.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context as _;
use arc_swap::ArcSwap;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use tonic::Code;

/// The `authorization` metadata prefix of a bearer token.
const BEARER: &str = "Bearer ";

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AuthFile {
    #[serde(default)]
    principals: Vec<PrincipalDoc>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct PrincipalDoc {
    name: String,
    #[serde(default)]
    token_file: Option<PathBuf>,
    #[serde(default)]
    token_sha256: Option<String>,
    #[serde(default)]
    identity: Option<String>,
    #[serde(default)]
    tenants: Vec<String>,
    #[serde(default)]
    replicas: Vec<String>,
}

/// How a principal proves who it is.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Credential {
    /// SHA-256 of its bearer token.
    Token([u8; 32]),
    /// A client certificate SAN URI, DNS SAN or common name.
    Identity(String),
}

/// A replica grant.
#[derive(Debug, Clone, PartialEq, Eq)]
enum ReplicaRule {
    Any,
    Exact(String),
    Cidr(IpAddr, u8),
}

impl ReplicaRule {
    fn parse(text: &str) -> Result<Self, String> {
        if text == "*" {
            return Ok(Self::Any);
        }
        if let Some((ip, bits)) = text.split_once('/')
            && let Ok(ip) = ip.parse::<IpAddr>()
        {
            let bits: u8 = bits
                .parse()
                .map_err(|_| format!("{text:?}: bad prefix length"))?;
            let max = if ip.is_ipv4() { 32 } else { 128 };
            if bits > max {
                return Err(format!("{text:?}: prefix length above {max}"));
            }
            return Ok(Self::Cidr(ip, bits));
        }
        if text.is_empty() {
            return Err("empty replica grant".into());
        }
        Ok(Self::Exact(text.to_owned()))
    }

    fn matches(&self, replica: &str) -> bool {
        match self {
            Self::Any => true,
            Self::Exact(id) => id == replica,
            Self::Cidr(net, bits) => replica_ip(replica).is_some_and(|ip| in_cidr(ip, *net, *bits)),
        }
    }
}

/// The IP address of a replica id like `10.1.2.3:8000`, `[::1]:8000` or `10.1.2.3`.
fn replica_ip(replica: &str) -> Option<IpAddr> {
    replica
        .parse::<SocketAddr>()
        .map(|a| a.ip())
        .or_else(|_| replica.parse::<IpAddr>())
        .ok()
}

fn in_cidr(ip: IpAddr, net: IpAddr, bits: u8) -> bool {
    match (ip, net) {
        (IpAddr::V4(ip), IpAddr::V4(net)) => {
            let mask = u32::MAX.checked_shl(32 - u32::from(bits)).unwrap_or(0);
            u32::from(ip) & mask == u32::from(net) & mask
        }
        (IpAddr::V6(ip), IpAddr::V6(net)) => {
            let mask = u128::MAX.checked_shl(128 - u32::from(bits)).unwrap_or(0);
            u128::from(ip) & mask == u128::from(net) & mask
        }
        _ => false,
    }
}

/// One caller the auth file names, and what it may do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    /// Name in logs.
    pub name: String,
    credential: Credential,
    tenants: Vec<String>,
    replicas: Vec<ReplicaRule>,
}

impl Principal {
    /// True when it may read (and, with a replica grant, write) `tenant`.
    pub fn has_tenant(&self, tenant: &str) -> bool {
        self.tenants.iter().any(|t| t == "*" || t == tenant)
    }

    /// True when it may write `replica`.
    pub fn has_replica(&self, replica: &str) -> bool {
        self.replicas.iter().any(|r| r.matches(replica))
    }
}

/// The parsed auth file.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AuthConfig {
    principals: Vec<Arc<Principal>>,
}

impl AuthConfig {
    /// Parses an auth file; `base` resolves relative token files.
    pub fn from_yaml(text: &str, base: &Path) -> anyhow::Result<Self> {
        let file: AuthFile = serde_yaml::from_str(text).context("parsing the auth file")?;
        let mut principals = Vec::with_capacity(file.principals.len());
        for doc in file.principals {
            let name = doc.name.clone();
            let credential = match (&doc.token_file, &doc.token_sha256, &doc.identity) {
                (Some(path), None, None) => {
                    let path = base.join(path);
                    let token = std::fs::read_to_string(&path).with_context(|| {
                        format!("principal {name}: reading token file {}", path.display())
                    })?;
                    let token = token.trim();
                    anyhow::ensure!(
                        !token.is_empty(),
                        "principal {name}: token file {} is empty",
                        path.display()
                    );
                    Credential::Token(sha256(token.as_bytes()))
                }
                (None, Some(hex), None) => Credential::Token(
                    parse_sha256(hex).with_context(|| format!("principal {name}: tokenSha256"))?,
                ),
                (None, None, Some(identity)) if !identity.is_empty() => {
                    Credential::Identity(identity.clone())
                }
                _ => anyhow::bail!(
                    "principal {name}: set exactly one of tokenFile, tokenSha256, identity"
                ),
            };
            let replicas = doc
                .replicas
                .iter()
                .map(|r| ReplicaRule::parse(r))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| anyhow::anyhow!("principal {name}: replicas: {e}"))?;
            principals.push(Arc::new(Principal {
                name,
                credential,
                tenants: doc.tenants,
                replicas,
            }));
        }
        Ok(Self { principals })
    }

    /// Reads and parses the auth file at `path`.
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading auth file {}", path.display()))?;
        let base = path.parent().unwrap_or(Path::new("."));
        Self::from_yaml(&text, base).with_context(|| format!("auth file {}", path.display()))
    }

    /// Number of principals.
    pub fn len(&self) -> usize {
        self.principals.len()
    }

    /// True without principals.
    pub fn is_empty(&self) -> bool {
        self.principals.is_empty()
    }

    /// The principal holding `token`, comparing digests in constant time.
    fn by_token(&self, token: &str) -> Option<Arc<Principal>> {
        let digest = sha256(token.as_bytes());
        let mut found = None;
        for p in &self.principals {
            if let Credential::Token(expected) = &p.credential
                && constant_time_eq(expected, &digest)
                && found.is_none()
            {
                found = Some(Arc::clone(p));
            }
        }
        found
    }

    /// The principal one of `identities` names.
    fn by_identity(&self, identities: &[String]) -> Option<Arc<Principal>> {
        self.principals
            .iter()
            .find(|p| matches!(&p.credential, Credential::Identity(id) if identities.contains(id)))
            .cloned()
    }
}

fn sha256(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

fn parse_sha256(hex: &str) -> anyhow::Result<[u8; 32]> {
    let hex = hex.trim();
    anyhow::ensure!(hex.len() == 64, "expected 64 hex digits");
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        let pair = hex.get(2 * i..2 * i + 2).context("not hex")?;
        *byte = u8::from_str_radix(pair, 16).context("not hex")?;
    }
    Ok(out)
}

fn constant_time_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Why a call is refused: the gRPC code and the metric reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    /// `UNAUTHENTICATED` or `PERMISSION_DENIED`.
    pub code: Code,
    /// Metric label: `no_credentials`, `bad_token`, `unknown_identity`,
    /// `non_loopback_peer`, `tenant`, `replica`.
    pub reason: &'static str,
}

impl Refusal {
    const fn unauthenticated(reason: &'static str) -> Self {
        Self {
            code: Code::Unauthenticated,
            reason,
        }
    }

    const fn denied(reason: &'static str) -> Self {
        Self {
            code: Code::PermissionDenied,
            reason,
        }
    }

    /// The refusal as a gRPC status.
    pub fn status(self, what: &str) -> tonic::Status {
        tonic::Status::new(self.code, format!("{what}: refused ({})", self.reason))
    }
}

/// Who is calling, once authenticated.
#[derive(Debug, Clone)]
pub enum Caller {
    /// No auth file: every tenant is open.
    Open,
    /// An authenticated principal.
    Principal(Arc<Principal>),
}

impl Caller {
    /// May the caller read `tenant`?
    pub fn may_read(&self, tenant: &str) -> bool {
        match self {
            Self::Open => true,
            Self::Principal(p) => p.has_tenant(tenant),
        }
    }

    /// May the caller write `tenant`'s entries for each of `replicas`?
    pub fn may_write<'a>(
        &self,
        tenant: &str,
        replicas: impl IntoIterator<Item = &'a str>,
    ) -> Result<(), Refusal> {
        let Self::Principal(p) = self else {
            return Ok(());
        };
        if !p.has_tenant(tenant) || (tenant.is_empty() && !p.has_tenant("*")) {
            return Err(Refusal::denied("tenant"));
        }
        for replica in replicas {
            if !p.has_replica(replica) {
                return Err(Refusal::denied("replica"));
            }
        }
        Ok(())
    }
}

/// What a caller presented.
#[derive(Debug, Default, Clone)]
pub struct Credentials {
    /// Bearer token from `authorization`.
    pub token: Option<String>,
    /// SAN URIs, DNS SANs and CN of the client's leaf certificate.
    pub identities: Vec<String>,
    /// The peer's socket address.
    pub peer: Option<SocketAddr>,
}

impl Credentials {
    /// Reads the token, the client certificate identities and the peer address of a request.
    pub fn of<T>(request: &tonic::Request<T>) -> Self {
        let token = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                let (scheme, token) = (v.get(..BEARER.len())?, v.get(BEARER.len()..)?);
                scheme
                    .eq_ignore_ascii_case(BEARER)
                    .then(|| token.trim().to_owned())
            });
        let identities = request
            .peer_certs()
            .and_then(|certs| {
                certs
                    .first()
                    .map(|leaf| certificate_identities(leaf.as_ref()))
            })
            .unwrap_or_default();
        Self {
            token,
            identities,
            peer: request.remote_addr(),
        }
    }
}

/// SAN URIs, DNS SANs and subject common names of a DER certificate.
pub fn certificate_identities(der: &[u8]) -> Vec<String> {
    use x509_parser::prelude::{FromDer as _, GeneralName, X509Certificate};
    let Ok((_, cert)) = X509Certificate::from_der(der) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for name in &san.value.general_names {
            match name {
                GeneralName::URI(uri) => out.push((*uri).to_owned()),
                GeneralName::DNSName(dns) => out.push((*dns).to_owned()),
                _ => {}
            }
        }
    }
    for cn in cert.subject().iter_common_name() {
        if let Ok(cn) = cn.as_str() {
            out.push(cn.to_owned());
        }
    }
    out
}

/// True when an unauthenticated producer call from `peer` is accepted:
/// loopback peers always, others only with `--allow-unauthenticated-producers`.
pub fn unauthenticated_producer_allowed(peer: Option<SocketAddr>, allow: bool) -> bool {
    allow || peer.is_some_and(|a| is_loopback(a.ip()))
}

fn is_loopback(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_loopback(),
        IpAddr::V6(v6) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
    }
}

/// The auth policy in force: the auth file (re-read on change) or none.
pub struct Authorizer {
    config: Option<ArcSwap<AuthConfig>>,
    path: Option<PathBuf>,
    allow_unauthenticated_producers: bool,
}

impl Authorizer {
    /// Loads `path` (if any); a bad file fails start-up.
    pub fn new(
        path: Option<PathBuf>,
        allow_unauthenticated_producers: bool,
    ) -> anyhow::Result<Self> {
        let config = match &path {
            Some(path) => {
                let config = AuthConfig::load(path)?;
                tracing::info!(path = %path.display(), principals = config.len(), "auth file loaded");
                Some(ArcSwap::from_pointee(config))
            }
            None => None,
        };
        Ok(Self {
            config,
            path,
            allow_unauthenticated_producers,
        })
    }

    /// An authorizer over an already parsed config (tests).
    pub fn with_config(config: Option<AuthConfig>, allow_unauthenticated_producers: bool) -> Self {
        Self {
            config: config.map(ArcSwap::from_pointee),
            path: None,
            allow_unauthenticated_producers,
        }
    }

    /// True when an auth file is configured.
    pub fn enabled(&self) -> bool {
        self.config.is_some()
    }

    /// Re-reads the auth file; a bad edit is logged and the current one kept.
    pub fn reload(&self) -> bool {
        let (Some(path), Some(config)) = (&self.path, &self.config) else {
            return false;
        };
        match AuthConfig::load(path) {
            Ok(fresh) => {
                tracing::info!(path = %path.display(), principals = fresh.len(), "auth file reloaded");
                config.store(Arc::new(fresh));
                true
            }
            Err(error) => {
                tracing::error!(path = %path.display(), "auth file reload failed, keeping the last good one: {error:#}");
                false
            }
        }
    }

    /// Starts the auth file reloader; it stops with `shutdown`.
    pub fn spawn_background(self: &Arc<Self>, shutdown: tokio_util::sync::CancellationToken) {
        if let Some(path) = self.path.clone() {
            let state = Arc::clone(self);
            crate::reload::spawn_reloader(path, "auth file", shutdown, move || {
                state.reload();
            });
        }
    }

    /// Identifies a consumer (lookups, GetCacheState).
    pub fn consumer(&self, credentials: &Credentials) -> Result<Caller, Refusal> {
        match &self.config {
            None => Ok(Caller::Open),
            Some(config) => authenticate(&config.load(), credentials),
        }
    }

    /// Identifies a producer (ReportCacheState, PublishEvent).
    pub fn producer(&self, credentials: &Credentials) -> Result<Caller, Refusal> {
        match &self.config {
            None if unauthenticated_producer_allowed(
                credentials.peer,
                self.allow_unauthenticated_producers,
            ) =>
            {
                Ok(Caller::Open)
            }
            None => Err(Refusal::denied("non_loopback_peer")),
            Some(config) => authenticate(&config.load(), credentials),
        }
    }
}

fn authenticate(config: &AuthConfig, credentials: &Credentials) -> Result<Caller, Refusal> {
    if let Some(token) = &credentials.token {
        return config
            .by_token(token)
            .map(Caller::Principal)
            .ok_or(Refusal::unauthenticated("bad_token"));
    }
    if !credentials.identities.is_empty() {
        return config
            .by_identity(&credentials.identities)
            .map(Caller::Principal)
            .ok_or(Refusal::unauthenticated("unknown_identity"));
    }
    Err(Refusal::unauthenticated("no_credentials"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> AuthConfig {
        let hex: String = sha256(b"s3cret")
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let yaml = format!(
            "principals:\n\
             - {{name: a, tokenSha256: {hex}, tenants: [team-a], replicas: [\"10.0.0.0/8\", r1]}}\n\
             - {{name: b, identity: \"spiffe://cluster.local/ns/b/sa/vllm\", tenants: [team-b], replicas: [\"*\"]}}\n\
             - {{name: g, identity: gateway.example, tenants: [\"*\"]}}\n"
        );
        AuthConfig::from_yaml(&yaml, Path::new(".")).expect("valid auth file")
    }

    fn token(t: &str) -> Credentials {
        Credentials {
            token: Some(t.into()),
            ..Default::default()
        }
    }

    #[test]
    fn tokens_and_identities_map_to_grants() {
        let auth = Authorizer::with_config(Some(config()), false);
        let a = auth.producer(&token("s3cret")).expect("token a");
        assert!(a.may_write("team-a", ["10.1.2.3:8000", "r1"]).is_ok());
        assert_eq!(
            a.may_write("team-a", ["11.0.0.1:8000"])
                .map_err(|r| r.reason),
            Err("replica")
        );
        assert_eq!(
            a.may_write("team-b", ["r1"]).map_err(|r| r.reason),
            Err("tenant")
        );
        assert_eq!(a.may_write("", ["r1"]).map_err(|r| r.reason), Err("tenant"));
        assert!(a.may_read("team-a") && !a.may_read("team-b"));
        assert_eq!(
            auth.producer(&token("wrong"))
                .map(|_| ())
                .map_err(|r| r.reason),
            Err("bad_token")
        );
        assert_eq!(
            auth.producer(&Credentials::default())
                .map(|_| ())
                .map_err(|r| r.code),
            Err(Code::Unauthenticated)
        );
        let b = auth
            .producer(&Credentials {
                identities: vec!["x".into(), "spiffe://cluster.local/ns/b/sa/vllm".into()],
                ..Default::default()
            })
            .expect("identity b");
        assert!(b.may_write("team-b", ["anything"]).is_ok());
        let g = auth
            .consumer(&Credentials {
                identities: vec!["gateway.example".into()],
                ..Default::default()
            })
            .expect("gateway");
        assert!(g.may_read("team-z"));
        assert_eq!(
            g.may_write("team-z", ["r"]).map_err(|r| r.reason),
            Err("replica")
        );
    }

    #[test]
    fn unauthenticated_producers_only_from_loopback() {
        let peer = |s: &str| Some(s.parse::<SocketAddr>().expect("addr"));
        assert!(unauthenticated_producer_allowed(peer("127.0.0.1:5"), false));
        assert!(unauthenticated_producer_allowed(peer("127.3.2.1:5"), false));
        assert!(unauthenticated_producer_allowed(peer("[::1]:5"), false));
        assert!(unauthenticated_producer_allowed(
            peer("[::ffff:127.0.0.1]:5"),
            false
        ));
        assert!(!unauthenticated_producer_allowed(peer("10.0.0.7:5"), false));
        assert!(!unauthenticated_producer_allowed(
            peer("[2001:db8::1]:5"),
            false
        ));
        assert!(!unauthenticated_producer_allowed(None, false));
        assert!(unauthenticated_producer_allowed(peer("10.0.0.7:5"), true));
        let open = Authorizer::with_config(None, false);
        let remote = Credentials {
            peer: peer("10.0.0.7:5"),
            ..Default::default()
        };
        assert_eq!(
            open.producer(&remote).map(|_| ()).map_err(|r| r.reason),
            Err("non_loopback_peer")
        );
        assert!(matches!(open.consumer(&remote), Ok(Caller::Open)));
    }

    #[test]
    fn cidr_and_bad_files() {
        assert!(
            ReplicaRule::parse("10.0.0.0/8")
                .expect("cidr")
                .matches("10.255.0.1")
        );
        assert!(
            !ReplicaRule::parse("10.0.0.0/8")
                .expect("cidr")
                .matches("replica-10")
        );
        assert!(
            ReplicaRule::parse("fd00::/8")
                .expect("cidr")
                .matches("[fd12::1]:8000")
        );
        assert!(
            ReplicaRule::parse("0.0.0.0/0")
                .expect("cidr")
                .matches("1.2.3.4:1")
        );
        assert!(ReplicaRule::parse("10.0.0.0/33").is_err());
        for bad in [
            "principals: [{name: x, tenants: [a]}]",
            "principals: [{name: x, tokenSha256: abc}]",
            "principals: [{name: x, identity: a, tokenSha256: abc}]",
            "principals: [{name: x, identity: a, color: red}]",
        ] {
            assert!(AuthConfig::from_yaml(bad, Path::new(".")).is_err(), "{bad}");
        }
    }
}
