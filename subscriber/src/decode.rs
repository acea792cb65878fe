//! msgpack payload → [`EventBatch`], for both vLLM event layouts.
//!
//! A payload is `KVEventBatch = [ts, events, data_parallel_rank?]` (a map
//! with the same keys is accepted too). Each event is either a tagged array
//! — `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
//! lora_id?, medium?, lora_name?, ...]`, `["BlockRemoved", block_hashes,
//! medium?, ...]`, `["AllBlocksCleared", ...]` (vLLM ≤ 0.23) — or a map
//! with a `"type"` key and named fields (vLLM ≥ 0.24). Trailing array items
//! and unknown map keys are skipped, so newer engine versions still decode.
//!
//! Cache salts ([`BlockStored::cache_salt`]):
//! - vLLM (from 0.18) sends `extra_keys` (array item 8, or the map key): one
//!   entry per block, `None` or a list assembled as `LoRA name + multimodal
//!   (identifier, offset) pairs + cache salt + prompt-embeds digests`. The
//!   salt is only ever on a request's first block (no parent), so only the
//!   first entry of an event without a parent is read. Its string items are
//!   the LoRA name (first, and only when the event names a LoRA by
//!   `lora_name` or `lora_id`) and the salt; pairs are arrays and digests are
//!   bytes. Rule: drop a leading string when the event names a LoRA, the
//!   next string is the salt. A string in the entry of a block with a parent
//!   is never taken for a salt. Should an engine ever put another bare
//!   string there, the blocks land in a partition no lookup names: matches
//!   are lost, never made across salts.
//! - SGLang ≥ 0.5.20 maps carry `cache_salt`. SGLang 0.5.18–0.5.19 append a
//!   `{"cache_salt": …}` map after a tagged array's fields (where `medium` or
//!   `lora_name` would be): any map found at an optional array position is
//!   read as such an extension map, never as a field value.
//!
//! A payload that is not a batch at all is a [`DecodeError`]; a single
//! event that cannot be read (or has an unknown type) is skipped and counted
//! in [`EventBatch::skipped_events`], the rest of the batch still applies.
//!
//! Cost: one forward pass over the bytes with a small msgpack reader of our
//! own — no intermediate value tree — writing hashes and token ids straight
//! into their vectors. Nesting is bounded, so hostile input cannot recurse
//! deeply or allocate more than its own length.

use crate::event::{BlockRemoved, BlockStored, EngineHash, EventBatch, KvEvent};

/// Nesting limit when skipping unknown values; vLLM batches are 3 levels deep.
const MAX_DEPTH: usize = 32;

/// Why a payload is not a KV-event batch.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum DecodeError {
    /// The bytes are not valid msgpack (truncated, reserved marker, too deep).
    #[error("not msgpack: {0}")]
    Msgpack(&'static str),
    /// Bytes left after the batch value.
    #[error("{0} trailing bytes after the batch")]
    TrailingBytes(usize),
    /// The value does not have the batch shape.
    #[error("not a KV-event batch: {0}")]
    Shape(&'static str),
}

/// Decodes one payload frame.
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    let mut reader = Reader { buf: payload };
    let batch = match reader.peek()? {
        0x90..=0x9f | 0xdc | 0xdd => {
            let len = reader.array_len()?;
            if len < 2 {
                return Err(DecodeError::Shape("batch array shorter than [ts, events]"));
            }
            let ts = reader
                .number()?
                .ok_or(DecodeError::Shape("ts is not a number"))?;
            let mut batch = EventBatch {
                ts,
                ..EventBatch::default()
            };
            read_events(&mut reader, &mut batch)?;
            if len >= 3 {
                batch.data_parallel_rank = reader.optional_int()?;
            }
            for _ in 3..len {
                reader.skip(0)?;
            }
            batch
        }
        0x80..=0x8f | 0xde | 0xdf => {
            let len = reader.map_len()?;
            let mut batch = EventBatch::default();
            let (mut has_ts, mut has_events) = (false, false);
            for _ in 0..len {
                match reader.str()? {
                    Some("ts") => {
                        batch.ts = reader
                            .number()?
                            .ok_or(DecodeError::Shape("ts is not a number"))?;
                        has_ts = true;
                    }
                    Some("events") => {
                        read_events(&mut reader, &mut batch)?;
                        has_events = true;
                    }
                    Some("data_parallel_rank") => {
                        batch.data_parallel_rank = reader.optional_int()?
                    }
                    _ => reader.skip(0)?,
                }
            }
            if !has_ts || !has_events {
                return Err(DecodeError::Shape("batch map without ts or events"));
            }
            batch
        }
        _ => return Err(DecodeError::Shape("batch is neither an array nor a map")),
    };
    if !reader.buf.is_empty() {
        return Err(DecodeError::TrailingBytes(reader.buf.len()));
    }
    Ok(batch)
}

