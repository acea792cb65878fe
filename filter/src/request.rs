//! Request classification, OpenAI body parsing and the `LookupRouteRequest` built from them.
//!
//! Only `POST /v1/completions` and `POST /v1/chat/completions` are looked up;
//! everything else passes untouched. Unknown body fields are ignored and
//! nothing here panics on request data: every malformed shape is a
//! [`BodyError`], and the request then continues unrouted.
//!
//! - **Completions.** `model`, `prompt` and `cache_salt`. A token-id prompt is
//!   fingerprinted here with the shared `fingerprint` crate (so the server
//!   sees exactly the chain the engine will cache); a string prompt goes as
//!   `raw_prompt`.
//! - **Chat completions.** The server renders the conversation with the
//!   model's chat template exactly as the engine does, which needs the whole
//!   request, agent fields included (`docs/chat-requests.md`). The body's
//!   `messages`, `tools`, `chat_template_kwargs` and `documents` are captured
//!   as [`RawValue`] slices of the body and forwarded as `messages_json`,
//!   `tools_json`, `chat_template_kwargs_json` and `documents_json`
//!   verbatim: no re-encoding, so key order, number spelling and escapes
//!   reach the server's template as the engine receives them. A `null` or
//!   absent field is sent empty. `add_generation_prompt` is copied only when
//!   the body has it (unset means the engine default), `continue_final_message`
//!   as given. Assistant messages with `content: null` (or none) and
//!   `tool_calls`, `tool` messages with `tool_call_id`, `name`, reasoning
//!   fields and content-part lists are all accepted; the server validates
//!   what only the template needs. For servers that predate `messages_json`
//!   the structured `messages` copy is also filled, but only for a plain
//!   conversation (`{role, content}` with string or `text`-part content, no
//!   tools, documents, kwargs or generation options), the one such a server
//!   renders as the engine does.
//! - **`cache_salt`** (a string, both APIs) is copied to the lookup, so a
//!   salted request only matches blocks the engine stored under that salt.
//! - **Multimodal.** A message with an image, audio or video part
//!   (`image_url`, `input_image`, `input_audio`, `video_url`, … — the types
//!   the server refuses as `unsupported_content`) is not looked up at all:
//!   its tokens come from the engine's multimodal processor, so no prefix can
//!   be claimed, and skipping it here saves forwarding a large body to get
//!   the same `NO_HINT`. It counts as `UnsupportedPrompt`
//!   (`inferencecache_filter.failure.unsupported_prompt`).
//!
//! Cost: one pass over the body, plus for chat a second pass over the
//! `messages` text alone (shape check, media check, structured copy) and one
//! copy of each forwarded JSON slice; one hash per 16 tokens for a token-id
//! prompt. Both passes are bounded by the filter's `max_body_bytes` and
//! serde_json's nesting limit. The fields that take several shapes
//! (`prompt`, a message's `content`, a content part) are read by
//! hand-written visitors that pick the shape from the first JSON token, so a
//! prompt is decoded once, straight into its final type, instead of being
//! buffered and re-read per candidate shape; fields the filter does not use
//! (images, sampling parameters, tool-call bodies) are skipped without being
//! copied.

use std::fmt;

use inference_cache_fingerprint::request_chain;
use inference_cache_proto::v1alpha1::{ChatMessage, LookupRouteRequest};
use serde::Deserialize;
use serde::de::value::{MapAccessDeserializer, SeqAccessDeserializer};
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;

use crate::config::Settings;

/// Path of the OpenAI completions API.
pub const COMPLETIONS_PATH: &str = "/v1/completions";
/// Path of the OpenAI chat completions API.
pub const CHAT_COMPLETIONS_PATH: &str = "/v1/chat/completions";

/// Which OpenAI API a request targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `/v1/completions`: `prompt` is a string or token ids.
    Completions,
    /// `/v1/chat/completions`: `messages` is a conversation.
    ChatCompletions,
}

/// The API of a request worth a lookup, from its method and path (the query string is ignored).
pub fn classify(method: &str, path: &str) -> Option<Api> {
    if !method.eq_ignore_ascii_case("POST") {
        return None;
    }
    let path = path.split(['?', '#']).next().unwrap_or(path);
    match path {
        COMPLETIONS_PATH => Some(Api::Completions),
        CHAT_COMPLETIONS_PATH => Some(Api::ChatCompletions),
        _ => None,
    }
}

/// The routing-relevant part of a request body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedRequest {
    /// The OpenAI `model` name.
    pub model: String,
    /// What the prompt is.
    pub input: PromptInput,
    /// The body's `cache_salt`; empty when unsalted.
    pub cache_salt: String,
}

