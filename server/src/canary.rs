//! The canary: a periodic self-check that the server's tokenizer, fingerprint
//! and index agree on a known prompt.
//!
//! Every `--canary-interval` (default one minute; first right after start)
//! the server checks:
//!
//! 1. **fingerprint**: the construction still reproduces the contract's
//!    golden vectors (tokens 1..=16 and 0..=63, block 16);
//! 2. **index**: a chain ingested for one replica is found again by a
//!    lookup of the same chain — `PREFIX_MATCH` naming that replica with
//!    every block matched — under `--engine-block-size`;
//! 3. **tokenizer** (for each model the index serves and the server has a
//!    tokenizer for): [`CANARY_PROMPT`] tokenized as a gateway's
//!    `raw_prompt` is tokenized the same way twice, fills at least one
//!    block, and its chain round-trips through the index as in 2.
//!
//! The index leg uses a private, in-memory [`CacheIndex`] under the reserved
//! probe tenant's name, never the live index: the canary cannot add, evict
//! or credit a live entry, and nothing it does shows in `/snapshot` or
//! `GetCacheState`. A disagreement is logged (warn, with the failing leg),
//! counted (`inferencecache_canary_checks_total{result="fail"}`), drops
//! `inferencecache_canary_ok` to 0 and adds a `canary:` line to `/readyz`
//! (readiness itself is unaffected: hints fail open). The accuracy watch
//! ([`crate::accuracy_watch`]) turns a disagreement into its `canary` alert
//! at its next check.
//!
//! Cost: one tokenization per served model and a few hundred bytes of index
//! per minute.

use std::sync::Arc;
use std::time::{Duration, Instant};

use inference_cache_fingerprint::request_chain;
use inference_cache_index::{
    CacheIndex, CachePolicy, CacheUpdate, ChainInput, LookupRequest, PROBE_TENANT, PolicySet,
    PrefixReport, Ranker, Reason, SystemClock,
};
use tokio_util::sync::CancellationToken;

use crate::index_runtime::IndexState;
use crate::metrics::Metrics;
use crate::prompt_inputs::{PromptState, TextInput};

/// The known prompt (long enough to fill several blocks of any usual size).
pub const CANARY_PROMPT: &str = "inference-cache canary. The quick brown fox jumps over the \
    lazy dog while the cache index, the fingerprint and the tokenizer agree on every block of \
    this sentence; a disagreement means hints would point at replicas that do not hold the \
    prompt. One, two, three, four, five, six, seven, eight, nine, ten.";
/// Replica id the canary ingests under (in its private index).
const CANARY_REPLICA: &str = "inferencecache.io/canary";
/// Hash scheme of the canary's chains.
const CANARY_SCHEME: &str = "vllm";
/// Golden vectors of the contract: tokens 1..=16 in one block of 16.
const GOLDEN_ONE_BLOCK: u64 = 16_863_443_419_780_771_464;
/// Golden vectors of the contract: tokens 0..=63 in blocks of 16.
const GOLDEN_FOUR_BLOCKS: [u64; 4] = [
    15_310_707_395_893_867_146,
    13_769_157_705_258_532_664,
    11_879_827_756_109_914_528,
    3_888_788_807_566_526_800,
];

/// What one canary run found: empty when every leg agreed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CanaryReport {
    /// One line per disagreement, naming the leg (`fingerprint`, `index`, `tokenizer <model>`).
    pub failures: Vec<String>,
    /// Models whose tokenizer leg ran.
    pub models_checked: Vec<String>,
}

impl CanaryReport {
    /// True when every leg agreed.
    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }
}

fn hashes_as_u64(tokens: &[u32], block_size: usize) -> Vec<u64> {
    request_chain(tokens, block_size)
        .block_hashes
        .iter()
        .map(|hash| u64::from_be_bytes(*hash))
        .collect()
}

