//! Tracker tests: fingerprints, parent chaining, tiers, LoRA, capacity.

use std::collections::HashMap;
use std::sync::Arc;

use inference_cache_fingerprint::prefix_hashes;

use super::*;
use crate::event::{BlockRemoved, BlockStored, EngineHash, KvEvent};

fn tracker(offload_tier: bool) -> BlockTracker {
    let mut lora_names = HashMap::new();
    lora_names.insert(1, Arc::from("sql-lora"));
    BlockTracker::new(TrackerOptions {
        block_size: 4,
        offload_tier,
        lora_names,
        capacity: 1000,
    })
}

fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> BlockStored {
    BlockStored {
        block_hashes: hashes.iter().map(|h| EngineHash::Int(*h)).collect(),
        parent_block_hash: parent.map(EngineHash::Int),
        token_ids: tokens.to_vec(),
        block_size: 4,
        lora_id: None,
        medium: Some("GPU".into()),
        lora_name: None,
        cache_salt: None,
    }
}

fn removed(hashes: &[u64], medium: &str) -> KvEvent {
    KvEvent::Removed(BlockRemoved {
        block_hashes: hashes.iter().map(|h| EngineHash::Int(*h)).collect(),
        medium: Some(medium.into()),
    })
}

fn apply(t: &mut BlockTracker, metrics: &Metrics, event: KvEvent) -> Vec<Action> {
    let mut out = Vec::new();
    t.apply(event, metrics, &mut out);
    out
}

fn store(adapter: &str, tier: Tier, fingerprints: Vec<u64>) -> Action {
    Action::Store {
        adapter: Arc::from(adapter),
        tier,
        fingerprints,
    }
}

fn evict(adapter: &str, fingerprints: Vec<u64>) -> Action {
    Action::Evict {
        adapter: Arc::from(adapter),
        fingerprints,
    }
}

#[test]
fn stored_blocks_get_content_fingerprints_and_children_chain_from_parents() {
    let metrics = Metrics::new();
    let mut t = tracker(false);
    let tokens: Vec<u32> = (0..16).collect();
    let expected = prefix_hashes(&tokens, 4);

    let first = apply(
        &mut t,
        &metrics,
        KvEvent::Stored(stored(&[10, 11], None, &tokens[..8])),
    );
    assert_eq!(first, vec![store("", Tier::T1, expected[..2].to_vec())]);
    // The suffix event names block 11 as its parent: same fingerprints as a
    // one-shot fingerprint of the whole prompt.
    let second = apply(
        &mut t,
        &metrics,
        KvEvent::Stored(stored(&[12, 13], Some(11), &tokens[8..])),
    );
    assert_eq!(second, vec![store("", Tier::T1, expected[2..].to_vec())]);
    assert_eq!(t.len(), 4);
}

#[test]
fn unknown_parent_drops_the_event() {
    let metrics = Metrics::new();
    let mut t = tracker(false);
    let out = apply(
        &mut t,
        &metrics,
        KvEvent::Stored(stored(&[12], Some(99), &[1, 2, 3, 4])),
    );
    assert!(out.is_empty());
    assert_eq!(metrics.dropped_unknown_parent.get(), 1);
    assert_eq!(t.len(), 0);
}

#[test]
fn removal_evicts_under_the_blocks_adapter_and_forgets_it() {
    let metrics = Metrics::new();
    let mut t = tracker(false);
    let tokens: Vec<u32> = (0..8).collect();
    let fps = prefix_hashes(&tokens, 4);
    apply(
        &mut t,
        &metrics,
        KvEvent::Stored(stored(&[1, 2], None, &tokens)),
    );
    let out = apply(&mut t, &metrics, removed(&[2, 1, 77], "GPU"));
    assert_eq!(out, vec![evict("", vec![fps[1], fps[0]])]);
    assert_eq!(metrics.removals_unknown.get(), 1);
    assert_eq!(t.len(), 0);
}