/// A prompt in the form the lookup carries it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptInput {
    /// Token ids, fingerprinted by the filter.
    TokenIds(Vec<u32>),
    /// A completions string prompt (`raw_prompt`).
    Text(String),
    /// A chat request (`messages_json` and the template inputs).
    Chat(ChatRequest),
}

/// A `/v1/chat/completions` request as the lookup forwards it: the JSON
/// fields are the body's own text, verbatim.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChatRequest {
    /// `messages`, verbatim.
    pub messages_json: String,
    /// The structured copy for servers that predate `messages_json`: filled
    /// only for a plain conversation (`{role, content}` messages with string
    /// or `text`-part content, no tools, documents, kwargs or generation
    /// options), empty otherwise.
    pub messages: Vec<ChatMessage>,
    /// `tools`, verbatim; empty when absent or `null`.
    pub tools_json: String,
    /// `chat_template_kwargs`, verbatim; empty when absent or `null`.
    pub chat_template_kwargs_json: String,
    /// `documents`, verbatim; empty when absent or `null`.
    pub documents_json: String,
    /// `add_generation_prompt`, only when the body has it.
    pub add_generation_prompt: Option<bool>,
    /// `continue_final_message` (absent: false).
    pub continue_final_message: bool,
}

/// Why a body cannot be looked up; the request then continues untouched.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BodyError {
    /// Not JSON, or not the shape of the API's request.
    #[error("body is not a JSON request of this API")]
    InvalidJson,
    /// `model` missing or empty.
    #[error("request names no model")]
    MissingModel,
    /// A prompt shape with no single routable prefix (batch, empty, non-text parts).
    #[error("prompt shape cannot be looked up")]
    UnsupportedPrompt,
    /// A token-id prompt shorter than one KV block: nothing cacheable.
    #[error("prompt is shorter than one block")]
    PromptTooShort,
}

#[derive(Deserialize)]
struct CompletionsBody {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    prompt: Option<PromptField>,
    #[serde(default)]
    cache_salt: Option<String>,
}

/// `prompt`: a string, token ids, a list of strings or a list of token-id lists.
enum PromptField {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<u32>>),
}

impl<'de> Deserialize<'de> for PromptField {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(PromptVisitor)
    }
}

struct PromptVisitor;

impl<'de> Visitor<'de> for PromptVisitor {
    type Value = PromptField;

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("a string, token ids, or a list of strings or of token-id lists")
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<PromptField, E> {
        Ok(PromptField::Text(text.to_owned()))
    }

    fn visit_string<E: de::Error>(self, text: String) -> Result<PromptField, E> {
        Ok(PromptField::Text(text))
    }

    /// The first element fixes the shape; every later one must have it too.
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<PromptField, A::Error> {
        let Some(first) = seq.next_element::<PromptElement>()? else {
            return Ok(PromptField::Tokens(Vec::new()));
        };
        Ok(match first {
            PromptElement::Token(token) => {
                let mut tokens = vec![token];
                while let Some(token) = seq.next_element::<u32>()? {
                    tokens.push(token);
                }
                PromptField::Tokens(tokens)
            }
            PromptElement::Text(text) => {
                let mut texts = vec![text];
                while let Some(text) = seq.next_element::<String>()? {
                    texts.push(text);
                }
                PromptField::Texts(texts)
            }
            PromptElement::Tokens(tokens) => {
                let mut lists = vec![tokens];
                while let Some(tokens) = seq.next_element::<Vec<u32>>()? {
                    lists.push(tokens);
                }
                PromptField::TokenLists(lists)
            }
        })
    }
}

/// The first element of a list `prompt`.
enum PromptElement {
    Token(u32),
    Text(String),
    Tokens(Vec<u32>),
}

impl<'de> Deserialize<'de> for PromptElement {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(PromptElementVisitor)
    }
}

struct PromptElementVisitor;

impl<'de> Visitor<'de> for PromptElementVisitor {
    type Value = PromptElement;

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("a token id, a string or a list of token ids")
    }

    fn visit_u64<E: de::Error>(self, value: u64) -> Result<PromptElement, E> {
        u32::try_from(value)
            .map(PromptElement::Token)
            .map_err(|_| E::invalid_value(de::Unexpected::Unsigned(value), &self))
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<PromptElement, E> {
        Ok(PromptElement::Text(text.to_owned()))
    }

    fn visit_string<E: de::Error>(self, text: String) -> Result<PromptElement, E> {
        Ok(PromptElement::Text(text))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<PromptElement, A::Error> {
        Vec::<u32>::deserialize(SeqAccessDeserializer::new(seq)).map(PromptElement::Tokens)
    }
}

#[derive(Deserialize)]
struct ChatBody<'a> {
    #[serde(default)]
    model: Option<String>,
    #[serde(default, borrow)]
    messages: Option<&'a RawValue>,
    #[serde(default, borrow)]
    tools: Option<&'a RawValue>,
    #[serde(default, borrow)]
    chat_template_kwargs: Option<&'a RawValue>,
    #[serde(default, borrow)]
    documents: Option<&'a RawValue>,
    #[serde(default)]
    add_generation_prompt: Option<bool>,
    #[serde(default)]
    continue_final_message: Option<bool>,
    #[serde(default)]
    cache_salt: Option<String>,
}