/// Leg 1: the fingerprint reproduces the golden vectors.
pub fn check_fingerprint() -> Result<(), String> {
    let one: Vec<u32> = (1..=16).collect();
    let four: Vec<u32> = (0..64).collect();
    let got_one = hashes_as_u64(&one, 16);
    let got_four = hashes_as_u64(&four, 16);
    if got_one != [GOLDEN_ONE_BLOCK] || got_four != GOLDEN_FOUR_BLOCKS {
        return Err(format!(
            "fingerprint: golden vectors not reproduced (got {got_one:?} and {got_four:?})"
        ));
    }
    Ok(())
}

/// Leg 2: `tokens`' chain, ingested for the canary replica in a private
/// index, is found again whole by a lookup of the same chain.
pub fn check_index(tokens: &[u32], block_size: usize, model: &str) -> Result<(), String> {
    let Some(chain) = crate::grpc::derived_chain(&request_chain(tokens, block_size)) else {
        return Err(format!(
            "index: {} tokens fill no block of {block_size}",
            tokens.len()
        ));
    };
    let index = CacheIndex::new(Arc::new(SystemClock), 1 << 16);
    index.set_policies(PolicySet::with_default(CachePolicy {
        ranker: Ranker::Contract,
        minimum_matched_tokens: 0,
        routing_floor_score: 0.0,
        ..CachePolicy::default()
    }));
    // The probe tenant's name is refused by the index at ingest; the private
    // index uses a name of its own under the same reserved prefix.
    let tenant = format!("{PROBE_TENANT}-canary");
    index.ingest(&CacheUpdate {
        replica_id: CANARY_REPLICA.into(),
        tenant_id: tenant.clone(),
        model_id: model.into(),
        hash_scheme: CANARY_SCHEME.into(),
        prefixes: vec![PrefixReport {
            chain: chain.clone(),
            ..PrefixReport::default()
        }],
        ..CacheUpdate::default()
    });
    let mut request = LookupRequest::new(&tenant, model, CANARY_SCHEME);
    request.chain = ChainInput::Derived(&chain);
    request.arrived = Instant::now();
    let outcome = index.lookup(&request);
    let expected = chain.token_total(0, chain.len());
    let top = outcome.top();
    let agrees = outcome.reason == Reason::PrefixMatch
        && top.is_some_and(|(name, score)| {
            name == CANARY_REPLICA && i64::from(score.matched_tokens) == expected
        });
    if !agrees {
        return Err(format!(
            "index: a {}-block chain ingested for one replica looked up as {} with {:?} matched tokens (expected PREFIX_MATCH with {expected})",
            chain.len(),
            outcome.reason.as_str(),
            top.map(|(_, score)| score.matched_tokens),
        ));
    }
    Ok(())
}

/// Runs every leg once.
pub async fn run_once(prompts: &PromptState, index: &IndexState) -> CanaryReport {
    let mut report = CanaryReport::default();
    let block_size = index.engine_block_size;
    if let Err(failure) = check_fingerprint() {
        report.failures.push(failure);
    }
    let fixed: Vec<u32> = (0..u32::try_from(block_size * 4).unwrap_or(u32::MAX)).collect();
    if let Err(failure) = check_index(&fixed, block_size, "canary") {
        report.failures.push(failure);
    }
    let live = Arc::clone(&index.index);
    let models = tokio::task::spawn_blocking(move || {
        let mut models: Vec<String> = live
            .snapshot()
            .tenants
            .into_iter()
            .flat_map(|tenant| tenant.models)
            .collect();
        models.sort();
        models.dedup();
        models
    })
    .await
    .unwrap_or_default();
    for model in models {
        if !prompts.has_tokenizer(&model) {
            continue;
        }
        report.models_checked.push(model.clone());
        if let Err(failure) = check_tokenizer(prompts, &model, block_size).await {
            report.failures.push(failure);
        }
    }
    report
}

/// Leg 3 for one model.
async fn check_tokenizer(
    prompts: &PromptState,
    model: &str,
    block_size: usize,
) -> Result<(), String> {
    let mut runs = Vec::with_capacity(2);
    for _ in 0..2 {
        let input = TextInput::RawPrompt(CANARY_PROMPT.to_owned());
        match prompts.tokenize(model, input, None, None).await {
            Ok(ids) => runs.push(ids),
            Err(error) => return Err(format!("tokenizer {model}: {error}")),
        }
    }
    if runs[0] != runs[1] {
        return Err(format!(
            "tokenizer {model}: the known prompt tokenized differently twice ({} vs {} tokens)",
            runs[0].len(),
            runs[1].len()
        ));
    }
    check_index(&runs[0], block_size, model)
        .map_err(|failure| format!("tokenizer {model}: {failure}"))
}

