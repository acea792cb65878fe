//! Decoder tests over payloads written by `tests/kv_publisher.py fixtures`
//! (the same encoder the end-to-end publisher uses) and hand-built bytes.

use super::*;
use crate::event::{BlockRemoved, BlockStored, EngineHash, KvEvent};

const ARRAY_STORED_INT: &[u8] = include_bytes!("../../tests/fixtures/array_stored_int.msgpack");
const ARRAY_SIGNED_PARENT: &[u8] =
    include_bytes!("../../tests/fixtures/array_stored_signed_parent.msgpack");
const ARRAY_MIXED_TRAILING: &[u8] =
    include_bytes!("../../tests/fixtures/array_mixed_trailing.msgpack");
const MAP_STORED_REMOVED: &[u8] = include_bytes!("../../tests/fixtures/map_stored_removed.msgpack");

fn tokens_1_to_32() -> Vec<u32> {
    (1..=32).collect()
}

#[test]
fn array_layout_with_int_hashes() {
    let batch = decode_batch(ARRAY_STORED_INT).expect("decodes");
    assert_eq!(batch.ts, 1_700_000_000.25);
    assert_eq!(batch.data_parallel_rank, None);
    assert_eq!(batch.skipped_events, 0);
    assert_eq!(
        batch.events,
        vec![KvEvent::Stored(BlockStored {
            block_hashes: vec![EngineHash::Int(1001), EngineHash::Int(1002)],
            parent_block_hash: None,
            token_ids: tokens_1_to_32(),
            block_size: 16,
            lora_id: None,
            medium: Some("GPU".into()),
            lora_name: None,
            cache_salt: None,
        })]
    );
}

#[test]
fn signed_and_unsigned_forms_of_the_same_bits_are_one_hash() {
    let batch = decode_batch(ARRAY_SIGNED_PARENT).expect("decodes");
    assert_eq!(batch.data_parallel_rank, Some(1));
    let KvEvent::Stored(stored) = &batch.events[0] else {
        panic!("expected BlockStored, got {:?}", batch.events[0]);
    };
    assert_eq!(
        stored.block_hashes,
        vec![
            EngineHash::Int((-5i64).cast_unsigned()),
            EngineHash::Int(u64::MAX)
        ]
    );
    assert_eq!(stored.parent_block_hash, Some(EngineHash::Int(u64::MAX)));
    assert_eq!(stored.lora_id, Some(2));
    assert_eq!(stored.medium.as_deref(), Some("CPU"));
    assert_eq!(stored.lora_name.as_deref(), Some("sql-lora"));
}

#[test]
fn bytes_hashes_trailing_fields_and_unknown_events() {
    let batch = decode_batch(ARRAY_MIXED_TRAILING).expect("decodes");
    let hash = EngineHash::Bytes(vec![0xab; 32].into_boxed_slice());
    assert_eq!(batch.skipped_events, 1, "the unknown event type is skipped");
    assert_eq!(batch.events.len(), 3);
    assert_eq!(
        batch.events[0],
        KvEvent::Stored(BlockStored {
            block_hashes: vec![hash.clone()],
            parent_block_hash: None,
            token_ids: (0..16).collect(),
            block_size: 16,
            lora_id: None,
            medium: None,
            lora_name: Some("x".into()),
            cache_salt: None,
        })
    );
    assert_eq!(
        batch.events[1],
        KvEvent::Removed(BlockRemoved {
            block_hashes: vec![hash],
            medium: Some("GPU".into()),
        })
    );
    assert_eq!(batch.events[2], KvEvent::AllCleared);
}

