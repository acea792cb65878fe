//! OpenAI chat requests turned into what a chat template sees, the way vLLM
//! prepares `/v1/chat/completions` before it calls `apply_chat_template`.
//!
//! The engine does not hand the request's messages to the template as they
//! arrive. It rebuilds every message (`vllm/entrypoints/chat_utils.py`,
//! `_parse_chat_message_content` and `_postprocess_messages`), validates the
//! tool definitions through its pydantic models, and merges the template
//! keyword arguments (`ChatCompletionRequest.build_chat_params`). The same
//! steps happen here, so the rendered text — and therefore every token —
//! matches the engine's:
//!
//! - **content**: a string, or a list of parts. With a template whose content
//!   format is *string* (it never loops over `message.content`), the text
//!   parts (`text`, `input_text`, `output_text`, `refusal`, `thinking`, bare
//!   strings) are joined with `"\n"`; with an *openai*-format template (it
//!   loops over the parts, e.g. Gemma 3) they stay a list of
//!   `{"type": "text", "text": …}` and a string becomes a one-part list.
//!   Images, audio and video are refused ([`TokenizeError::UnsupportedContent`]):
//!   their tokens come from the engine's multimodal processor.
//! - **tool calls** (assistant): copied; an empty list is dropped; each
//!   `function.arguments` given as a JSON string is parsed into its object
//!   (key order kept), an unparsable or missing one becomes `{}` — the
//!   templates print it with `tojson`.
//! - **keys** in vLLM's order: `role`, `content`, then `tool_calls`,
//!   `reasoning` and `reasoning_content` (assistant), `tool_call_id` (tool),
//!   `name`; a key is present only when the request had it, so `is defined`
//!   and `'tool_calls' in message` behave as in the engine.
//! - **tools**: each one as vLLM's `ChatCompletionToolsParam.model_dump()`
//!   lays it out — `{"type": "function", "function": {"name", "description",
//!   "parameters", …}}` with `description` / `parameters` present (as `null`)
//!   even when the client left them out, extra function fields kept after
//!   them, extra tool-level fields dropped.
//! - **kwargs**: `chat_template_kwargs` first, then the request's own
//!   `add_generation_prompt`, `continue_final_message` and `documents` over
//!   them (vLLM's `merge_kwargs`); names the engine itself refuses
//!   (`chat_template`, `tokenize`) or that collide with the template's own
//!   arguments (`messages`, `conversation`, `tools`) make the request invalid.

use crate::error::TokenizeError;
use serde_json::{Map, Value};

/// One chat message, as in an OpenAI `/v1/chat/completions` request.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, …
    pub role: String,
    /// The message text (used when [`content_parts`](Self::content_parts) is `None`;
    /// empty for a `null` content).
    pub content: String,
    /// The content as OpenAI content parts, when the request sent a list.
    pub content_parts: Option<Vec<Value>>,
    /// Assistant tool calls, OpenAI shape: `[{"id", "type": "function",
    /// "function": {"name", "arguments"}}]` (`arguments` a JSON string or an object).
    pub tool_calls: Option<Vec<Value>>,
    /// The tool call a `tool` message answers.
    pub tool_call_id: Option<String>,
    /// Participant or function name.
    pub name: Option<String>,
    /// Assistant reasoning sent back by the client (`reasoning` or the
    /// deprecated `reasoning_content`); templates see both names.
    pub reasoning: Option<String>,
}