/// One message of `messages`, read only to check its shape, spot media parts
/// and fill the structured copy of a plain conversation.
#[derive(Deserialize)]
struct ChatTurn {
    role: String,
    #[serde(default)]
    content: Option<ContentField>,
    // Agent fields: forwarded verbatim in `messages_json`; their presence only
    // makes the conversation one the structured `messages` cannot carry.
    #[serde(default)]
    tool_calls: Option<IgnoredAny>,
    #[serde(default)]
    tool_call_id: Option<IgnoredAny>,
    #[serde(default)]
    name: Option<IgnoredAny>,
    #[serde(default)]
    reasoning: Option<IgnoredAny>,
    #[serde(default)]
    reasoning_content: Option<IgnoredAny>,
}

impl ChatTurn {
    fn has_agent_fields(&self) -> bool {
        self.tool_calls.is_some()
            || self.tool_call_id.is_some()
            || self.name.is_some()
            || self.reasoning.is_some()
            || self.reasoning_content.is_some()
    }
}

/// A message's `content`: a string or a list of parts.
enum ContentField {
    Text(String),
    Parts(Vec<PartField>),
}

impl<'de> Deserialize<'de> for ContentField {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(ContentVisitor)
    }
}

struct ContentVisitor;

impl<'de> Visitor<'de> for ContentVisitor {
    type Value = ContentField;

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("a string or a list of content parts")
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<ContentField, E> {
        Ok(ContentField::Text(text.to_owned()))
    }

    fn visit_string<E: de::Error>(self, text: String) -> Result<ContentField, E> {
        Ok(ContentField::Text(text))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<ContentField, A::Error> {
        Vec::<PartField>::deserialize(SeqAccessDeserializer::new(seq)).map(ContentField::Parts)
    }
}

/// One content part: a bare string (a text part to the engine) or a typed object.
enum PartField {
    Bare,
    Typed(ContentPart),
}

impl<'de> Deserialize<'de> for PartField {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(PartVisitor)
    }
}

struct PartVisitor;

impl<'de> Visitor<'de> for PartVisitor {
    type Value = PartField;

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("a string or a typed content part")
    }

    fn visit_str<E: de::Error>(self, _text: &str) -> Result<PartField, E> {
        Ok(PartField::Bare)
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<PartField, A::Error> {
        ContentPart::deserialize(MapAccessDeserializer::new(map)).map(PartField::Typed)
    }
}

#[derive(Deserialize)]
struct ContentPart {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: Option<String>,
}

/// Part types whose tokens come from the engine's multimodal processor.
const MEDIA_PARTS: [&str; 9] = [
    "image_url",
    "input_image",
    "image_pil",
    "image_embeds",
    "audio_embeds",
    "prompt_embeds",
    "audio_url",
    "input_audio",
    "video_url",
];

/// Parses a request body of `api`.
pub fn parse_body(api: Api, body: &[u8]) -> Result<ParsedRequest, BodyError> {
    match api {
        Api::Completions => parse_completions(body),
        Api::ChatCompletions => parse_chat(body),
    }
}

fn model_of(model: Option<String>) -> Result<String, BodyError> {
    match model {
        Some(model) if !model.is_empty() => Ok(model),
        _ => Err(BodyError::MissingModel),
    }
}

fn parse_completions(body: &[u8]) -> Result<ParsedRequest, BodyError> {
    let parsed: CompletionsBody =
        serde_json::from_slice(body).map_err(|_| BodyError::InvalidJson)?;
    let model = model_of(parsed.model)?;
    let input = match parsed.prompt {
        Some(PromptField::Text(text)) => PromptInput::Text(text),
        Some(PromptField::Tokens(tokens)) => PromptInput::TokenIds(tokens),
        Some(PromptField::Texts(mut texts)) if texts.len() == 1 => {
            PromptInput::Text(texts.swap_remove(0))
        }
        Some(PromptField::TokenLists(mut lists)) if lists.len() == 1 => {
            PromptInput::TokenIds(lists.swap_remove(0))
        }
        Some(_) => return Err(BodyError::UnsupportedPrompt),
        None => return Err(BodyError::InvalidJson),
    };
    match &input {
        PromptInput::TokenIds(tokens) if tokens.is_empty() => Err(BodyError::UnsupportedPrompt),
        PromptInput::Text(text) if text.is_empty() => Err(BodyError::UnsupportedPrompt),
        _ => Ok(ParsedRequest {
            model,
            input,
            cache_salt: parsed.cache_salt.unwrap_or_default(),
        }),
    }
}