#[test]
fn map_layout_with_unknown_keys() {
    let batch = decode_batch(MAP_STORED_REMOVED).expect("decodes");
    assert_eq!(batch.data_parallel_rank, Some(0));
    assert_eq!(batch.skipped_events, 0);
    assert_eq!(
        batch.events,
        vec![
            KvEvent::Stored(BlockStored {
                block_hashes: vec![EngineHash::Int(1001), EngineHash::Int(1002)],
                parent_block_hash: Some(EngineHash::Int(7)),
                token_ids: tokens_1_to_32(),
                block_size: 16,
                lora_id: Some(1),
                medium: Some("GPU".into()),
                lora_name: Some("chat-lora".into()),
                cache_salt: None,
            }),
            KvEvent::Removed(BlockRemoved {
                block_hashes: vec![EngineHash::Int(1001)],
                medium: Some("cpu".into()),
            }),
            KvEvent::AllCleared,
        ]
    );
}

fn encode(value: &rmpv::Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, value).expect("encode");
    out
}

#[test]
fn minimal_old_layout_without_lora_and_medium() {
    use rmpv::Value;
    let event = Value::Array(vec![
        Value::from("BlockStored"),
        Value::Array(vec![Value::from(9u64)]),
        Value::Nil,
        Value::Array((0..16u32).map(Value::from).collect()),
        Value::from(16u32),
    ]);
    let batch = Value::Array(vec![Value::from(1.0f64), Value::Array(vec![event])]);
    let decoded = decode_batch(&encode(&batch)).expect("decodes");
    let KvEvent::Stored(stored) = &decoded.events[0] else {
        panic!("expected BlockStored");
    };
    assert_eq!(stored.lora_id, None);
    assert_eq!(stored.medium, None);
    assert_eq!(stored.block_hashes, vec![EngineHash::Int(9)]);
}

#[test]
fn malformed_payloads_are_errors_and_bad_events_are_skipped() {
    use rmpv::Value;
    assert!(decode_batch(&[0xc1]).is_err(), "reserved marker byte");
    assert!(matches!(decode_batch(&[]), Err(DecodeError::Msgpack(_))));
    assert!(matches!(
        decode_batch(&encode(&Value::from(3))),
        Err(DecodeError::Shape(_))
    ));
    assert!(matches!(
        decode_batch(&encode(&Value::Array(vec![Value::from(1.0)]))),
        Err(DecodeError::Shape(_))
    ));
    let mut trailing = encode(&Value::Array(vec![Value::from(1.0), Value::Array(vec![])]));
    trailing.push(0);
    assert_eq!(decode_batch(&trailing), Err(DecodeError::TrailingBytes(1)));
    // Truncated real payload.
    let cut = &ARRAY_STORED_INT[..ARRAY_STORED_INT.len() - 3];
    assert!(decode_batch(cut).is_err());

    // A token id beyond u32, a string hash and a too-short event are skipped.
    let bad_token = Value::Array(vec![
        Value::from("BlockStored"),
        Value::Array(vec![Value::from(1)]),
        Value::Nil,
        Value::Array(vec![Value::from(u64::MAX)]),
        Value::from(16),
    ]);
    let bad_hash = Value::Array(vec![
        Value::from("BlockRemoved"),
        Value::Array(vec![Value::from("nope")]),
    ]);
    let short = Value::Array(vec![Value::from("BlockStored"), Value::Array(vec![])]);
    let good = Value::Array(vec![Value::from("AllBlocksCleared")]);
    let batch = Value::Array(vec![
        Value::from(2),
        Value::Array(vec![bad_token, bad_hash, short, good, Value::from(7)]),
    ]);
    let decoded = decode_batch(&encode(&batch)).expect("batch shape is fine");
    assert_eq!(decoded.skipped_events, 4);
    assert_eq!(decoded.events, vec![KvEvent::AllCleared]);
}