impl ChatMessage {
    /// A message with the given role and text content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            ..Self::default()
        }
    }

    /// A message from its OpenAI request JSON (`{"role", "content", "tool_calls",
    /// "tool_call_id", "name", "reasoning" | "reasoning_content"}`).
    pub fn from_openai(message: &Value) -> Result<Self, TokenizeError> {
        let invalid = |what: &str| TokenizeError::InvalidRequest(format!("message {what}"));
        let object = message
            .as_object()
            .ok_or_else(|| invalid("is not an object"))?;
        let role = object
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| invalid("has no string role"))?;
        let mut out = Self::new(role, "");
        match object.get("content") {
            None | Some(Value::Null) => {}
            Some(Value::String(text)) => out.content.clone_from(text),
            Some(Value::Array(parts)) => out.content_parts = Some(parts.clone()),
            Some(_) => return Err(invalid("content is neither a string nor a list")),
        }
        match object.get("tool_calls") {
            None | Some(Value::Null) => {}
            Some(Value::Array(calls)) => out.tool_calls = Some(calls.clone()),
            Some(_) => return Err(invalid("tool_calls is not a list")),
        }
        let text_field = |key: &str| -> Result<Option<String>, TokenizeError> {
            match object.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(text)) => Ok(Some(text.clone())),
                Some(_) => Err(invalid(&format!("{key} is not a string"))),
            }
        };
        out.tool_call_id = text_field("tool_call_id")?;
        out.name = text_field("name")?;
        out.reasoning = match text_field("reasoning")? {
            Some(text) => Some(text),
            None => text_field("reasoning_content")?,
        };
        Ok(out)
    }
}

/// How a chat request is rendered beyond its messages.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatOptions {
    /// OpenAI tool definitions (`tools`), normalized as the engine does; `None`
    /// renders with `tools = none`.
    pub tools: Option<Vec<Value>>,
    /// RAG documents (`documents`), each an object of strings.
    pub documents: Option<Vec<Value>>,
    /// Append the assistant header (default true, as in the engine's request model).
    pub add_generation_prompt: bool,
    /// Leave the final message open so the model continues it.
    pub continue_final_message: bool,
    /// `chat_template_kwargs`: extra template variables (e.g. `enable_thinking`).
    pub template_kwargs: Map<String, Value>,
}

impl Default for ChatOptions {
    fn default() -> Self {
        Self {
            tools: None,
            documents: None,
            add_generation_prompt: true,
            continue_final_message: false,
            template_kwargs: Map::new(),
        }
    }
}

/// Whether a template reads `message.content` as a string or as a list of parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ContentFormat {
    /// Text parts joined with newlines into one string.
    String,
    /// A list of `{"type": "text", "text": …}` parts.
    OpenAi,
}

/// Template keyword arguments that collide with `apply_chat_template`'s own.
const RESERVED_KWARGS: [&str; 5] = [
    "chat_template",
    "tokenize",
    "messages",
    "conversation",
    "tools",
];

/// `apply_chat_template` parameters that never reach the template as variables.
const CALL_ONLY_KWARGS: [&str; 8] = [
    "continue_final_message",
    "return_dict",
    "return_assistant_tokens_mask",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "tokenizer_kwargs",
];

/// One content part, reduced to what a text-only template can see.
enum Part {
    Text(String),
    ToolReference(String),
}

/// The parts of one message's content.
fn content_parts(message: &ChatMessage) -> Result<Vec<Part>, TokenizeError> {
    let Some(parts) = &message.content_parts else {
        return Ok(vec![Part::Text(message.content.clone())]);
    };
    let mut out = Vec::with_capacity(parts.len());
    for part in parts {
        let object = match part {
            Value::String(text) => {
                out.push(Part::Text(text.clone()));
                continue;
            }
            Value::Object(object) => object,
            _ => {
                return Err(TokenizeError::InvalidRequest(
                    "content part is neither a string nor an object".to_owned(),
                ));
            }
        };
        let kind = object.get("type");
        let media = [
            "image_url",
            "image_pil",
            "image_embeds",
            "audio_embeds",
            "prompt_embeds",
            "audio_url",
            "input_audio",
            "video_url",
        ];
        let kind = match kind {
            Some(Value::String(kind)) if object.get("uuid").is_none_or(Value::is_null) => {
                kind.as_str()
            }
            None | Some(Value::Null) | Some(Value::String(_)) => {
                if let Some(key) = media.iter().find(|key| object.contains_key(**key)) {
                    return Err(TokenizeError::UnsupportedContent((*key).to_owned()));
                }
                if object.contains_key("tool_reference") {
                    return Err(TokenizeError::InvalidRequest(
                        "untyped tool_reference content part".to_owned(),
                    ));
                }
                return Err(TokenizeError::InvalidRequest(
                    "content part has no 'type'".to_owned(),
                ));
            }
            Some(_) => {
                return Err(TokenizeError::InvalidRequest(
                    "content part 'type' is not a string".to_owned(),
                ));
            }
        };
        let text_key = match kind {
            "text" | "input_text" | "output_text" => "text",
            "refusal" => "refusal",
            "thinking" => "thinking",
            "tool_reference" => {
                match object.get("name") {
                    Some(Value::String(name)) => out.push(Part::ToolReference(name.clone())),
                    _ => {
                        return Err(TokenizeError::InvalidRequest(
                            "tool_reference part without a name".to_owned(),
                        ));
                    }
                }
                continue;
            }
            "image_url" | "input_image" | "image_embeds" | "audio_embeds" | "prompt_embeds"
            | "image_pil" | "audio_url" | "input_audio" | "video_url" => {
                return Err(TokenizeError::UnsupportedContent(kind.to_owned()));
            }
            other => {
                return Err(TokenizeError::InvalidRequest(format!(
                    "unsupported content part type {other:?}"
                )));
            }
        };
        match object.get(text_key) {
            Some(Value::String(text)) => out.push(Part::Text(text.clone())),
            // vLLM skips text and refusal parts without content.
            None | Some(Value::Null) if matches!(kind, "text" | "refusal") => {}
            _ => {
                return Err(TokenizeError::InvalidRequest(format!(
                    "{kind} content part without a string {text_key:?}"
                )));
            }
        }
    }
    Ok(out)
}