/// The verbatim text of an optional JSON field whose value must open with
/// `open` (`[` or `{`); `null` or absent is empty. Any other kind of value is
/// a body the engine refuses too.
fn raw_of(value: Option<&RawValue>, open: char) -> Result<String, BodyError> {
    match value {
        None => Ok(String::new()),
        Some(raw) if raw.get().starts_with(open) => Ok(raw.get().to_owned()),
        Some(_) => Err(BodyError::InvalidJson),
    }
}

fn parse_chat(body: &[u8]) -> Result<ParsedRequest, BodyError> {
    let parsed: ChatBody<'_> = serde_json::from_slice(body).map_err(|_| BodyError::InvalidJson)?;
    let model = model_of(parsed.model)?;
    let messages_raw = parsed.messages.ok_or(BodyError::InvalidJson)?;
    // Second, bounded pass over the messages text alone: the shape check, the
    // media check and the structured copy. `messages_json` stays the raw slice.
    let turns: Vec<ChatTurn> =
        serde_json::from_str(messages_raw.get()).map_err(|_| BodyError::InvalidJson)?;
    if turns.is_empty() {
        return Err(BodyError::UnsupportedPrompt);
    }
    let mut chat = ChatRequest {
        messages_json: messages_raw.get().to_owned(),
        messages: Vec::new(),
        tools_json: raw_of(parsed.tools, '[')?,
        chat_template_kwargs_json: raw_of(parsed.chat_template_kwargs, '{')?,
        documents_json: raw_of(parsed.documents, '[')?,
        add_generation_prompt: parsed.add_generation_prompt,
        continue_final_message: parsed.continue_final_message.unwrap_or(false),
    };
    let mut plain = chat.tools_json.is_empty()
        && chat.chat_template_kwargs_json.is_empty()
        && chat.documents_json.is_empty()
        && chat.add_generation_prompt.unwrap_or(true)
        && !chat.continue_final_message;
    let mut messages = Vec::with_capacity(if plain { turns.len() } else { 0 });
    for turn in turns {
        plain &= !turn.has_agent_fields();
        let content = match turn.content {
            None => Some(String::new()),
            Some(ContentField::Text(text)) => Some(text),
            Some(ContentField::Parts(parts)) => text_of_parts(parts)?,
        };
        match content {
            Some(content) if plain => messages.push(ChatMessage {
                role: turn.role,
                content,
            }),
            _ => plain = false,
        }
    }
    if plain {
        chat.messages = messages;
    }
    Ok(ParsedRequest {
        model,
        input: PromptInput::Chat(chat),
        cache_salt: parsed.cache_salt.unwrap_or_default(),
    })
}

/// The text of a plain parts list (`text` parts only, joined by newlines as
/// the engine flattens them for string-content templates; a part without
/// text is skipped as the engine skips it), `None` for a list with other
/// text-like parts (the server reads those from `messages_json`). A media
/// part makes the prompt unroutable: its tokens come from the engine's
/// multimodal processor.
fn text_of_parts(parts: Vec<PartField>) -> Result<Option<String>, BodyError> {
    let mut texts = Vec::with_capacity(parts.len());
    let mut plain = true;
    for part in parts {
        match part {
            PartField::Typed(part) if MEDIA_PARTS.contains(&part.kind.as_str()) => {
                return Err(BodyError::UnsupportedPrompt);
            }
            PartField::Typed(ContentPart { kind, text }) if kind == "text" => {
                texts.extend(text);
            }
            _ => plain = false,
        }
    }
    Ok(plain.then(|| texts.join("\n")))
}

/// Builds the lookup for a parsed request under `settings`, for `tenant_id`.
pub fn lookup_request(
    settings: &Settings,
    tenant_id: &str,
    parsed: ParsedRequest,
) -> Result<LookupRouteRequest, BodyError> {
    let target = settings.model_target(&parsed.model);
    let mut request = LookupRouteRequest {
        model_id: target.model_id,
        tenant_id: tenant_id.to_owned(),
        hash_scheme: settings.hash_scheme.clone(),
        adapter_id: target.adapter_id,
        ..LookupRouteRequest::default()
    };
    match parsed.input {
        PromptInput::TokenIds(tokens) => {
            let chain = request_chain(&tokens, settings.block_size);
            if chain.is_empty() {
                return Err(BodyError::PromptTooShort);
            }
            request.block_hashes = chain
                .block_hashes
                .iter()
                .map(|hash| hash.to_vec())
                .collect();
            request.block_token_counts = chain.block_token_counts;
        }
        PromptInput::Text(text) => request.raw_prompt = text,
        PromptInput::Chat(chat) => {
            request.messages_json = chat.messages_json;
            request.messages = chat.messages;
            request.tools_json = chat.tools_json;
            request.chat_template_kwargs_json = chat.chat_template_kwargs_json;
            request.add_generation_prompt = chat.add_generation_prompt;
            request.continue_final_message = chat.continue_final_message;
            request.documents_json = chat.documents_json;
        }
    }
    request.cache_salt = parsed.cache_salt;
    Ok(request)
}