fn read_events(reader: &mut Reader<'_>, batch: &mut EventBatch) -> Result<(), DecodeError> {
    if !matches!(reader.peek()?, 0x90..=0x9f | 0xdc | 0xdd) {
        return Err(DecodeError::Shape("events is not an array"));
    }
    let count = reader.array_len()?;
    batch.events.reserve(count.min(reader.buf.len()));
    for _ in 0..count {
        let start = reader.buf;
        match read_event(reader) {
            Ok(Some(event)) => batch.events.push(event),
            Ok(None) => batch.skipped_events += 1,
            Err(_) => {
                // Unreadable as an event: step over it as a plain value.
                reader.buf = start;
                reader.skip(0)?;
                batch.skipped_events += 1;
            }
        }
    }
    Ok(())
}

/// Fields of an event in either layout, before the tag decides the type.
#[derive(Default)]
struct Fields {
    block_hashes: Option<Vec<EngineHash>>,
    parent_block_hash: Option<EngineHash>,
    token_ids: Option<Vec<u32>>,
    block_size: Option<u32>,
    lora_id: Option<i64>,
    medium: Option<String>,
    lora_name: Option<String>,
    /// SGLang's `cache_salt` (map key or extension map).
    cache_salt: Option<String>,
    /// String items of the first `extra_keys` entry, with their positions.
    first_extra_strings: Vec<(usize, String)>,
}

impl Fields {
    /// The event's salt: SGLang's explicit one, else vLLM's from `extra_keys`.
    fn salt(&mut self) -> Option<String> {
        if let Some(salt) = self.cache_salt.take().filter(|s| !s.is_empty()) {
            return Some(salt);
        }
        if self.parent_block_hash.is_some() {
            return None;
        }
        let names_lora =
            self.lora_name.as_deref().is_some_and(|n| !n.is_empty()) || self.lora_id.is_some();
        let mut strings = std::mem::take(&mut self.first_extra_strings).into_iter();
        let mut next = strings.next();
        if names_lora && matches!(next, Some((0, _))) {
            next = strings.next();
        }
        next.map(|(_, salt)| salt).filter(|s| !s.is_empty())
    }
}

fn is_map(marker: u8) -> bool {
    matches!(marker, 0x80..=0x8f | 0xde | 0xdf)
}

/// Reads an extension map appended to an array event (SGLang 0.5.18–0.5.19).
fn read_extension_map(reader: &mut Reader<'_>, fields: &mut Fields) -> Result<(), DecodeError> {
    let len = reader.map_len()?;
    for _ in 0..len {
        match reader.str()? {
            Some("cache_salt") => fields.cache_salt = reader.optional_string()?,
            _ => reader.skip(0)?,
        }
    }
    Ok(())
}

/// Reads vLLM's `extra_keys`, keeping the string items of the first entry.
fn read_extra_keys(reader: &mut Reader<'_>, fields: &mut Fields) -> Result<(), DecodeError> {
    if !matches!(reader.peek()?, 0x90..=0x9f | 0xdc | 0xdd) {
        // `None` (no block has extra keys) or an unknown shape.
        return reader.skip(0);
    }
    let entries = reader.array_len()?;
    for entry in 0..entries {
        if entry > 0 || !matches!(reader.peek()?, 0x90..=0x9f | 0xdc | 0xdd) {
            reader.skip(0)?;
            continue;
        }
        let items = reader.array_len()?;
        for item in 0..items {
            if matches!(reader.peek()?, 0xa0..=0xbf | 0xd9..=0xdb) {
                if let Some(text) = reader.str()? {
                    fields.first_extra_strings.push((item, text.to_owned()));
                }
            } else {
                reader.skip(0)?;
            }
        }
    }
    Ok(())
}