/// The content value a template sees for `parts`.
fn content_value(parts: Vec<Part>, format: ContentFormat, role: &str) -> Value {
    match format {
        ContentFormat::String => {
            let texts: Vec<String> = parts
                .into_iter()
                .map(|part| match part {
                    Part::Text(text) | Part::ToolReference(text) => text,
                })
                .collect();
            Value::String(texts.join("\n"))
        }
        ContentFormat::OpenAi => {
            let all_text = parts.iter().all(|part| matches!(part, Part::Text(_)));
            if role == "tool" && all_text {
                // vLLM flattens text-only tool results back to a string.
                let texts: Vec<String> = parts
                    .into_iter()
                    .filter_map(|part| match part {
                        Part::Text(text) => Some(text),
                        Part::ToolReference(_) => None,
                    })
                    .collect();
                return Value::String(texts.join("\n"));
            }
            Value::Array(
                parts
                    .into_iter()
                    .map(|part| match part {
                        Part::Text(text) => serde_json::json!({"type": "text", "text": text}),
                        Part::ToolReference(name) => {
                            serde_json::json!({"type": "tool_reference", "name": name})
                        }
                    })
                    .collect(),
            )
        }
    }
}

/// An assistant's tool calls as the template sees them, or `None` when there are none.
fn tool_calls_value(calls: &[Value]) -> Result<Option<Value>, TokenizeError> {
    if calls.is_empty() {
        return Ok(None);
    }
    let mut out = Vec::with_capacity(calls.len());
    for call in calls {
        let mut call = call.clone();
        let function = call
            .get_mut("function")
            .and_then(Value::as_object_mut)
            .ok_or_else(|| {
                TokenizeError::InvalidRequest("tool call without a function object".to_owned())
            })?;
        let arguments = match function.get("arguments") {
            Some(Value::String(text)) => {
                serde_json::from_str::<Value>(text).unwrap_or_else(|_| Value::Object(Map::new()))
            }
            Some(value @ (Value::Object(_) | Value::Array(_))) => value.clone(),
            _ => Value::Object(Map::new()),
        };
        function.insert("arguments".to_owned(), arguments);
        out.push(call);
    }
    Ok(Some(Value::Array(out)))
}

