//! msgpack payload → [`EventBatch`], for both vLLM event layouts.
//!
//! A payload is `KVEventBatch = [ts, events, data_parallel_rank?]` (a map
//! with the same keys is accepted too). Each event is either a tagged array
//! — `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
//! lora_id?, medium?, lora_name?, ...]`, `["BlockRemoved", block_hashes,
//! medium?, ...]`, `["AllBlocksCleared", ...]` (vLLM ≤ 0.23) — or a map
//! with a `"type"` key and named fields (vLLM ≥ 0.24). Trailing array items
//! and unknown map keys are ignored, so newer engine versions still decode.
//!
//! A payload that is not a batch at all is a [`DecodeError`]; a single
//! event that cannot be read (or has an unknown type) is skipped and counted
//! in [`EventBatch::skipped_events`], the rest of the batch still applies.
//!
//! Cost: one borrowed pass over the bytes (`rmpv::ValueRef`, no string or
//! binary copies), then one owned copy of hashes and token ids.

use rmpv::ValueRef;

use crate::event::{BlockRemoved, BlockStored, EngineHash, EventBatch, KvEvent};

/// Nesting limit of a payload; vLLM batches are three levels deep.
const MAX_DEPTH: usize = 16;

/// Why a payload is not a KV-event batch.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum DecodeError {
    /// The bytes are not one msgpack value.
    #[error("not msgpack: {0}")]
    Msgpack(String),
    /// Bytes left after the batch value.
    #[error("{0} trailing bytes after the batch")]
    TrailingBytes(usize),
    /// The value does not have the batch shape.
    #[error("not a KV-event batch: {0}")]
    Shape(&'static str),
}

/// Decodes one payload frame.
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    let mut rest = payload;
    let value = rmpv::decode::read_value_ref_with_max_depth(&mut rest, MAX_DEPTH)
        .map_err(|e| DecodeError::Msgpack(e.to_string()))?;
    if !rest.is_empty() {
        return Err(DecodeError::TrailingBytes(rest.len()));
    }
    let (ts, events, rank) = match &value {
        ValueRef::Array(items) => {
            if items.len() < 2 {
                return Err(DecodeError::Shape("batch array shorter than [ts, events]"));
            }
            (&items[0], &items[1], items.get(2))
        }
        ValueRef::Map(entries) => {
            let ts = map_get(entries, "ts").ok_or(DecodeError::Shape("batch map without ts"))?;
            let events =
                map_get(entries, "events").ok_or(DecodeError::Shape("batch map without events"))?;
            (ts, events, map_get(entries, "data_parallel_rank"))
        }
        _ => return Err(DecodeError::Shape("batch is neither an array nor a map")),
    };
    let ts = number(ts).ok_or(DecodeError::Shape("ts is not a number"))?;
    let ValueRef::Array(raw_events) = events else {
        return Err(DecodeError::Shape("events is not an array"));
    };
    let data_parallel_rank = rank.and_then(|r| match r {
        ValueRef::Integer(i) => i.as_i64(),
        _ => None,
    });
    let mut batch = EventBatch {
        ts,
        events: Vec::with_capacity(raw_events.len()),
        data_parallel_rank,
        skipped_events: 0,
    };
    for raw in raw_events {
        match decode_event(raw) {
            Some(event) => batch.events.push(event),
            None => batch.skipped_events += 1,
        }
    }
    Ok(batch)
}

/// One event in either layout; `None` when unreadable or of an unknown type.
fn decode_event(value: &ValueRef<'_>) -> Option<KvEvent> {
    match value {
        ValueRef::Array(items) => {
            let tag = text(items.first()?)?;
            let field = |i: usize| items.get(i);
            decode_fields(tag, field, |_| None)
        }
        ValueRef::Map(entries) => {
            let tag = text(map_get(entries, "type")?)?;
            decode_fields(tag, |_| None, |name| map_get(entries, name))
        }
        _ => None,
    }
}