/// One event; `Ok(None)` for an unknown type, `Err` when unreadable (the
/// caller then skips the whole value).
fn read_event(reader: &mut Reader<'_>) -> Result<Option<KvEvent>, DecodeError> {
    const BAD: DecodeError = DecodeError::Shape("bad event field");
    let mut fields = Fields::default();
    let tag: &str;
    match reader.peek()? {
        0x90..=0x9f | 0xdc | 0xdd => {
            let len = reader.array_len()?;
            if len == 0 {
                return Err(BAD);
            }
            tag = reader.str()?.ok_or(BAD)?;
            // Positions depend on the type; other types' fields are skipped.
            let (stored, removed) = (tag == "BlockStored", tag == "BlockRemoved");
            for index in 1..len {
                if ((stored && index >= 5) || (removed && index >= 2)) && is_map(reader.peek()?) {
                    read_extension_map(reader, &mut fields)?;
                    continue;
                }
                match (stored, removed, index) {
                    (true, _, 1) | (_, true, 1) => fields.block_hashes = Some(reader.hashes()?),
                    (true, _, 2) => fields.parent_block_hash = reader.optional_hash()?,
                    (true, _, 3) => fields.token_ids = Some(reader.tokens()?),
                    (true, _, 4) => fields.block_size = Some(reader.u32()?),
                    (true, _, 5) => fields.lora_id = reader.optional_int()?,
                    (true, _, 6) | (_, true, 2) => fields.medium = reader.optional_string()?,
                    (true, _, 7) => fields.lora_name = reader.optional_string()?,
                    (true, _, 8) => read_extra_keys(reader, &mut fields)?,
                    _ => reader.skip(0)?,
                }
            }
        }
        0x80..=0x8f | 0xde | 0xdf => {
            let len = reader.map_len()?;
            let mut found_tag = None;
            for _ in 0..len {
                match reader.str()? {
                    Some("type") => found_tag = Some(reader.str()?.ok_or(BAD)?),
                    Some("block_hashes") => fields.block_hashes = Some(reader.hashes()?),
                    Some("parent_block_hash") => {
                        fields.parent_block_hash = reader.optional_hash()?;
                    }
                    Some("token_ids") => fields.token_ids = Some(reader.tokens()?),
                    Some("block_size") => fields.block_size = Some(reader.u32()?),
                    Some("lora_id") => fields.lora_id = reader.optional_int()?,
                    Some("medium") => fields.medium = reader.optional_string()?,
                    Some("lora_name") => fields.lora_name = reader.optional_string()?,
                    Some("cache_salt") => fields.cache_salt = reader.optional_string()?,
                    Some("extra_keys") => read_extra_keys(reader, &mut fields)?,
                    _ => reader.skip(0)?,
                }
            }
            tag = found_tag.ok_or(BAD)?;
        }
        _ => return Err(BAD),
    }
    let cache_salt = fields.salt();
    Ok(match tag {
        "BlockStored" => Some(KvEvent::Stored(BlockStored {
            block_hashes: fields.block_hashes.ok_or(BAD)?,
            parent_block_hash: fields.parent_block_hash,
            token_ids: fields.token_ids.ok_or(BAD)?,
            block_size: fields.block_size.ok_or(BAD)?,
            lora_id: fields.lora_id,
            medium: fields.medium,
            lora_name: fields.lora_name,
            cache_salt,
        })),
        "BlockRemoved" => Some(KvEvent::Removed(BlockRemoved {
            block_hashes: fields.block_hashes.ok_or(BAD)?,
            medium: fields.medium,
        })),
        "AllBlocksCleared" => Some(KvEvent::AllCleared),
        _ => None,
    })
}

/// A msgpack integer, widened.
enum Int {
    Unsigned(u64),
    Signed(i64),
}

/// Forward-only msgpack reader over a byte slice.
struct Reader<'a> {
    buf: &'a [u8],
}

const TRUNCATED: DecodeError = DecodeError::Msgpack("truncated");
const TYPE: DecodeError = DecodeError::Shape("unexpected msgpack type");