/// The conversation a template sees, one JSON object per message.
pub(crate) fn conversation(
    messages: &[ChatMessage],
    format: ContentFormat,
) -> Result<Vec<Value>, TokenizeError> {
    let mut out = Vec::with_capacity(messages.len());
    for message in messages {
        let mut object = Map::new();
        object.insert("role".to_owned(), Value::String(message.role.clone()));
        let parts = content_parts(message)?;
        object.insert(
            "content".to_owned(),
            content_value(parts, format, &message.role),
        );
        match message.role.as_str() {
            "assistant" => {
                if let Some(calls) = &message.tool_calls
                    && let Some(calls) = tool_calls_value(calls)?
                {
                    object.insert("tool_calls".to_owned(), calls);
                }
                if let Some(reasoning) = &message.reasoning {
                    object.insert("reasoning".to_owned(), Value::String(reasoning.clone()));
                    object.insert(
                        "reasoning_content".to_owned(),
                        Value::String(reasoning.clone()),
                    );
                }
            }
            "tool" => {
                if let Some(id) = &message.tool_call_id {
                    object.insert("tool_call_id".to_owned(), Value::String(id.clone()));
                }
            }
            _ => {}
        }
        if let Some(name) = &message.name {
            object.insert("name".to_owned(), Value::String(name.clone()));
        }
        if message.role == "developer" {
            object.insert("tools".to_owned(), Value::Null);
        }
        out.push(Value::Object(object));
    }
    Ok(out)
}

/// Tool definitions laid out as the engine's request model dumps them.
pub(crate) fn normalize_tools(tools: &[Value]) -> Result<Vec<Value>, TokenizeError> {
    let invalid = |what: &str| TokenizeError::InvalidRequest(format!("tool {what}"));
    let mut out = Vec::with_capacity(tools.len());
    for tool in tools {
        let tool = tool
            .as_object()
            .ok_or_else(|| invalid("is not an object"))?;
        match tool.get("type") {
            None => {}
            Some(Value::String(kind)) if kind == "function" => {}
            Some(_) => return Err(invalid("type is not \"function\"")),
        }
        let function = tool
            .get("function")
            .and_then(Value::as_object)
            .ok_or_else(|| invalid("has no function object"))?;
        let name = match function.get("name") {
            Some(Value::String(name)) => name.clone(),
            _ => return Err(invalid("function has no string name")),
        };
        let description = match function.get("description") {
            None | Some(Value::Null) => Value::Null,
            Some(Value::String(text)) => Value::String(text.clone()),
            Some(_) => return Err(invalid("description is not a string")),
        };
        let parameters = match function.get("parameters") {
            None | Some(Value::Null) => Value::Null,
            Some(value @ Value::Object(_)) => value.clone(),
            Some(_) => return Err(invalid("parameters is not an object")),
        };
        let tool_defer = match tool.get("defer_loading") {
            None | Some(Value::Null) => None,
            Some(Value::Bool(flag)) => Some(*flag),
            Some(_) => return Err(invalid("defer_loading is not a boolean")),
        };
        let defer = match function.get("defer_loading") {
            None | Some(Value::Null) => tool_defer,
            Some(Value::Bool(flag)) => Some(*flag),
            Some(_) => return Err(invalid("defer_loading is not a boolean")),
        };
        let mut dumped = Map::new();
        dumped.insert("name".to_owned(), Value::String(name));
        dumped.insert("description".to_owned(), description);
        dumped.insert("parameters".to_owned(), parameters);
        if let Some(flag) = defer {
            dumped.insert("defer_loading".to_owned(), Value::Bool(flag));
        }
        for (key, value) in function {
            if !matches!(
                key.as_str(),
                "name" | "description" | "parameters" | "defer_loading"
            ) {
                dumped.insert(key.clone(), value.clone());
            }
        }
        let mut wrapped = Map::new();
        wrapped.insert("type".to_owned(), Value::String("function".to_owned()));
        wrapped.insert("function".to_owned(), Value::Object(dumped));
        if let Some(flag) = tool_defer {
            wrapped.insert("defer_loading".to_owned(), Value::Bool(flag));
        }
        out.push(Value::Object(wrapped));
    }
    Ok(out)
}

/// Checks `documents`: a list of objects whose values are strings.
pub(crate) fn check_documents(documents: &[Value]) -> Result<(), TokenizeError> {
    for document in documents {
        let object = document
            .as_object()
            .ok_or_else(|| TokenizeError::InvalidRequest("document is not an object".to_owned()))?;
        if !object.values().all(Value::is_string) {
            return Err(TokenizeError::InvalidRequest(
                "document values must be strings".to_owned(),
            ));
        }
    }
    Ok(())
}