#[test]
fn offload_tier_turns_gpu_eviction_into_a_t2_report() {
    let metrics = Metrics::new();
    let mut t = tracker(true);
    let tokens: Vec<u32> = (0..4).collect();
    let fp = prefix_hashes(&tokens, 4)[0];
    apply(
        &mut t,
        &metrics,
        KvEvent::Stored(stored(&[1], None, &tokens)),
    );
    let out = apply(&mut t, &metrics, removed(&[1], "GPU"));
    assert_eq!(out, vec![store("", Tier::T2, vec![fp])]);
    assert_eq!(metrics.tier2_rereports.get(), 1);
    // Still tracked: a later re-store goes back to T1, a CPU removal evicts.
    assert_eq!(t.len(), 1);
    let out = apply(&mut t, &metrics, removed(&[1], "CPU"));
    assert_eq!(out, vec![evict("", vec![fp])]);
}

#[test]
fn medium_cpu_events_are_t2_and_cpu_copies_survive_gpu_eviction() {
    let metrics = Metrics::new();
    let mut t = tracker(false);
    let tokens: Vec<u32> = (0..8).collect();
    let fps = prefix_hashes(&tokens, 4);
    // Block 1 lands on GPU, both then get a CPU copy.
    apply(
        &mut t,
        &metrics,
        KvEvent::Stored(stored(&[1], None, &tokens[..4])),
    );
    let mut cpu = stored(&[1, 2], None, &tokens);
    cpu.medium = Some("CPU".into());
    let out = apply(&mut t, &metrics, KvEvent::Stored(cpu));
    // Block 1 is on the device already (stays T1); block 2 is only offloaded.
    assert_eq!(out, vec![store("", Tier::T2, vec![fps[1]])]);
    // GPU eviction of block 1: its CPU copy remains → T2.
    let out = apply(&mut t, &metrics, removed(&[1], "GPU"));
    assert_eq!(out, vec![store("", Tier::T2, vec![fps[0]])]);
    // CPU eviction of both: gone everywhere.
    let out = apply(&mut t, &metrics, removed(&[1, 2], "CPU"));
    assert_eq!(out, vec![evict("", vec![fps[0], fps[1]])]);
}

#[test]
fn lora_name_wins_then_the_id_map_and_unmapped_ids_are_dropped() {
    let metrics = Metrics::new();
    let mut t = tracker(false);
    let tokens: Vec<u32> = (0..4).collect();
    let fp = prefix_hashes(&tokens, 4)[0];

    let mut named = stored(&[1], None, &tokens);
    named.lora_id = Some(7);
    named.lora_name = Some("chat-lora".into());
    let out = apply(&mut t, &metrics, KvEvent::Stored(named));
    assert_eq!(out, vec![store("chat-lora", Tier::T1, vec![fp])]);

    let mut mapped = stored(&[2], None, &tokens);
    mapped.lora_id = Some(1);
    let out = apply(&mut t, &metrics, KvEvent::Stored(mapped));
    assert_eq!(out, vec![store("sql-lora", Tier::T1, vec![fp])]);

    let mut unmapped = stored(&[3], None, &tokens);
    unmapped.lora_id = Some(2);
    let out = apply(&mut t, &metrics, KvEvent::Stored(unmapped));
    assert!(out.is_empty());
    assert_eq!(metrics.dropped_unmapped_lora.get(), 1);

    // Removals are narrowed to the block's adapter.
    let out = apply(&mut t, &metrics, removed(&[2], "GPU"));
    assert_eq!(out, vec![evict("sql-lora", vec![fp])]);
}

#[test]
fn clear_resets_and_mismatches_are_counted() {
    let metrics = Metrics::new();
    let mut t = tracker(false);
    let tokens: Vec<u32> = (0..8).collect();
    apply(
        &mut t,
        &metrics,
        KvEvent::Stored(stored(&[1, 2], None, &tokens)),
    );
    assert_eq!(
        apply(&mut t, &metrics, KvEvent::AllCleared),
        vec![Action::Clear]
    );
    assert_eq!(t.len(), 0);

    let mut wrong_size = stored(&[1], None, &tokens);
    wrong_size.block_size = 8;
    assert!(apply(&mut t, &metrics, KvEvent::Stored(wrong_size)).is_empty());
    assert_eq!(metrics.dropped_block_size.get(), 1);
    let mismatches = metrics.config_check.mismatches();
    assert_eq!(mismatches.len(), 1);
    assert_eq!(mismatches[0].0, "event_block_size");
    assert!(
        mismatches[0].1.contains("block_size 8"),
        "{}",
        mismatches[0].1
    );

    // Two hashes but tokens for one block and a half: one block reported.
    let out = apply(
        &mut t,
        &metrics,
        KvEvent::Stored(stored(&[1, 2], None, &tokens[..6])),
    );
    assert_eq!(
        out,
        vec![store("", Tier::T1, prefix_hashes(&tokens[..4], 4))]
    );
    assert_eq!(metrics.dropped_token_mismatch.get(), 1);
}