#[test]
fn batch_as_map_wide_tokens_and_skipped_extensions() {
    use rmpv::Value;
    let event = Value::Map(vec![
        (
            Value::from("block_hashes"),
            Value::Array(vec![Value::from(1)]),
        ),
        (Value::from("ext"), Value::Ext(5, vec![1, 2, 3])),
        (Value::from("type"), Value::from("BlockStored")),
        (Value::from("parent_block_hash"), Value::Nil),
        (
            Value::from("token_ids"),
            Value::Array(vec![
                Value::from(300u32),
                Value::from(70_000u32),
                Value::from(u32::MAX),
                Value::from(5u32),
            ]),
        ),
        (Value::from("block_size"), Value::from(4)),
        (
            Value::from("nested"),
            Value::Array(vec![Value::Map(vec![(Value::from("a"), Value::from(2.5))])]),
        ),
    ]);
    let batch = Value::Map(vec![
        (Value::from("ts"), Value::from(3.5f32)),
        (Value::from("events"), Value::Array(vec![event])),
        (Value::from("data_parallel_rank"), Value::from(3)),
        (Value::from("future"), Value::Binary(vec![0; 300])),
    ]);
    let decoded = decode_batch(&encode(&batch)).expect("decodes");
    assert_eq!(decoded.ts, 3.5);
    assert_eq!(decoded.data_parallel_rank, Some(3));
    let KvEvent::Stored(stored) = &decoded.events[0] else {
        panic!("expected BlockStored, got {:?}", decoded.events);
    };
    assert_eq!(stored.token_ids, vec![300, 70_000, u32::MAX, 5]);
    assert_eq!(stored.block_size, 4);
}

#[test]
fn truncations_and_corruptions_never_panic() {
    for fixture in [
        ARRAY_STORED_INT,
        ARRAY_SIGNED_PARENT,
        ARRAY_MIXED_TRAILING,
        MAP_STORED_REMOVED,
    ] {
        for cut in 0..fixture.len() {
            assert!(
                decode_batch(&fixture[..cut]).is_err(),
                "prefix {cut} accepted"
            );
        }
        // Deterministic byte corruptions: whatever comes out, no panic.
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..2000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let mut bytes = fixture.to_vec();
            let at = (state % bytes.len() as u64) as usize;
            bytes[at] = (state >> 32) as u8;
            let _ = decode_batch(&bytes);
        }
    }
    // Deep nesting inside an unknown field is rejected, not recursed into.
    let mut deep = vec![0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x92, 0xa1, b'X'];
    deep.extend(std::iter::repeat_n(0x91, 10_000));
    deep.push(0xc0);
    let decoded = decode_batch(&deep);
    assert!(decoded.is_err(), "{decoded:?}");
}

/// A vLLM ≤ 0.23 tagged-array `BlockStored` with `extra_keys` (item 8).
fn vllm_array_stored(parent: Option<u64>, lora: Option<&str>, extra_keys: rmpv::Value) -> Vec<u8> {
    use rmpv::Value;
    let event = Value::Array(vec![
        Value::from("BlockStored"),
        Value::Array(vec![Value::from(1u64), Value::from(2u64)]),
        parent.map_or(Value::Nil, Value::from),
        Value::Array((0..8u32).map(Value::from).collect()),
        Value::from(4u32),
        lora.map_or(Value::Nil, |_| Value::from(3)),
        Value::from("GPU"),
        lora.map_or(Value::Nil, Value::from),
        extra_keys,
    ]);
    encode(&Value::Array(vec![
        Value::from(1.0f64),
        Value::Array(vec![event]),
    ]))
}

fn only_stored(payload: &[u8]) -> BlockStored {
    let batch = decode_batch(payload).expect("decodes");
    assert_eq!(batch.skipped_events, 0, "{batch:?}");
    match batch.events.as_slice() {
        [KvEvent::Stored(stored)] => stored.clone(),
        other => panic!("expected one BlockStored, got {other:?}"),
    }
}