/// Runs the canary every `interval` (`--canary-interval`; the first run at
/// once) until `shutdown`, recording each result in `metrics`.
pub fn spawn(
    prompts: Arc<PromptState>,
    index: Arc<IndexState>,
    metrics: Arc<Metrics>,
    interval: Duration,
    shutdown: CancellationToken,
) {
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(interval);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = ticks.tick() => {}
            }
            let report = run_once(&prompts, &index).await;
            if !report.passed() {
                tracing::warn!(
                    failures = %report.failures.join("; "),
                    "canary: the tokenizer, fingerprint and index disagree; hints may point at replicas that do not hold the prompt"
                );
            }
            metrics.record_canary(&report);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprint_leg_passes_on_the_contract_construction() {
        assert_eq!(check_fingerprint(), Ok(()));
    }

    #[test]
    fn index_leg_round_trips_a_chain_and_rejects_a_short_prompt() {
        let tokens: Vec<u32> = (0..64).collect();
        assert_eq!(check_index(&tokens, 16, "m"), Ok(()));
        assert_eq!(check_index(&tokens, 1, "m"), Ok(()));
        let failure = check_index(&tokens[..8], 16, "m").expect_err("no full block");
        assert!(failure.starts_with("index: 8 tokens"), "{failure}");
    }

    /// The tokenizer leg on a real tokenizer (`scripts/setup-tokenizers.sh`
    /// fetches it), for a model the live index serves.
    #[tokio::test]
    async fn tokenizer_leg_runs_for_served_models_with_a_tokenizer() {
        let qwen3 =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../.cache/tokenizers/qwen3");
        assert!(
            qwen3.join("tokenizer.json").is_file(),
            "tokenizer files missing under {}: run scripts/setup-tokenizers.sh",
            qwen3.display()
        );
        let models = tempfile::tempdir().expect("temp dir");
        std::os::unix::fs::symlink(&qwen3, models.path().join("qwen3")).expect("symlink");
        let mut registry = prometheus_client::registry::Registry::default();
        let index =
            IndexState::new(&crate::IndexSettings::default(), &mut registry).expect("index");
        let prompts = PromptState::new(
            &crate::PromptSettings {
                tokenizer_models_dir: Some(models.path().to_path_buf()),
                templates_dir: None,
                ..Default::default()
            },
            2,
            &mut registry,
        )
        .expect("prompts");
        // Nothing served yet: only the fingerprint and index legs run.
        let report = run_once(&prompts, &index).await;
        assert!(report.passed(), "{report:?}");
        assert!(report.models_checked.is_empty());
        for model in ["qwen3", "no-tokenizer"] {
            let tokens: Vec<u32> = (0..32).collect();
            let chain = request_chain(&tokens, 16);
            index.index.ingest(&CacheUpdate {
                replica_id: "r1".into(),
                tenant_id: "t".into(),
                model_id: model.into(),
                hash_scheme: "vllm".into(),
                prefixes: vec![PrefixReport {
                    chain: crate::grpc::derived_chain(&chain).expect("two blocks"),
                    ..PrefixReport::default()
                }],
                ..CacheUpdate::default()
            });
        }
        let report = run_once(&prompts, &index).await;
        assert!(report.passed(), "{report:?}");
        assert_eq!(report.models_checked, ["qwen3"]);
        // A prompt too short for one block is reported against its leg.
        let failure = check_tokenizer(&prompts, "qwen3", 100_000)
            .await
            .expect_err("no full block");
        assert!(failure.starts_with("tokenizer qwen3: index:"), "{failure}");
    }

    #[test]
    fn reports_pass_only_without_failures() {
        assert!(CanaryReport::default().passed());
        let failed = CanaryReport {
            failures: vec!["index: x".into()],
            models_checked: Vec::new(),
        };
        assert!(!failed.passed());
    }
}