#[test]
fn capacity_forgets_the_oldest_hashes() {
    let metrics = Metrics::new();
    let mut t = BlockTracker::new(TrackerOptions {
        block_size: 4,
        offload_tier: false,
        lora_names: HashMap::new(),
        capacity: 3,
    });
    for h in 0..10u64 {
        let tokens: Vec<u32> = (0..4).map(|i| i + h as u32 * 4).collect();
        apply(
            &mut t,
            &metrics,
            KvEvent::Stored(stored(&[h], None, &tokens)),
        );
    }
    assert_eq!(t.len(), 3);
    // The newest survive; the oldest are unknown now.
    assert!(apply(&mut t, &metrics, removed(&[0], "GPU")).is_empty());
    assert_eq!(apply(&mut t, &metrics, removed(&[9], "GPU")).len(), 1);
}

#[test]
fn snapshot_lists_held_blocks_by_adapter_and_tier() {
    let metrics = Metrics::new();
    let mut t = tracker(true);
    let tokens: Vec<u32> = (0..12).collect();
    let fps = prefix_hashes(&tokens, 4);
    apply(
        &mut t,
        &metrics,
        KvEvent::Stored(stored(&[1, 2, 3], None, &tokens)),
    );
    apply(&mut t, &metrics, removed(&[3], "GPU"));
    let mut out = Vec::new();
    t.snapshot(&mut out);
    let mut t1: Vec<u64> = Vec::new();
    let mut t2: Vec<u64> = Vec::new();
    for action in out {
        match action {
            Action::Store {
                tier: Tier::T1,
                fingerprints,
                ..
            } => t1.extend(fingerprints),
            Action::Store {
                tier: Tier::T2,
                fingerprints,
                ..
            } => t2.extend(fingerprints),
            other => panic!("unexpected {other:?}"),
        }
    }
    t1.sort_unstable();
    let mut want = fps[..2].to_vec();
    want.sort_unstable();
    assert_eq!(t1, want);
    assert_eq!(t2, vec![fps[2]]);
}

fn salted(hashes: &[u64], parent: Option<u64>, tokens: &[u32], salt: Option<&str>) -> KvEvent {
    KvEvent::Stored(BlockStored {
        cache_salt: salt.map(Into::into),
        ..stored(hashes, parent, tokens)
    })
}