/// The template variables of a request other than `messages` and `tools`:
/// `chat_template_kwargs` with the request's own `add_generation_prompt` and
/// `documents` over them (`continue_final_message` and the other
/// `apply_chat_template` call parameters are not template variables).
pub(crate) fn template_variables(
    options: &ChatOptions,
) -> Result<Map<String, Value>, TokenizeError> {
    if options.continue_final_message && options.add_generation_prompt {
        return Err(TokenizeError::InvalidRequest(
            "continue_final_message and add_generation_prompt cannot both be set".to_owned(),
        ));
    }
    let mut variables = Map::new();
    for (key, value) in &options.template_kwargs {
        if RESERVED_KWARGS.contains(&key.as_str()) {
            return Err(TokenizeError::InvalidRequest(format!(
                "chat_template_kwargs may not set {key:?}"
            )));
        }
        if CALL_ONLY_KWARGS.contains(&key.as_str()) {
            continue;
        }
        variables.insert(key.clone(), value.clone());
    }
    variables.insert(
        "add_generation_prompt".to_owned(),
        Value::Bool(options.add_generation_prompt),
    );
    match &options.documents {
        Some(documents) => {
            check_documents(documents)?;
            variables.insert("documents".to_owned(), Value::Array(documents.clone()));
        }
        None => {
            variables.entry("documents").or_insert(Value::Null);
        }
    }
    Ok(variables)
}

/// The text `transformers` appends to the final message to find where it ends.
pub(crate) const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// Marks the final message for `continue_final_message`; returns its text.
pub(crate) fn mark_final_message(conversation: &mut [Value]) -> Result<String, TokenizeError> {
    let missing = || {
        TokenizeError::InvalidRequest(
            "continue_final_message is set but there is no text to continue".to_owned(),
        )
    };
    let last = conversation.last_mut().ok_or_else(missing)?;
    let content = last.get_mut("content").ok_or_else(missing)?;
    match content {
        Value::String(text) => {
            let original = text.clone();
            text.push_str(CONTINUE_TAG);
            Ok(original)
        }
        Value::Array(parts) => {
            for part in parts.iter_mut().rev() {
                if let Some(Value::String(text)) = part.get_mut("text") {
                    let original = text.clone();
                    text.push_str(CONTINUE_TAG);
                    return Ok(original);
                }
            }
            Err(missing())
        }
        _ => Err(missing()),
    }
}