impl<'a> Reader<'a> {
    fn peek(&self) -> Result<u8, DecodeError> {
        self.buf.first().copied().ok_or(TRUNCATED)
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.buf.len() < n {
            return Err(TRUNCATED);
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    fn byte(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }

    fn be<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        self.take(N)?.try_into().map_err(|_| TRUNCATED)
    }

    fn len_u8(&mut self) -> Result<usize, DecodeError> {
        Ok(usize::from(self.byte()?))
    }

    fn len_u16(&mut self) -> Result<usize, DecodeError> {
        Ok(usize::from(u16::from_be_bytes(self.be()?)))
    }

    fn len_u32(&mut self) -> Result<usize, DecodeError> {
        usize::try_from(u32::from_be_bytes(self.be()?)).map_err(|_| TRUNCATED)
    }

    /// Checks that `count` items of at least one byte each can still follow.
    fn plausible(&self, count: usize) -> Result<usize, DecodeError> {
        if count > self.buf.len() {
            return Err(TRUNCATED);
        }
        Ok(count)
    }

    fn array_len(&mut self) -> Result<usize, DecodeError> {
        let count = match self.byte()? {
            m @ 0x90..=0x9f => usize::from(m & 0x0f),
            0xdc => self.len_u16()?,
            0xdd => self.len_u32()?,
            _ => return Err(TYPE),
        };
        self.plausible(count)
    }

    fn map_len(&mut self) -> Result<usize, DecodeError> {
        let count = match self.byte()? {
            m @ 0x80..=0x8f => usize::from(m & 0x0f),
            0xde => self.len_u16()?,
            0xdf => self.len_u32()?,
            _ => return Err(TYPE),
        };
        self.plausible(count.saturating_mul(2)).map(|_| count)
    }

    /// A string; `None` when the value is something else (it is consumed).
    fn str(&mut self) -> Result<Option<&'a str>, DecodeError> {
        let len = match self.peek()? {
            m @ 0xa0..=0xbf => {
                self.byte()?;
                usize::from(m & 0x1f)
            }
            0xd9 => {
                self.byte()?;
                self.len_u8()?
            }
            0xda => {
                self.byte()?;
                self.len_u16()?
            }
            0xdb => {
                self.byte()?;
                self.len_u32()?
            }
            _ => {
                self.skip(0)?;
                return Ok(None);
            }
        };
        Ok(std::str::from_utf8(self.take(len)?).ok())
    }

    fn optional_string(&mut self) -> Result<Option<String>, DecodeError> {
        if self.peek()? == 0xc0 {
            self.byte()?;
            return Ok(None);
        }
        match self.str()? {
            Some(s) => Ok(Some(s.to_owned())),
            None => Err(TYPE),
        }
    }

    fn int(&mut self) -> Result<Int, DecodeError> {
        Ok(match self.byte()? {
            m @ 0x00..=0x7f => Int::Unsigned(u64::from(m)),
            m @ 0xe0..=0xff => Int::Signed(i64::from(m.cast_signed())),
            0xcc => Int::Unsigned(u64::from(self.byte()?)),
            0xcd => Int::Unsigned(u64::from(u16::from_be_bytes(self.be()?))),
            0xce => Int::Unsigned(u64::from(u32::from_be_bytes(self.be()?))),
            0xcf => Int::Unsigned(u64::from_be_bytes(self.be()?)),
            0xd0 => Int::Signed(i64::from(i8::from_be_bytes(self.be()?))),
            0xd1 => Int::Signed(i64::from(i16::from_be_bytes(self.be()?))),
            0xd2 => Int::Signed(i64::from(i32::from_be_bytes(self.be()?))),
            0xd3 => Int::Signed(i64::from_be_bytes(self.be()?)),
            _ => return Err(TYPE),
        })
    }

    fn u32(&mut self) -> Result<u32, DecodeError> {
        match self.int()? {
            Int::Unsigned(v) => u32::try_from(v).map_err(|_| TYPE),
            Int::Signed(v) => u32::try_from(v).map_err(|_| TYPE),
        }
    }

    fn optional_int(&mut self) -> Result<Option<i64>, DecodeError> {
        if self.peek()? == 0xc0 {
            self.byte()?;
            return Ok(None);
        }
        match self.int()? {
            Int::Signed(v) => Ok(Some(v)),
            Int::Unsigned(v) => i64::try_from(v).map(Some).map_err(|_| TYPE),
        }
    }