#[test]
fn salted_blocks_live_in_the_salt_partition_and_children_inherit_it() {
    use inference_cache_fingerprint::partition_key;
    let metrics = Metrics::new();
    let mut t = tracker(false);
    let tokens: Vec<u32> = (0..16).collect();
    let fps = prefix_hashes(&tokens, 4);
    let tenant_a = partition_key("", "tenant-a").into_owned();
    assert_ne!(tenant_a, "");

    // vLLM: the salt is on the request's first event (block 0) only.
    let first = apply(
        &mut t,
        &metrics,
        salted(&[10, 11], None, &tokens[..8], Some("tenant-a")),
    );
    assert_eq!(first, vec![store(&tenant_a, Tier::T1, fps[..2].to_vec())]);
    let child = apply(
        &mut t,
        &metrics,
        salted(&[12], Some(11), &tokens[8..12], None),
    );
    assert_eq!(child, vec![store(&tenant_a, Tier::T1, vec![fps[2]])]);
    let grandchild = apply(
        &mut t,
        &metrics,
        salted(&[13], Some(12), &tokens[12..], None),
    );
    assert_eq!(grandchild, vec![store(&tenant_a, Tier::T1, vec![fps[3]])]);

    // The same tokens unsalted (other engine hashes): same content
    // fingerprints, the unsalted partition, unchanged from before salts.
    let plain = apply(
        &mut t,
        &metrics,
        salted(&[20, 21], None, &tokens[..8], None),
    );
    assert_eq!(plain, vec![store("", Tier::T1, fps[..2].to_vec())]);
    let plain_child = apply(
        &mut t,
        &metrics,
        salted(&[22], Some(21), &tokens[8..12], None),
    );
    assert_eq!(plain_child, vec![store("", Tier::T1, vec![fps[2]])]);

    // Another salt is another partition.
    let tenant_b = partition_key("", "tenant-b").into_owned();
    let other = apply(
        &mut t,
        &metrics,
        salted(&[30], None, &tokens[..4], Some("tenant-b")),
    );
    assert_eq!(other, vec![store(&tenant_b, Tier::T1, vec![fps[0]])]);
    assert_ne!(tenant_a, tenant_b);

    // Removals name the partition the blocks were stored under.
    let gone = apply(&mut t, &metrics, removed(&[12, 22, 30], "GPU"));
    assert_eq!(
        gone,
        vec![
            evict(&tenant_a, vec![fps[2]]),
            evict("", vec![fps[2]]),
            evict(&tenant_b, vec![fps[0]]),
        ]
    );

    // A snapshot carries the partitions too.
    let mut out = Vec::new();
    t.snapshot(&mut out);
    let mut held: Vec<(String, u64)> = out
        .iter()
        .flat_map(|a| match a {
            Action::Store {
                adapter,
                fingerprints,
                ..
            } => fingerprints
                .iter()
                .map(|f| (adapter.to_string(), *f))
                .collect::<Vec<_>>(),
            _ => Vec::new(),
        })
        .collect();
    held.sort();
    let mut expected = vec![
        (tenant_a.clone(), fps[0]),
        (tenant_a.clone(), fps[1]),
        (tenant_a.clone(), fps[3]),
        (String::new(), fps[0]),
        (String::new(), fps[1]),
    ];
    expected.sort();
    assert_eq!(held, expected);
}

#[test]
fn salt_combines_with_the_adapter_and_an_explicit_salt_wins() {
    use inference_cache_fingerprint::partition_key;
    let metrics = Metrics::new();
    let mut t = tracker(true);
    let tokens: Vec<u32> = (0..8).collect();
    let fps = prefix_hashes(&tokens, 4);
    let lora_salted = partition_key("sql-lora", "s1").into_owned();
    assert!(lora_salted.starts_with("sql-lora"));

    let event = KvEvent::Stored(BlockStored {
        lora_name: Some("sql-lora".into()),
        cache_salt: Some("s1".into()),
        ..stored(&[1], None, &tokens[..4])
    });
    assert_eq!(
        apply(&mut t, &metrics, event),
        vec![store(&lora_salted, Tier::T1, vec![fps[0]])]
    );
    let child = KvEvent::Stored(BlockStored {
        lora_name: Some("sql-lora".into()),
        ..stored(&[2], Some(1), &tokens[4..])
    });
    assert_eq!(
        apply(&mut t, &metrics, child),
        vec![store(&lora_salted, Tier::T1, vec![fps[1]])]
    );
    // SGLang names the salt on every event; an explicit salt is used as is.
    let explicit = salted(&[3], Some(1), &tokens[4..], Some("s2"));
    assert_eq!(
        apply(&mut t, &metrics, explicit),
        vec![store(&partition_key("", "s2"), Tier::T1, vec![fps[1]])]
    );
    // An empty salt is no salt: the child inherits.
    let empty = KvEvent::Stored(BlockStored {
        lora_name: Some("sql-lora".into()),
        cache_salt: Some(String::new()),
        ..stored(&[4], Some(1), &tokens[4..])
    });
    assert_eq!(
        apply(&mut t, &metrics, empty),
        vec![store(&lora_salted, Tier::T1, vec![fps[1]])]
    );
    // With the offload tier a GPU eviction re-reports at T2, same partition.
    assert_eq!(
        apply(&mut t, &metrics, removed(&[2], "GPU")),
        vec![store(&lora_salted, Tier::T2, vec![fps[1]])]
    );
}