#[test]
fn vllm_extra_keys_salt_on_the_first_block() {
    use rmpv::Value;
    // Salted request without LoRA: ("tenant-a",) on block 0, None after.
    let extra = Value::Array(vec![
        Value::Array(vec![Value::from("tenant-a")]),
        Value::Nil,
    ]);
    let stored = only_stored(&vllm_array_stored(None, None, extra));
    assert_eq!(stored.cache_salt.as_deref(), Some("tenant-a"));
    assert_eq!(stored.lora_name, None);

    // LoRA + multimodal pair + salt + prompt-embeds digest on block 0; the
    // LoRA name on every later block. The leading string is the LoRA name.
    let extra = Value::Array(vec![
        Value::Array(vec![
            Value::from("sql-lora"),
            Value::Array(vec![Value::from("img-hash"), Value::from(2)]),
            Value::from("tenant-b"),
            Value::Binary(vec![7; 32]),
        ]),
        Value::Array(vec![Value::from("sql-lora")]),
    ]);
    let stored = only_stored(&vllm_array_stored(None, Some("sql-lora"), extra));
    assert_eq!(stored.cache_salt.as_deref(), Some("tenant-b"));
    assert_eq!(stored.lora_name.as_deref(), Some("sql-lora"));

    // A salt equal to the LoRA name is still the salt (it follows the name).
    let extra = Value::Array(vec![Value::Array(vec![Value::from("x"), Value::from("x")])]);
    let stored = only_stored(&vllm_array_stored(None, Some("x"), extra));
    assert_eq!(stored.cache_salt.as_deref(), Some("x"));
}

#[test]
fn vllm_extra_keys_without_a_salt() {
    use rmpv::Value;
    // LoRA only: the name on every block is not a salt.
    let extra = Value::Array(vec![
        Value::Array(vec![Value::from("sql-lora")]),
        Value::Array(vec![Value::from("sql-lora")]),
    ]);
    let stored = only_stored(&vllm_array_stored(None, Some("sql-lora"), extra));
    assert_eq!(stored.cache_salt, None);
    // Multimodal pairs and digests only.
    let extra = Value::Array(vec![
        Value::Array(vec![
            Value::Array(vec![Value::from("img"), Value::from(0)]),
            Value::Binary(vec![1; 32]),
        ]),
        Value::Nil,
    ]);
    assert_eq!(
        only_stored(&vllm_array_stored(None, None, extra)).cache_salt,
        None
    );
    // `extra_keys: None` and all-None entries.
    assert_eq!(
        only_stored(&vllm_array_stored(None, None, Value::Nil)).cache_salt,
        None
    );
    let extra = Value::Array(vec![Value::Nil, Value::Nil]);
    assert_eq!(
        only_stored(&vllm_array_stored(None, None, extra)).cache_salt,
        None
    );
    // A block with a parent never starts a request: no salt is read.
    let extra = Value::Array(vec![Value::Array(vec![Value::from("s")]), Value::Nil]);
    assert_eq!(
        only_stored(&vllm_array_stored(Some(9), None, extra)).cache_salt,
        None
    );
}

#[test]
fn vllm_map_layout_extra_keys() {
    use rmpv::Value;
    let event = Value::Map(vec![
        (Value::from("type"), Value::from("BlockStored")),
        (
            Value::from("extra_keys"),
            Value::Array(vec![
                Value::Array(vec![Value::from("chat-lora"), Value::from("salt-1")]),
                Value::Array(vec![Value::from("chat-lora")]),
            ]),
        ),
        (
            Value::from("block_hashes"),
            Value::Array(vec![Value::from(1), Value::from(2)]),
        ),
        (Value::from("parent_block_hash"), Value::Nil),
        (
            Value::from("token_ids"),
            Value::Array((0..8u32).map(Value::from).collect()),
        ),
        (Value::from("block_size"), Value::from(4)),
        (Value::from("lora_id"), Value::Nil),
        (Value::from("medium"), Value::from("GPU")),
        // lora_name after extra_keys: the rule is applied once all fields are read.
        (Value::from("lora_name"), Value::from("chat-lora")),
        (Value::from("group_idx"), Value::from(0)),
    ]);
    let payload = encode(&Value::Array(vec![
        Value::from(1.0),
        Value::Array(vec![event]),
    ]));
    let stored = only_stored(&payload);
    assert_eq!(stored.cache_salt.as_deref(), Some("salt-1"));
    assert_eq!(stored.lora_name.as_deref(), Some("chat-lora"));
}