    /// A float or integer; `None` (consumed) for anything else.
    fn number(&mut self) -> Result<Option<f64>, DecodeError> {
        match self.peek()? {
            0xcb => {
                self.byte()?;
                Ok(Some(f64::from_be_bytes(self.be()?)))
            }
            0xca => {
                self.byte()?;
                Ok(Some(f64::from(f32::from_be_bytes(self.be()?))))
            }
            0x00..=0x7f | 0xe0..=0xff | 0xcc..=0xcf | 0xd0..=0xd3 => {
                Ok(Some(match self.int()? {
                    Int::Unsigned(v) => v as f64,
                    Int::Signed(v) => v as f64,
                }))
            }
            _ => {
                self.skip(0)?;
                Ok(None)
            }
        }
    }

    fn hash(&mut self) -> Result<EngineHash, DecodeError> {
        let len = match self.peek()? {
            0xc4 => {
                self.byte()?;
                self.len_u8()?
            }
            0xc5 => {
                self.byte()?;
                self.len_u16()?
            }
            0xc6 => {
                self.byte()?;
                self.len_u32()?
            }
            _ => {
                return Ok(EngineHash::Int(match self.int()? {
                    Int::Unsigned(v) => v,
                    Int::Signed(v) => v.cast_unsigned(),
                }));
            }
        };
        Ok(EngineHash::Bytes(self.take(len)?.into()))
    }

    fn optional_hash(&mut self) -> Result<Option<EngineHash>, DecodeError> {
        if self.peek()? == 0xc0 {
            self.byte()?;
            return Ok(None);
        }
        self.hash().map(Some)
    }

    fn hashes(&mut self) -> Result<Vec<EngineHash>, DecodeError> {
        let count = self.array_len()?;
        let mut out = Vec::with_capacity(count);
        for _ in 0..count {
            out.push(self.hash()?);
        }
        Ok(out)
    }

    fn tokens(&mut self) -> Result<Vec<u32>, DecodeError> {
        let count = self.array_len()?;
        let mut out = Vec::with_capacity(count);
        for _ in 0..count {
            // Fast path: positive fixint, uint8, uint16, uint32.
            let token = match self.peek()? {
                m @ 0x00..=0x7f => {
                    self.byte()?;
                    u32::from(m)
                }
                0xcc => {
                    self.byte()?;
                    u32::from(self.byte()?)
                }
                0xcd => {
                    self.byte()?;
                    u32::from(u16::from_be_bytes(self.be()?))
                }
                0xce => {
                    self.byte()?;
                    u32::from_be_bytes(self.be()?)
                }
                _ => self.u32()?,
            };
            out.push(token);
        }
        Ok(out)
    }

    /// Steps over one value of any type.
    fn skip(&mut self, depth: usize) -> Result<(), DecodeError> {
        if depth > MAX_DEPTH {
            return Err(DecodeError::Msgpack("nested too deeply"));
        }
        let marker = self.byte()?;
        let (bytes, items) = match marker {
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => (0, 0),
            0x80..=0x8f => (0, 2 * usize::from(marker & 0x0f)),
            0x90..=0x9f => (0, usize::from(marker & 0x0f)),
            0xa0..=0xbf => (usize::from(marker & 0x1f), 0),
            0xc1 => return Err(DecodeError::Msgpack("reserved marker 0xc1")),
            0xc4 | 0xd9 => (self.len_u8()?, 0),
            0xc5 | 0xda => (self.len_u16()?, 0),
            0xc6 | 0xdb => (self.len_u32()?, 0),
            0xc7 => (self.len_u8()? + 1, 0),
            0xc8 => (self.len_u16()? + 1, 0),
            0xc9 => (self.len_u32()?.saturating_add(1), 0),
            0xca => (4, 0),
            0xcb => (8, 0),
            0xcc | 0xd0 => (1, 0),
            0xcd | 0xd1 => (2, 0),
            0xce | 0xd2 => (4, 0),
            0xcf | 0xd3 => (8, 0),
            0xd4 => (2, 0),
            0xd5 => (3, 0),
            0xd6 => (5, 0),
            0xd7 => (9, 0),
            0xd8 => (17, 0),
            0xdc => (0, self.len_u16()?),
            0xdd => (0, self.len_u32()?),
            0xde => (0, self.len_u16()?.saturating_mul(2)),
            0xdf => (0, self.len_u32()?.saturating_mul(2)),
        };
        self.take(bytes)?;
        self.plausible(items)?;
        for _ in 0..items {
            self.skip(depth + 1)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
