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