/// Reads an event's fields by position (array layout) or name (map layout).
fn decode_fields<'v, 'a: 'v>(
    tag: &str,
    by_index: impl Fn(usize) -> Option<&'v ValueRef<'a>>,
    by_name: impl Fn(&str) -> Option<&'v ValueRef<'a>>,
) -> Option<KvEvent> {
    let get = |index: usize, name: &str| by_index(index).or_else(|| by_name(name));
    match tag {
        "BlockStored" => {
            let block_hashes = hashes(get(1, "block_hashes")?)?;
            let parent_block_hash = match get(2, "parent_block_hash") {
                None | Some(ValueRef::Nil) => None,
                Some(v) => Some(hash(v)?),
            };
            let token_ids = tokens(get(3, "token_ids")?)?;
            let block_size = match get(4, "block_size")? {
                ValueRef::Integer(i) => u32::try_from(i.as_u64()?).ok()?,
                _ => return None,
            };
            let lora_id = match get(5, "lora_id") {
                None | Some(ValueRef::Nil) => None,
                Some(ValueRef::Integer(i)) => Some(i.as_i64()?),
                Some(_) => return None,
            };
            let medium = optional_text(get(6, "medium"))?;
            let lora_name = optional_text(get(7, "lora_name"))?;
            Some(KvEvent::Stored(BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
                medium,
                lora_name,
            }))
        }
        "BlockRemoved" => {
            let block_hashes = hashes(get(1, "block_hashes")?)?;
            let medium = optional_text(get(2, "medium"))?;
            Some(KvEvent::Removed(BlockRemoved {
                block_hashes,
                medium,
            }))
        }
        "AllBlocksCleared" => Some(KvEvent::AllCleared),
        _ => None,
    }
}

/// `Some(None)` for an absent or nil field, `Some(Some(s))` for a string,
/// `None` (malformed) for anything else.
fn optional_text(value: Option<&ValueRef<'_>>) -> Option<Option<String>> {
    match value {
        None | Some(ValueRef::Nil) => Some(None),
        Some(v) => text(v).map(|s| Some(s.to_owned())),
    }
}

fn map_get<'v, 'a>(
    entries: &'v [(ValueRef<'a>, ValueRef<'a>)],
    key: &str,
) -> Option<&'v ValueRef<'a>> {
    entries
        .iter()
        .find(|(k, _)| text(k) == Some(key))
        .map(|(_, v)| v)
}

fn text<'v>(value: &'v ValueRef<'_>) -> Option<&'v str> {
    match value {
        ValueRef::String(s) => s.as_str(),
        _ => None,
    }
}

fn number(value: &ValueRef<'_>) -> Option<f64> {
    match value {
        ValueRef::F64(f) => Some(*f),
        ValueRef::F32(f) => Some(f64::from(*f)),
        ValueRef::Integer(i) => i
            .as_i64()
            .map(|v| v as f64)
            .or(i.as_u64().map(|v| v as f64)),
        _ => None,
    }
}

fn hash(value: &ValueRef<'_>) -> Option<EngineHash> {
    match value {
        ValueRef::Integer(i) => i
            .as_u64()
            .or_else(|| i.as_i64().map(|v| v.cast_unsigned()))
            .map(EngineHash::Int),
        ValueRef::Binary(b) => Some(EngineHash::Bytes((*b).into())),
        _ => None,
    }
}

fn hashes(value: &ValueRef<'_>) -> Option<Vec<EngineHash>> {
    let ValueRef::Array(items) = value else {
        return None;
    };
    items.iter().map(hash).collect()
}

fn tokens(value: &ValueRef<'_>) -> Option<Vec<u32>> {
    let ValueRef::Array(items) = value else {
        return None;
    };
    items
        .iter()
        .map(|item| match item {
            ValueRef::Integer(i) => i.as_u64().and_then(|v| u32::try_from(v).ok()),
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests;