#[cfg(test)]
mod tests {
    use super::*;
    use inference_cache_fingerprint::{encode, prefix_hashes};
    use prost::Message;

    fn settings() -> Settings {
        let mut settings = Settings::with_cluster("ic");
        settings.models.insert(
            "llama-sql".into(),
            crate::config::ModelTarget {
                model_id: "llama".into(),
                adapter_id: "sql-lora".into(),
            },
        );
        settings
    }

    /// The structured copy of a parsed chat request.
    fn typed_messages(parsed: ParsedRequest) -> Vec<ChatMessage> {
        match parsed.input {
            PromptInput::Chat(chat) => chat.messages,
            other => panic!("not a chat request: {other:?}"),
        }
    }

    #[test]
    fn classifies_only_inference_posts() {
        assert_eq!(classify("POST", "/v1/completions"), Some(Api::Completions));
        assert_eq!(
            classify("post", "/v1/chat/completions?stream=true"),
            Some(Api::ChatCompletions)
        );
        assert_eq!(classify("GET", "/v1/completions"), None);
        assert_eq!(classify("POST", "/v1/models"), None);
        assert_eq!(classify("POST", "/v1/completions/extra"), None);
    }

    #[test]
    fn completions_prompt_shapes() {
        let parse = |json: &str| parse_body(Api::Completions, json.as_bytes());
        assert_eq!(
            parse(r#"{"model":"m","prompt":"hello","max_tokens":3}"#),
            Ok(ParsedRequest {
                model: "m".into(),
                input: PromptInput::Text("hello".into()),
                cache_salt: String::new(),
            })
        );
        assert_eq!(
            parse(r#"{"model":"m","prompt":[1,2,3]}"#).map(|parsed| parsed.input),
            Ok(PromptInput::TokenIds(vec![1, 2, 3]))
        );
        assert_eq!(
            parse(r#"{"model":"m","prompt":[[4294967295,0]]}"#).map(|parsed| parsed.input),
            Ok(PromptInput::TokenIds(vec![u32::MAX, 0]))
        );
        assert_eq!(
            parse(r#"{"model":"m","prompt":["only"]}"#).map(|parsed| parsed.input),
            Ok(PromptInput::Text("only".into()))
        );
        assert_eq!(
            parse(r#"{"model":"m","prompt":["a","b"]}"#),
            Err(BodyError::UnsupportedPrompt)
        );
        assert_eq!(
            parse(r#"{"model":"m","prompt":[[1],[2]]}"#),
            Err(BodyError::UnsupportedPrompt)
        );
        assert_eq!(
            parse(r#"{"model":"m","prompt":[]}"#),
            Err(BodyError::UnsupportedPrompt)
        );
        assert_eq!(
            parse(r#"{"model":"m","prompt":""}"#),
            Err(BodyError::UnsupportedPrompt)
        );
        assert_eq!(
            parse(r#"{"model":"m","prompt":[-1]}"#),
            Err(BodyError::InvalidJson)
        );
        assert_eq!(parse(r#"{"prompt":"x"}"#), Err(BodyError::MissingModel));
        assert_eq!(parse(r#"{"model":"m"}"#), Err(BodyError::InvalidJson));
        assert_eq!(parse("{not json"), Err(BodyError::InvalidJson));
        assert_eq!(parse("[1,2]"), Err(BodyError::InvalidJson));
        assert_eq!(parse(""), Err(BodyError::InvalidJson));
    }

    #[test]
    fn mixed_or_out_of_range_prompts_are_invalid() {
        let parse = |json: &str| parse_body(Api::Completions, json.as_bytes());
        for prompt in [
            r#"[1,"a"]"#,
            r#"["a",1]"#,
            r#"[[1],"a"]"#,
            r#"[[1],[2,"x"]]"#,
            "[[[1]]]",
            "[4294967296]",
            "[1.0]",
            "[null]",
            "[true]",
            "5",
            "null",
            "{}",
        ] {
            assert_eq!(
                parse(&format!(r#"{{"model":"m","prompt":{prompt}}}"#)),
                Err(BodyError::InvalidJson),
                "prompt {prompt}"
            );
        }
        assert_eq!(
            parse(r#"{"model":"m","prompt":[[]]}"#),
            Err(BodyError::UnsupportedPrompt)
        );
        assert_eq!(
            parse(r#"{"model":"m","prompt":[""]}"#),
            Err(BodyError::UnsupportedPrompt)
        );
        assert_eq!(
            parse(r#"{"model":"m","prompt":"a\nb\u00e9"}"#).map(|parsed| parsed.input),
            Ok(PromptInput::Text("a\nbé".into()))
        );
        assert_eq!(
            parse(r#"{"model":"m","prompt":[[7,8,9]],"n":2}"#).map(|parsed| parsed.input),
            Ok(PromptInput::TokenIds(vec![7, 8, 9]))
        );
    }

    #[test]
    fn chat_content_of_other_shapes_is_invalid() {
        let parse = |json: &str| parse_body(Api::ChatCompletions, json.as_bytes());
        for content in ["5", "{}", "[1]", r#"[{"text":"no type"}]"#, r#""a"x"#] {
            assert_eq!(
                parse(&format!(
                    r#"{{"model":"m","messages":[{{"role":"user","content":{content}}}]}}"#
                )),
                Err(BodyError::InvalidJson),
                "content {content}"
            );
        }
        let parsed = parse(
            r#"{"model":"m","messages":[{"role":"user","content":[
                {"type":"text","text":"a\tb","cache_control":{"type":"ephemeral"}}
            ]}]}"#,
        );
        assert_eq!(
            parsed.map(typed_messages),
            Ok(vec![ChatMessage {
                role: "user".into(),
                content: "a\tb".into(),
            }])
        );
    }

    #[test]
    fn chat_content_strings_and_text_parts() {
        let parsed = parse_body(
            Api::ChatCompletions,
            br#"{"model":"m","messages":[
                {"role":"system","content":"be brief"},
                {"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},
                {"role":"assistant","content":null}
            ]}"#,
        );
        let expected = vec![
            ChatMessage {
                role: "system".into(),
                content: "be brief".into(),
            },
            ChatMessage {
                role: "user".into(),
                content: "a\nb".into(),
            },
            ChatMessage {
                role: "assistant".into(),
                content: String::new(),
            },
        ];
        assert_eq!(parsed.map(typed_messages), Ok(expected));
    }

    #[test]
    fn chat_rejections() {
        let parse = |json: &str| parse_body(Api::ChatCompletions, json.as_bytes());
        assert_eq!(
            parse(
                r#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}"#
            ),
            Err(BodyError::UnsupportedPrompt)
        );
        assert_eq!(
            parse(r#"{"model":"m","messages":[]}"#),
            Err(BodyError::UnsupportedPrompt)
        );
        assert_eq!(
            parse(r#"{"model":"m","messages":"hi"}"#),
            Err(BodyError::InvalidJson)
        );
        assert_eq!(
            parse(r#"{"model":"m","prompt":"hi"}"#),
            Err(BodyError::InvalidJson)
        );
        assert_eq!(
            parse(r#"{"model":"","messages":[{"role":"user","content":"x"}]}"#),
            Err(BodyError::MissingModel)
        );
    }

    /// A three-step agent turn: tools, an assistant tool call with `null`
    /// content, the tool's result, the model's follow-up call with no
    /// content at all, template kwargs and a salt.
    const AGENT_MESSAGES: &str = r#"[
        {"role": "system", "content": "You are a weather agent."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Z\u00fcrich?"}]},
        {"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Z\u00fcrich\", \"days\": 1.0e0}"}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "{\"temp\": 21}"}]},
        {"role": "assistant", "tool_calls": [
            {"id": "call_2", "type": "function",
             "function": {"name": "get_forecast", "arguments": {"city": "Zürich"}}}
        ]},
        {"role": "tool", "tool_call_id": "call_2", "name": "get_forecast", "content": "sunny"}
    ]"#;
    const AGENT_TOOLS: &str = r#"[{"type": "function", "function": {"name": "get_weather",
        "description": "Current weather", "parameters": {"type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "number", "maximum": 1E1}},
        "required": ["city"]}}},
        {"type": "function", "function": {"name": "get_forecast", "parameters": {}}}]"#;
    const AGENT_KWARGS: &str = r#"{ "enable_thinking" : false }"#;

    fn agent_body() -> String {
        format!(
            r#"{{"model": "llama-sql", "stream": true, "tool_choice": "auto",
                "messages": {AGENT_MESSAGES}, "tools": {AGENT_TOOLS},
                "chat_template_kwargs": {AGENT_KWARGS}, "temperature": 0.2,
                "cache_salt": "tenant-\u0041"}}"#
        )
    }

    #[test]
    fn agent_conversations_are_forwarded_verbatim() {
        let parsed =
            parse_body(Api::ChatCompletions, agent_body().as_bytes()).expect("an agent request");
        assert_eq!(parsed.cache_salt, "tenant-A");
        let request = lookup_request(&settings(), "acme", parsed).expect("routable");
        assert_eq!(request.messages_json, AGENT_MESSAGES);
        assert_eq!(request.tools_json, AGENT_TOOLS);
        assert_eq!(request.chat_template_kwargs_json, AGENT_KWARGS);
        assert_eq!(request.documents_json, "");
        assert_eq!(request.add_generation_prompt, None);
        assert!(!request.continue_final_message);
        assert_eq!(request.cache_salt, "tenant-A");
        assert_eq!(request.model_id, "llama");
        assert_eq!(request.adapter_id, "sql-lora");
        // Tool calls do not fit the structured messages: only the JSON goes.
        assert!(request.messages.is_empty());
        assert!(request.raw_prompt.is_empty());
        assert!(request.block_hashes.is_empty());
        assert!(request.token_ids.is_empty());
        // What goes on the wire decodes to the same fields.
        let decoded = LookupRouteRequest::decode(request.encode_to_vec().as_slice())
            .expect("a valid message");
        assert_eq!(decoded, request);
    }

    #[test]
    fn chat_options_are_copied_only_when_present() {
        let chat = |json: &str| match parse_body(Api::ChatCompletions, json.as_bytes()) {
            Ok(ParsedRequest {
                input: PromptInput::Chat(chat),
                ..
            }) => chat,
            other => panic!("not a chat request: {other:?}"),
        };
        let messages = r#"[{"role":"user","content":"hi"}]"#;
        let plain = chat(&format!(
            r#"{{"model":"m","messages":{messages},"tools":null,"documents":null,
                "chat_template_kwargs":null,"add_generation_prompt":true,"cache_salt":null}}"#
        ));
        assert_eq!(
            plain,
            ChatRequest {
                messages_json: messages.into(),
                messages: vec![ChatMessage {
                    role: "user".into(),
                    content: "hi".into(),
                }],
                add_generation_prompt: Some(true),
                ..ChatRequest::default()
            }
        );
        let documents = r#"[{"title":"a","text":"b"}]"#;
        let options = chat(&format!(
            r#"{{"model":"m","messages":{messages},"documents":{documents},
                "add_generation_prompt":false,"continue_final_message":true,"tools":[]}}"#
        ));
        assert_eq!(
            options,
            ChatRequest {
                messages_json: messages.into(),
                documents_json: documents.into(),
                tools_json: "[]".into(),
                add_generation_prompt: Some(false),
                continue_final_message: true,
                ..ChatRequest::default()
            }
        );
        // Text-like parts other than `text`, reasoning and names go only as JSON.
        for message in [
            r#"{"role":"user","content":[{"type":"input_text","text":"x"}]}"#,
            r#"{"role":"user","content":["bare"]}"#,
            r#"{"role":"assistant","content":"x","reasoning_content":"think"}"#,
            r#"{"role":"user","name":"ann","content":"x"}"#,
        ] {
            let parsed = chat(&format!(r#"{{"model":"m","messages":[{message}]}}"#));
            assert_eq!(parsed.messages_json, format!("[{message}]"));
            assert!(parsed.messages.is_empty(), "{message}");
        }
        // A text part without text is skipped, as the engine skips it.
        let parsed = chat(
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text"},{"type":"text","text":"y"}]}]}"#,
        );
        assert_eq!(parsed.messages[0].content, "y");
    }

    #[test]
    fn cache_salt_reaches_every_input_mode() {
        let tokens: Vec<u32> = (0..16).collect();
        for body in [
            format!(r#"{{"model":"m","prompt":{tokens:?},"cache_salt":"s1"}}"#),
            r#"{"model":"m","prompt":"hello","cache_salt":"s1"}"#.to_owned(),
        ] {
            let parsed = parse_body(Api::Completions, body.as_bytes()).expect("completions");
            let request = lookup_request(&settings(), "", parsed).expect("routable");
            assert_eq!(request.cache_salt, "s1", "{body}");
        }
        let request = lookup_request(
            &settings(),
            "",
            parse_body(Api::Completions, br#"{"model":"m","prompt":"x"}"#).expect("completions"),
        )
        .expect("routable");
        assert_eq!(request.cache_salt, "");
        assert_eq!(
            parse_body(
                Api::Completions,
                br#"{"model":"m","prompt":"x","cache_salt":7}"#
            ),
            Err(BodyError::InvalidJson)
        );
    }

    #[test]
    fn agent_body_rejections() {
        let parse = |json: &str| parse_body(Api::ChatCompletions, json.as_bytes());
        let user = r#"{"role":"user","content":"x"}"#;
        for extra in [
            r#""tools":{}"#,
            r#""tools":"x""#,
            r#""documents":{}"#,
            r#""chat_template_kwargs":[]"#,
            r#""chat_template_kwargs":true"#,
            r#""add_generation_prompt":"yes""#,
            r#""continue_final_message":1"#,
            r#""cache_salt":["a"]"#,
        ] {
            assert_eq!(
                parse(&format!(r#"{{"model":"m","messages":[{user}],{extra}}}"#)),
                Err(BodyError::InvalidJson),
                "{extra}"
            );
        }
        assert_eq!(
            parse(r#"{"model":"m","messages":null}"#),
            Err(BodyError::InvalidJson)
        );
        assert_eq!(
            parse(r#"{"model":"m","messages":[{"content":"no role"}]}"#),
            Err(BodyError::InvalidJson)
        );
        // Media anywhere in the conversation, even in a tool result, skips the lookup.
        for part in [
            r#"{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}}"#,
            r#"{"type":"input_audio","input_audio":{"data":"AAAA","format":"wav"}}"#,
            r#"{"type":"video_url","video_url":{"url":"x"}}"#,
        ] {
            assert_eq!(
                parse(&format!(
                    r#"{{"model":"m","tools":[],"messages":[{user},
                        {{"role":"tool","tool_call_id":"1","content":[{{"type":"text","text":"see"}},{part}]}}]}}"#
                )),
                Err(BodyError::UnsupportedPrompt),
                "{part}"
            );
        }
    }

    #[test]
    fn token_ids_become_the_fingerprint_chain() {
        let tokens: Vec<u32> = (0..40).collect();
        let request = lookup_request(
            &settings(),
            "acme",
            ParsedRequest {
                model: "llama-sql".into(),
                input: PromptInput::TokenIds(tokens.clone()),
                cache_salt: String::new(),
            },
        )
        .expect("routable");
        let expected: Vec<Vec<u8>> = prefix_hashes(&tokens, 16)
            .into_iter()
            .map(|hash| encode(hash).to_vec())
            .collect();
        assert_eq!(request.block_hashes, expected);
        assert_eq!(request.block_token_counts, vec![16, 16]);
        assert_eq!(request.model_id, "llama");
        assert_eq!(request.adapter_id, "sql-lora");
        assert_eq!(request.tenant_id, "acme");
        assert_eq!(request.hash_scheme, "vllm");
        assert!(request.token_ids.is_empty());
        assert!(request.raw_prompt.is_empty());
        // Design vector: tokens 1..=16, block 16.
        let request = lookup_request(
            &settings(),
            "",
            ParsedRequest {
                model: "m".into(),
                input: PromptInput::TokenIds((1..=16).collect()),
                cache_salt: String::new(),
            },
        )
        .expect("routable");
        assert_eq!(
            request.block_hashes,
            vec![16863443419780771464u64.to_be_bytes().to_vec()]
        );
    }

    #[test]
    fn short_token_prompts_are_not_looked_up() {
        let result = lookup_request(
            &settings(),
            "",
            ParsedRequest {
                model: "m".into(),
                input: PromptInput::TokenIds((0..15).collect()),
                cache_salt: String::new(),
            },
        );
        assert_eq!(result, Err(BodyError::PromptTooShort));
    }

    #[test]
    fn text_and_messages_go_to_the_server() {
        let request = lookup_request(
            &settings(),
            "t",
            ParsedRequest {
                model: "unmapped".into(),
                input: PromptInput::Text("hello".into()),
                cache_salt: String::new(),
            },
        )
        .expect("routable");
        assert_eq!(request.raw_prompt, "hello");
        assert_eq!(request.model_id, "unmapped");
        assert_eq!(request.adapter_id, "");
        assert!(request.block_hashes.is_empty());
        let messages = vec![ChatMessage {
            role: "user".into(),
            content: "hi".into(),
        }];
        let request = lookup_request(
            &settings(),
            "t",
            ParsedRequest {
                model: "m".into(),
                input: PromptInput::Chat(ChatRequest {
                    messages_json: r#"[{"role":"user","content":"hi"}]"#.into(),
                    messages: messages.clone(),
                    ..ChatRequest::default()
                }),
                cache_salt: String::new(),
            },
        )
        .expect("routable");
        assert_eq!(request.messages, messages);
        assert_eq!(request.messages_json, r#"[{"role":"user","content":"hi"}]"#);
        assert!(request.raw_prompt.is_empty());
    }
}
