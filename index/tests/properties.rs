//! Property tests of the chain matcher over random holdings.
//!
//! Each case gives up to six replicas a random subset of a 12-block chain and
//! asks for a random prefix of it; the properties are checked against a
//! straightforward model of the longest-leading-run rule.

use std::sync::Arc;

use inference_cache_index::{
    BlockHashes, CacheIndex, CacheUpdate, Chain, LookupRequest, ManualClock, PolicySet,
    PrefixReport, Reason,
};
use proptest::prelude::*;

const OPEN_POLICY: &str = "apiVersion: inferencecache.io/v1alpha1\nkind: CachePolicy\n\
metadata: {name: open, namespace: \"*\"}\nspec: {minimumMatchedTokens: 0, routingFloorScore: \"0\", affinityRouting: Disabled}\n";

fn build(holdings: &[Vec<bool>], counts: &[i32]) -> (CacheIndex, Vec<Vec<u8>>) {
    let index = CacheIndex::new(Arc::new(ManualClock::default()), 1_000_000);
    index.set_policies(PolicySet::from_yaml(OPEN_POLICY).expect("policy"));
    let blocks: Vec<Vec<u8>> = (0..counts.len() as u64)
        .map(|i| (0xABCD_0000 + i).to_be_bytes().to_vec())
        .collect();
    for (r, held) in holdings.iter().enumerate() {
        let mut prefix = PrefixReport::default();
        for (i, &h) in held.iter().enumerate() {
            if h {
                prefix.block_hashes.push(blocks[i].clone());
                prefix.block_token_counts.push(counts[i]);
            }
        }
        index.ingest(&CacheUpdate {
            replica_id: format!("r{r}"),
            tenant_id: "t".into(),
            model_id: "m".into(),
            hash_scheme: "vllm".into(),
            prefixes: vec![prefix],
            ..Default::default()
        });
    }
    (index, blocks)
}

proptest! {
    #[test]
    fn chain_lookup_respects_leading_run(
        holdings in prop::collection::vec(prop::collection::vec(any::<bool>(), 12), 1..6),
        counts in prop::collection::vec(1i32..200, 12),
        asked in 1usize..=12,
    ) {
        let (index, blocks) = build(&holdings, &counts);
        let mut request = LookupRequest::new("t", "m", "vllm");
        request.chain = Some(Chain { hashes: BlockHashes::Bytes(&blocks[..asked]), token_counts: &counts[..asked] });
        let outcome = index.lookup(&request);
        for score in &outcome.scores {
            let r: usize = score.replica_id[1..].parse().expect("replica index");
            // Never a replica lacking block 0.
            prop_assert!(holdings[r][0], "{} lacks block 0", score.replica_id);
            // matched_tokens is the sum of the counts of the leading run.
            let run = holdings[r][..asked].iter().take_while(|&&h| h).count();
            let expected: i32 = counts[..run].iter().sum();
            prop_assert_eq!(score.matched_tokens, expected);
        }
        let any_block0 = holdings.iter().any(|h| h[0]);
        if outcome.reason == Reason::PrefixMatch {
            prop_assert!(any_block0);
            let mut holders: Vec<String> = holdings.iter().enumerate().filter(|(_, h)| h[0]).map(|(i, _)| format!("r{i}")).collect();
            let mut returned: Vec<String> = outcome.scores.iter().map(|s| s.replica_id.to_string()).collect();
            holders.sort();
            returned.sort();
            prop_assert_eq!(returned, holders);
            for pair in outcome.scores.windows(2) {
                prop_assert!(pair[0].score >= pair[1].score);
            }
        }
    }
}
