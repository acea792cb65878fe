//! Request classification, OpenAI body parsing and the `LookupRouteRequest` built from them.
//!
//! Only `POST /v1/completions` and `POST /v1/chat/completions` are looked up;
//! everything else passes untouched. The body is parsed with serde into the
//! few fields routing needs (`model`, `prompt` or `messages`) and unknown
//! fields are ignored. A token-id prompt is fingerprinted here with the
//! shared `fingerprint` crate (so the server sees exactly the chain the
//! engine will cache); a string prompt goes as `raw_prompt` and a chat
//! conversation as `messages`, which the server tokenizes. Nothing here
//! panics on request data: every malformed shape is a [`BodyError`].
//! Cost: one pass over the body, plus one hash per 16 tokens. The fields
//! that take several shapes (`prompt`, a message's `content`) are read by
//! hand-written visitors that pick the shape from the first JSON token, so
//! a prompt is decoded once, straight into its final type, instead of being
//! buffered and re-read per candidate shape; fields the filter does not use
//! (images, sampling parameters) are skipped without being copied.

use std::fmt;

use inference_cache_fingerprint::request_chain;
use inference_cache_proto::v1alpha1::{ChatMessage, LookupRouteRequest};
use serde::Deserialize;
use serde::de::value::SeqAccessDeserializer;
use serde::de::{self, Deserializer, SeqAccess, Visitor};

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
}

/// A prompt in the form the lookup carries it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptInput {
    /// Token ids, fingerprinted by the filter.
    TokenIds(Vec<u32>),
    /// A completions string prompt (`raw_prompt`).
    Text(String),
    /// A chat conversation (`messages`).
    Messages(Vec<ChatMessage>),
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
struct ChatBody {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    messages: Option<Vec<ChatTurn>>,
}

#[derive(Deserialize)]
struct ChatTurn {
    role: String,
    #[serde(default)]
    content: Option<ContentField>,
}

/// A message's `content`: a string or a list of typed parts.
enum ContentField {
    Text(String),
    Parts(Vec<ContentPart>),
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
        Vec::<ContentPart>::deserialize(SeqAccessDeserializer::new(seq)).map(ContentField::Parts)
    }
}

#[derive(Deserialize)]
struct ContentPart {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: Option<String>,
}

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
        _ => Ok(ParsedRequest { model, input }),
    }
}

fn parse_chat(body: &[u8]) -> Result<ParsedRequest, BodyError> {
    let parsed: ChatBody = serde_json::from_slice(body).map_err(|_| BodyError::InvalidJson)?;
    let model = model_of(parsed.model)?;
    let turns = parsed.messages.ok_or(BodyError::InvalidJson)?;
    if turns.is_empty() {
        return Err(BodyError::UnsupportedPrompt);
    }
    let mut messages = Vec::with_capacity(turns.len());
    for turn in turns {
        let content = match turn.content {
            None => String::new(),
            Some(ContentField::Text(text)) => text,
            Some(ContentField::Parts(parts)) => text_of_parts(parts)?,
        };
        messages.push(ChatMessage {
            role: turn.role,
            content,
        });
    }
    Ok(ParsedRequest {
        model,
        input: PromptInput::Messages(messages),
    })
}

/// Text parts joined by newlines, as OpenAI-compatible engines flatten them
/// for string-content chat templates; any non-text part makes the prompt
/// unroutable (its tokens depend on the engine's multimodal processing).
fn text_of_parts(parts: Vec<ContentPart>) -> Result<String, BodyError> {
    let mut texts = Vec::with_capacity(parts.len());
    for part in parts {
        match (part.kind.as_str(), part.text) {
            ("text", Some(text)) => texts.push(text),
            _ => return Err(BodyError::UnsupportedPrompt),
        }
    }
    Ok(texts.join("\n"))
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
        PromptInput::Messages(messages) => request.messages = messages,
    }
    Ok(request)
}

#[cfg(test)]
mod tests {
    use super::*;
    use inference_cache_fingerprint::{encode, prefix_hashes};

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
                input: PromptInput::Text("hello".into())
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
            parsed.map(|parsed| parsed.input),
            Ok(PromptInput::Messages(vec![ChatMessage {
                role: "user".into(),
                content: "a\tb".into(),
            }]))
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
        assert_eq!(
            parsed.map(|parsed| parsed.input),
            Ok(PromptInput::Messages(expected))
        );
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

    #[test]
    fn token_ids_become_the_fingerprint_chain() {
        let tokens: Vec<u32> = (0..40).collect();
        let request = lookup_request(
            &settings(),
            "acme",
            ParsedRequest {
                model: "llama-sql".into(),
                input: PromptInput::TokenIds(tokens.clone()),
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
                input: PromptInput::Messages(messages.clone()),
            },
        )
        .expect("routable");
        assert_eq!(request.messages, messages);
        assert!(request.raw_prompt.is_empty());
    }
}