/// Cuts the rendered text right after the final message, as `transformers` does.
pub(crate) fn cut_after_final_message(
    rendered: String,
    final_message: &str,
) -> Result<String, TokenizeError> {
    let tag = CONTINUE_TAG.trim_end();
    let final_stripped = crate::chat_template::py_strip_str(final_message);
    if !rendered.contains(final_stripped) || !rendered.contains(tag) {
        return Err(TokenizeError::InvalidRequest(
            "continue_final_message is set but the final message does not appear in the rendered chat"
                .to_owned(),
        ));
    }
    let Some(at) = rendered.rfind(tag) else {
        return Err(TokenizeError::InvalidRequest(
            "continue_final_message tag lost".to_owned(),
        ));
    };
    if rendered[at..].starts_with(CONTINUE_TAG) {
        let mut rendered = rendered;
        rendered.truncate(at);
        Ok(rendered)
    } else {
        Ok(crate::chat_template::py_rstrip_str(&rendered[..at]).to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn messages_are_rebuilt_as_vllm_does() {
        let messages = [
            ChatMessage::from_openai(&json!({"role": "user", "content": [
                {"type": "text", "text": "a"}, "b", {"type": "text", "text": null}, {"type": "input_text", "text": "c"}
            ], "name": "ann"}))
            .expect("user"),
            ChatMessage::from_openai(&json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"z\": 1, \"a\": [1.0, \"é\"]}"}},
                {"id": "2", "type": "function", "function": {"name": "g", "arguments": "not json"}},
                {"id": "3", "type": "function", "function": {"name": "h"}}
            ], "reasoning_content": "hmm"}))
            .expect("assistant"),
            ChatMessage::from_openai(&json!({"role": "assistant", "content": "x", "tool_calls": []}))
                .expect("assistant without calls"),
            ChatMessage::from_openai(&json!({"role": "tool", "tool_call_id": "1", "content": [{"type": "text", "text": "42"}]}))
                .expect("tool"),
        ];
        let rebuilt = conversation(&messages, ContentFormat::String).expect("text only");
        assert_eq!(
            Value::Array(rebuilt),
            json!([
                {"role": "user", "content": "a\nb\nc", "name": "ann"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "1", "type": "function", "function": {"name": "f", "arguments": {"z": 1, "a": [1.0, "é"]}}},
                    {"id": "2", "type": "function", "function": {"name": "g", "arguments": {}}},
                    {"id": "3", "type": "function", "function": {"name": "h", "arguments": {}}}
                ], "reasoning": "hmm", "reasoning_content": "hmm"},
                {"role": "assistant", "content": "x"},
                {"role": "tool", "content": "42", "tool_call_id": "1"}
            ])
        );
        let listed = conversation(&messages[..1], ContentFormat::OpenAi).expect("text only");
        assert_eq!(
            listed[0]["content"],
            json!([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}, {"type": "text", "text": "c"}])
        );
        let tool = conversation(&messages[3..], ContentFormat::OpenAi).expect("text only");
        assert_eq!(tool[0]["content"], json!("42"));
    }

    #[test]
    fn media_parts_are_refused() {
        let message = ChatMessage::from_openai(&json!({"role": "user", "content": [
            {"type": "text", "text": "what is this"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        ]}))
        .expect("parses");
        assert_eq!(
            conversation(&[message], ContentFormat::String),
            Err(TokenizeError::UnsupportedContent("image_url".to_owned()))
        );
        let message =
            ChatMessage::from_openai(&json!({"role": "user", "content": [{"nothing": 1}]}))
                .expect("parses");
        assert!(matches!(
            conversation(&[message], ContentFormat::String),
            Err(TokenizeError::InvalidRequest(_))
        ));
    }

    #[test]
    fn tools_are_dumped_like_the_request_model() {
        let tools = normalize_tools(&[json!({
            "function": {"strict": true, "name": "f", "parameters": {"type": "object"}},
            "type": "function",
            "extra": 1
        })])
        .expect("valid");
        assert_eq!(
            serde_json::to_string(&tools).expect("json"),
            r#"[{"type":"function","function":{"name":"f","description":null,"parameters":{"type":"object"},"strict":true}}]"#
        );
        assert!(
            normalize_tools(&[json!({"type": "retrieval", "function": {"name": "f"}})]).is_err()
        );
        assert!(normalize_tools(&[json!({"function": {"description": "no name"}})]).is_err());
    }

    #[test]
    fn kwargs_merge_and_conflicts() {
        let mut options = ChatOptions::default();
        options
            .template_kwargs
            .insert("enable_thinking".into(), json!(false));
        options
            .template_kwargs
            .insert("add_generation_prompt".into(), json!(false));
        options
            .template_kwargs
            .insert("documents".into(), json!([{"title": "t", "text": "x"}]));
        let variables = template_variables(&options).expect("valid");
        assert_eq!(variables["enable_thinking"], json!(false));
        // The request's own field wins over a kwarg of the same name.
        assert_eq!(variables["add_generation_prompt"], json!(true));
        // documents from the kwargs survive when the request sets none.
        assert_eq!(variables["documents"], json!([{"title": "t", "text": "x"}]));

        options.template_kwargs.insert("tools".into(), json!([]));
        assert!(template_variables(&options).is_err());
        let options = ChatOptions {
            continue_final_message: true,
            ..ChatOptions::default()
        };
        assert!(template_variables(&options).is_err());
    }

    #[test]
    fn continue_final_message_cut() {
        let mut conv = vec![json!({"role": "assistant", "content": "The answer is"})];
        let final_message = mark_final_message(&mut conv).expect("text");
        assert_eq!(
            conv[0]["content"],
            json!("The answer isCONTINUE_FINAL_MESSAGE_TAG ")
        );
        let rendered = "<a>The answer isCONTINUE_FINAL_MESSAGE_TAG</a>\n".to_owned();
        assert_eq!(
            cut_after_final_message(rendered, &final_message).expect("found"),
            "<a>The answer is"
        );
        let kept = "<a>The answer is CONTINUE_FINAL_MESSAGE_TAG more".to_owned();
        assert_eq!(
            cut_after_final_message(kept, "The answer is ").expect("found"),
            "<a>The answer is "
        );
    }
}