#[test]
fn sglang_map_layout_cache_salt() {
    use rmpv::Value;
    // SGLang 0.5.20+: a map with `cache_salt`, `session_id`, `lora_name`.
    let event = |salt: Value| {
        Value::Map(vec![
            (Value::from("type"), Value::from("BlockStored")),
            (
                Value::from("block_hashes"),
                Value::Array(vec![Value::from(-3i64)]),
            ),
            (Value::from("parent_block_hash"), Value::from(-4i64)),
            (Value::from("token_ids"), Value::Array(vec![Value::from(5)])),
            (Value::from("block_size"), Value::from(1)),
            (Value::from("lora_id"), Value::Nil),
            (Value::from("medium"), Value::from("GPU")),
            (Value::from("cache_salt"), salt),
            (Value::from("session_id"), Value::Nil),
            (Value::from("lora_name"), Value::Nil),
        ])
    };
    let payload = |salt| {
        encode(&Value::Array(vec![
            Value::from(1.0),
            Value::Array(vec![event(salt)]),
            Value::from(0),
        ]))
    };
    let stored = only_stored(&payload(Value::from("tenant-a")));
    // An explicit salt holds even when the blocks extend a parent.
    assert_eq!(stored.cache_salt.as_deref(), Some("tenant-a"));
    assert_eq!(stored.lora_name, None);
    assert_eq!(only_stored(&payload(Value::Nil)).cache_salt, None);
    assert_eq!(only_stored(&payload(Value::from(""))).cache_salt, None);
}

#[test]
fn sglang_array_layout_with_salt_map_is_not_a_lora_name() {
    use rmpv::Value;
    let salt_map = Value::Map(vec![(Value::from("cache_salt"), Value::from("tenant-a"))]);
    // 0.5.19: [tag, hashes, parent, tokens, block_size, lora_id, medium, {cache_salt}].
    let v519 = Value::Array(vec![
        Value::from("BlockStored"),
        Value::Array(vec![Value::from(-3i64), Value::from(11)]),
        Value::Nil,
        Value::Array(vec![Value::from(5), Value::from(6)]),
        Value::from(1),
        Value::Nil,
        Value::from("GPU"),
        salt_map.clone(),
    ]);
    // 0.5.18: no medium, the map follows lora_id.
    let v518 = Value::Array(vec![
        Value::from("BlockStored"),
        Value::Array(vec![Value::from(12)]),
        Value::from(11),
        Value::Array(vec![Value::from(7)]),
        Value::from(1),
        Value::Nil,
        salt_map,
    ]);
    // An unsalted 0.5.19 event next to them.
    let plain = Value::Array(vec![
        Value::from("BlockStored"),
        Value::Array(vec![Value::from(13)]),
        Value::Nil,
        Value::Array(vec![Value::from(8)]),
        Value::from(1),
        Value::Nil,
        Value::from("GPU"),
    ]);
    let payload = encode(&Value::Array(vec![
        Value::from(1.0),
        Value::Array(vec![v519, v518, plain]),
        Value::from(0),
    ]));
    let batch = decode_batch(&payload).expect("decodes");
    assert_eq!(
        batch.skipped_events, 0,
        "the salted events are no longer skipped"
    );
    let stored: Vec<&BlockStored> = batch
        .events
        .iter()
        .map(|e| match e {
            KvEvent::Stored(s) => s,
            other => panic!("expected BlockStored, got {other:?}"),
        })
        .collect();
    assert_eq!(stored.len(), 3);
    assert_eq!(stored[0].cache_salt.as_deref(), Some("tenant-a"));
    assert_eq!(stored[0].lora_name, None, "the salt map is not a LoRA name");
    assert_eq!(stored[0].medium.as_deref(), Some("GPU"));
    assert_eq!(stored[0].block_hashes.len(), 2);
    assert_eq!(stored[1].cache_salt.as_deref(), Some("tenant-a"));
    assert_eq!(stored[1].medium, None);
    assert_eq!(stored[2].cache_salt, None);
}
