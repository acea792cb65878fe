//! PromptTemplate files: loading, `template_ref` resolution and strict rendering.
//!
//! A template file is YAML (one or more documents per `.yaml` / `.yml` file):
//!
//! ```yaml
//! name: rag-answer
//! revision: 2              # integer >= 1
//! description: optional free text
//! body: |
//!   You answer from the documents below.
//!   {{ documents }}
//!   Question: {{ question }}
//! slots:
//!   - { name: documents, type: Stable, required: true }
//!   - { name: question, type: Mutable }   # required defaults to true
//! ```
//!
//! The body language is deliberately small: literal text plus `{{ slot }}`
//! placeholders (no logic, no filters), so output is a pure concatenation and
//! the stable prefix has an exact byte boundary. Every placeholder must name a
//! declared slot and every slot must appear in the body; a `{{` that does not
//! open a valid placeholder is a load error. Slot values are inserted verbatim
//! and never re-parsed.
//!
//! Resolution: `template_ref` is `name` (the *latest* revision, i.e. the
//! numerically highest) or `name@revision` (exactly that one). A name and
//! revision may be defined once across the directory.
//!
//! Rendering is strict: a missing required slot is an error naming the slot, and
//! a variable that is not a slot of the template is an error naming the
//! variable (a typo must not silently drop caller content). An optional slot
//! that is not given renders as the empty string.
//!
//! The *stable prefix* is the rendered text before the first `Mutable` slot's
//! output (the whole text when there is none); its hash is XXH3-64 with seed
//! 1337 of those bytes, in 8-byte big-endian wire form, so requests that differ
//! only in mutable slots share it. The same store, reference and variables
//! always give byte-identical output.
//!
//! Concurrency and cost: a [`TemplateStore`] is immutable once loaded and
//! `Send + Sync` (reload by loading a new store and swapping it in); rendering
//! is one pass over pre-parsed segments, linear in the output size.

use serde::Deserialize;
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Whether a slot's value is shared across requests or changes per request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum SlotKind {
    /// Shared by many requests (system text, documents): part of the stable prefix.
    Stable,
    /// Per request (the question, the diff): ends the stable prefix.
    Mutable,
}

/// A declared template slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot {
    /// Name used in `{{ name }}` and in the request's variables.
    pub name: String,
    /// Stable or Mutable.
    pub kind: SlotKind,
    /// Whether rendering fails when the value is absent.
    pub required: bool,
}

/// A piece of a parsed body.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Text(String),
    /// Index into the template's slots.
    Slot(usize),
}

/// One revision of one template, parsed and validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptTemplate {
    name: String,
    revision: u64,
    description: Option<String>,
    slots: Vec<Slot>,
    segments: Vec<Segment>,
    /// The file the template came from.
    source: PathBuf,
}

/// The output of rendering a template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenderedPrompt {
    /// Template name.
    pub name: String,
    /// The revision that was rendered.
    pub revision: u64,
    /// The rendered prompt.
    pub text: String,
    /// Byte length of the stable prefix of `text`.
    pub stable_prefix_len: usize,
    /// 8-byte big-endian XXH3-64 (seed 1337) of `text[..stable_prefix_len]`.
    pub stable_prefix_hash: [u8; 8],
}

impl RenderedPrompt {
    /// The stable prefix of the rendered text.
    pub fn stable_prefix(&self) -> &str {
        self.text
            .get(..self.stable_prefix_len)
            .unwrap_or(&self.text)
    }
}

/// Why a template directory or file could not be loaded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TemplateLoadError {
    /// A directory or file could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        /// The path.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A document is not valid YAML or does not have the PromptTemplate shape.
    #[error("{} (document {document}): {message}", path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// 1-based document index within the file.
        document: usize,
        /// What the YAML parser reported.
        message: String,
    },
    /// A template is well-formed YAML but violates a rule.
    #[error("{} template {name:?}: {message}", path.display())]
    Invalid {
        /// The file.
        path: PathBuf,
        /// The template name as written.
        name: String,
        /// Which rule, naming the field.
        message: String,
    },
    /// The same name and revision are defined twice.
    #[error("template {name}@{revision} is defined in both {} and {}", first.display(), second.display())]
    Duplicate {
        /// Template name.
        name: String,
        /// Revision.
        revision: u64,
        /// The first definition.
        first: PathBuf,
        /// The second definition.
        second: PathBuf,
    },
}

/// Why a render request failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RenderError {
    /// No template (or no such revision) matches the reference, or the
    /// reference is malformed.
    #[error("template {template_ref:?} not found")]
    TemplateNotFound {
        /// The reference as given.
        template_ref: String,
    },
    /// A required slot has no value.
    #[error("template {template}: required slot {slot:?} has no value")]
    MissingSlot {
        /// `name@revision` of the template.
        template: String,
        /// The slot.
        slot: String,
    },
    /// A variable does not name a slot of the template.
    #[error("template {template}: unknown variable {variable:?}")]
    UnknownVariable {
        /// `name@revision` of the template.
        template: String,
        /// The variable.
        variable: String,
    },
}

impl RenderError {
    /// True for [`RenderError::TemplateNotFound`] (TEMPLATE_NOT_FOUND on the
    /// wire); every other error is a render error.
    pub fn is_not_found(&self) -> bool {
        matches!(self, Self::TemplateNotFound { .. })
    }
}

/// Every template revision of a directory, by name then revision.
#[derive(Debug, Clone, Default)]
pub struct TemplateStore {
    templates: BTreeMap<String, BTreeMap<u64, Arc<PromptTemplate>>>,
}

/// A YAML document as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TemplateFile {
    name: String,
    revision: u64,
    #[serde(default)]
    description: Option<String>,
    body: String,
    #[serde(default)]
    slots: Vec<SlotFile>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SlotFile {
    name: String,
    #[serde(rename = "type")]
    kind: SlotKind,
    #[serde(default = "default_required")]
    required: bool,
}

fn default_required() -> bool {
    true
}

impl TemplateStore {
    /// Loads every `.yaml` / `.yml` file of `dir` (not recursive), in name
    /// order. Any invalid file fails the whole load, so a reload can keep the
    /// previous store.
    pub fn load_dir(dir: &Path) -> Result<Self, TemplateLoadError> {
        let io_error = |source| TemplateLoadError::Io {
            path: dir.to_path_buf(),
            source,
        };
        let mut files = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(io_error)? {
            let path = entry.map_err(io_error)?.path();
            let yaml = path
                .extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| e == "yaml" || e == "yml");
            if yaml && path.is_file() {
                files.push(path);
            }
        }
        files.sort();
        let mut store = Self::default();
        for path in files {
            let text = std::fs::read_to_string(&path).map_err(|source| TemplateLoadError::Io {
                path: path.clone(),
                source,
            })?;
            store.add_yaml(&text, &path)?;
        }
        Ok(store)
    }

    /// Parses templates from YAML text; `origin` names the source in errors.
    pub fn from_yaml(text: &str, origin: &Path) -> Result<Self, TemplateLoadError> {
        let mut store = Self::default();
        store.add_yaml(text, origin)?;
        Ok(store)
    }

    fn add_yaml(&mut self, text: &str, path: &Path) -> Result<(), TemplateLoadError> {
        for (index, document) in serde_yaml::Deserializer::from_str(text).enumerate() {
            let file =
                TemplateFile::deserialize(document).map_err(|err| TemplateLoadError::Parse {
                    path: path.to_path_buf(),
                    document: index + 1,
                    message: err.to_string(),
                })?;
            let template = PromptTemplate::from_file(file, path)?;
            let versions = self.templates.entry(template.name.clone()).or_default();
            if let Some(existing) = versions.get(&template.revision) {
                return Err(TemplateLoadError::Duplicate {
                    name: template.name.clone(),
                    revision: template.revision,
                    first: existing.source.clone(),
                    second: template.source.clone(),
                });
            }
            versions.insert(template.revision, Arc::new(template));
        }
        Ok(())
    }

    /// Resolves `name` (latest revision) or `name@revision`.
    pub fn get(&self, template_ref: &str) -> Result<&Arc<PromptTemplate>, RenderError> {
        let not_found = || RenderError::TemplateNotFound {
            template_ref: template_ref.to_owned(),
        };
        let (name, revision) = match template_ref.split_once('@') {
            None => (template_ref, None),
            Some((name, revision)) => (
                name,
                Some(revision.parse::<u64>().map_err(|_| not_found())?),
            ),
        };
        let versions = self.templates.get(name).ok_or_else(not_found)?;
        let found = match revision {
            Some(revision) => versions.get(&revision),
            None => versions.values().next_back(),
        };
        found.ok_or_else(not_found)
    }

    /// Renders the template `template_ref` resolves to with `variables`.
    pub fn render(
        &self,
        template_ref: &str,
        variables: &HashMap<String, String>,
    ) -> Result<RenderedPrompt, RenderError> {
        self.get(template_ref)?.render(variables)
    }

    /// All templates as `(name, revisions in ascending order)`, names sorted.
    pub fn list(&self) -> Vec<(&str, Vec<u64>)> {
        self.templates
            .iter()
            .map(|(name, versions)| (name.as_str(), versions.keys().copied().collect()))
            .collect()
    }

    /// Number of template revisions.
    pub fn len(&self) -> usize {
        self.templates.values().map(BTreeMap::len).sum()
    }

    /// True when no template is loaded.
    pub fn is_empty(&self) -> bool {
        self.templates.is_empty()
    }
}

impl PromptTemplate {
    fn from_file(file: TemplateFile, path: &Path) -> Result<Self, TemplateLoadError> {
        let invalid = |message: String| TemplateLoadError::Invalid {
            path: path.to_path_buf(),
            name: file.name.clone(),
            message,
        };
        if file.name.is_empty()
            || file.name.contains('@')
            || file
                .name
                .chars()
                .any(|c| c.is_whitespace() || c.is_control())
        {
            return Err(invalid(
                "name: must be non-empty, without '@' or whitespace".to_owned(),
            ));
        }
        if file.revision == 0 {
            return Err(invalid("revision: must be an integer >= 1".to_owned()));
        }
        let mut slot_index: HashMap<&str, usize> = HashMap::new();
        for (index, slot) in file.slots.iter().enumerate() {
            if !is_identifier(&slot.name) {
                return Err(invalid(format!(
                    "slots[{index}].name: {:?} is not an identifier ([A-Za-z_][A-Za-z0-9_]*)",
                    slot.name
                )));
            }
            if slot_index.insert(slot.name.as_str(), index).is_some() {
                return Err(invalid(format!(
                    "slots[{index}].name: {:?} is declared twice",
                    slot.name
                )));
            }
        }
        let segments = parse_body(&file.body, &slot_index)
            .map_err(|message| invalid(format!("body: {message}")))?;
        for (index, slot) in file.slots.iter().enumerate() {
            if !segments.contains(&Segment::Slot(index)) {
                return Err(invalid(format!(
                    "slots[{index}]: {:?} is not used in the body",
                    slot.name
                )));
            }
        }
        Ok(Self {
            slots: file
                .slots
                .into_iter()
                .map(|slot| Slot {
                    name: slot.name,
                    kind: slot.kind,
                    required: slot.required,
                })
                .collect(),
            name: file.name,
            revision: file.revision,
            description: file.description,
            segments,
            source: path.to_path_buf(),
        })
    }

    /// Template name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Revision number.
    pub fn revision(&self) -> u64 {
        self.revision
    }

    /// Optional description.
    pub fn description(&self) -> Option<&str> {
        self.description.as_deref()
    }

    /// Declared slots, in declaration order.
    pub fn slots(&self) -> &[Slot] {
        &self.slots
    }

    /// The file the template was loaded from.
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// Renders strictly (see the module docs) and computes the stable prefix hash.
    pub fn render(
        &self,
        variables: &HashMap<String, String>,
    ) -> Result<RenderedPrompt, RenderError> {
        // Report the first unknown variable in name order, so errors are deterministic.
        let mut unknown: Vec<&String> = variables
            .keys()
            .filter(|key| !self.slots.iter().any(|slot| &slot.name == *key))
            .collect();
        unknown.sort();
        if let Some(variable) = unknown.first() {
            return Err(RenderError::UnknownVariable {
                template: self.to_string(),
                variable: (*variable).clone(),
            });
        }
        for slot in &self.slots {
            if slot.required && !variables.contains_key(&slot.name) {
                return Err(RenderError::MissingSlot {
                    template: self.to_string(),
                    slot: slot.name.clone(),
                });
            }
        }
        let mut text = String::new();
        let mut stable_prefix_len = None;
        for segment in &self.segments {
            match segment {
                Segment::Text(literal) => text.push_str(literal),
                Segment::Slot(index) => {
                    let slot = &self.slots[*index];
                    if slot.kind == SlotKind::Mutable && stable_prefix_len.is_none() {
                        stable_prefix_len = Some(text.len());
                    }
                    if let Some(value) = variables.get(&slot.name) {
                        text.push_str(value);
                    }
                }
            }
        }
        let stable_prefix_len = stable_prefix_len.unwrap_or(text.len());
        let hash = inference_cache_fingerprint::text_hash(&text.as_bytes()[..stable_prefix_len]);
        Ok(RenderedPrompt {
            name: self.name.clone(),
            revision: self.revision,
            text,
            stable_prefix_len,
            stable_prefix_hash: inference_cache_fingerprint::encode(hash),
        })
    }
}

impl fmt::Display for PromptTemplate {
    /// `name@revision`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}", self.name, self.revision)
    }
}

fn is_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Splits a body into literal text and `{{ slot }}` placeholders.
fn parse_body(body: &str, slots: &HashMap<&str, usize>) -> Result<Vec<Segment>, String> {
    let mut segments = Vec::new();
    let mut rest = body;
    let mut offset = 0;
    while let Some(open) = rest.find("{{") {
        if open > 0 {
            segments.push(Segment::Text(rest[..open].to_owned()));
        }
        let after = &rest[open + 2..];
        let close = after
            .find("}}")
            .ok_or_else(|| format!("unterminated '{{{{' at byte {}", offset + open))?;
        let name = after[..close].trim();
        if !is_identifier(name) {
            return Err(format!(
                "invalid placeholder {{{{{}}}}} at byte {}",
                &after[..close],
                offset + open
            ));
        }
        let index = *slots
            .get(name)
            .ok_or_else(|| format!("placeholder {{{{ {name} }}}} names no declared slot"))?;
        segments.push(Segment::Slot(index));
        let consumed = open + 2 + close + 2;
        offset += consumed;
        rest = &rest[consumed..];
    }
    if !rest.is_empty() {
        segments.push(Segment::Text(rest.to_owned()));
    }
    Ok(segments)
}

#[cfg(test)]
mod tests {
    use super::*;

    const RAG_V1: &str = r#"
name: rag
revision: 1
body: "Docs: {{ docs }}\nQ: {{ question }}"
slots:
  - { name: docs, type: Stable }
  - { name: question, type: Mutable }
"#;

    const RAG_V2: &str = r#"
name: rag
revision: 2
body: "System.\nDocs: {{docs}}\nTone: {{ tone }}\nQ: {{ question }}\nA:"
slots:
  - { name: docs, type: Stable, required: true }
  - { name: question, type: Mutable, required: true }
  - { name: tone, type: Stable, required: false }
"#;

    fn store() -> TemplateStore {
        let text = format!("{RAG_V2}\n---\n{RAG_V1}");
        TemplateStore::from_yaml(&text, Path::new("test.yaml")).expect("valid templates")
    }

    fn vars(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn renders_latest_revision() {
        let out = store()
            .render(
                "rag",
                &vars(&[("docs", "D1"), ("question", "why?"), ("tone", "dry")]),
            )
            .expect("renders");
        assert_eq!(out.revision, 2);
        assert_eq!(out.text, "System.\nDocs: D1\nTone: dry\nQ: why?\nA:");
        assert_eq!(out.stable_prefix(), "System.\nDocs: D1\nTone: dry\nQ: ");
        assert_eq!(
            out.stable_prefix_hash,
            inference_cache_fingerprint::text_hash(b"System.\nDocs: D1\nTone: dry\nQ: ")
                .to_be_bytes()
        );
    }

    #[test]
    fn revision_pinning() {
        let store = store();
        let out = store
            .render("rag@1", &vars(&[("docs", "D1"), ("question", "why?")]))
            .expect("renders");
        assert_eq!(out.revision, 1);
        assert_eq!(out.text, "Docs: D1\nQ: why?");
        assert_eq!(store.get("rag@2").expect("exists").revision(), 2);
        assert_eq!(store.list(), vec![("rag", vec![1, 2])]);
        assert_eq!(store.len(), 2);
    }

    #[test]
    fn not_found() {
        let store = store();
        for template_ref in ["nope", "rag@3", "rag@", "rag@one", "@1", ""] {
            let err = store
                .render(template_ref, &HashMap::new())
                .expect_err("not found");
            assert!(err.is_not_found(), "{template_ref}: {err}");
        }
    }

    #[test]
    fn strict_rendering_names_the_slot() {
        let store = store();
        let err = store
            .render("rag", &vars(&[("docs", "D1")]))
            .expect_err("missing");
        assert_eq!(
            err,
            RenderError::MissingSlot {
                template: "rag@2".to_owned(),
                slot: "question".to_owned()
            }
        );
        assert!(err.to_string().contains("\"question\""), "{err}");
        assert!(!err.is_not_found());

        let err = store
            .render(
                "rag",
                &vars(&[("docs", "D"), ("question", "q"), ("qestion", "typo")]),
            )
            .expect_err("unknown");
        assert_eq!(
            err,
            RenderError::UnknownVariable {
                template: "rag@2".to_owned(),
                variable: "qestion".to_owned()
            }
        );
        // An optional slot left out renders empty.
        let out = store
            .render("rag", &vars(&[("docs", "D"), ("question", "q")]))
            .expect("renders");
        assert_eq!(out.text, "System.\nDocs: D\nTone: \nQ: q\nA:");
    }

    #[test]
    fn deterministic_and_stable_prefix_shared() {
        let store = store();
        let a = store
            .render("rag", &vars(&[("docs", "same"), ("question", "first")]))
            .expect("renders");
        let again = store
            .render("rag", &vars(&[("question", "first"), ("docs", "same")]))
            .expect("renders");
        assert_eq!(a, again);
        let b = store
            .render("rag", &vars(&[("docs", "same"), ("question", "second")]))
            .expect("renders");
        assert_ne!(a.text, b.text);
        assert_eq!(a.stable_prefix_hash, b.stable_prefix_hash);
        let c = store
            .render("rag", &vars(&[("docs", "other"), ("question", "first")]))
            .expect("renders");
        assert_ne!(a.stable_prefix_hash, c.stable_prefix_hash);
    }

    #[test]
    fn no_mutable_slot_hashes_everything() {
        let text =
            "name: sys\nrevision: 1\nbody: 'Be {{ mood }}.'\nslots: [{name: mood, type: Stable}]\n";
        let store = TemplateStore::from_yaml(text, Path::new("t.yaml")).expect("valid");
        let out = store
            .render("sys", &vars(&[("mood", "kind")]))
            .expect("renders");
        assert_eq!(out.stable_prefix_len, out.text.len());
        // Slot values are inserted verbatim, never re-parsed.
        let out = store
            .render("sys", &vars(&[("mood", "{{ mood }}")]))
            .expect("renders");
        assert_eq!(out.text, "Be {{ mood }}.");
    }

    #[test]
    fn load_errors_name_the_problem() {
        let cases = [
            (
                "name: a\nrevision: 1\nbody: '{{ x }}'\n",
                "names no declared slot",
            ),
            (
                "name: a\nrevision: 1\nbody: 'hi {{ x'\nslots: [{name: x, type: Stable}]\n",
                "unterminated",
            ),
            (
                "name: a\nrevision: 1\nbody: 'hi'\nslots: [{name: x, type: Stable}]\n",
                "not used in the body",
            ),
            ("name: a\nrevision: 0\nbody: 'hi'\n", "revision"),
            ("name: a@b\nrevision: 1\nbody: 'hi'\n", "name"),
            (
                "name: a\nrevision: 1\nbody: '{{ x-y }}'\n",
                "invalid placeholder",
            ),
            (
                "name: a\nrevision: 1\nbody: 'hi'\nslots: [{name: x, type: Volatile}]\n",
                "Volatile",
            ),
            (
                "name: a\nrevision: 1\nbody: 'hi'\nrequierd: true\n",
                "requierd",
            ),
            (
                "name: a\nrevision: 1\nbody: 'a'\n---\nname: a\nrevision: 1\nbody: 'b'\n",
                "defined in both",
            ),
        ];
        for (text, needle) in cases {
            let err = TemplateStore::from_yaml(text, Path::new("bad.yaml")).expect_err(needle);
            assert!(err.to_string().contains(needle), "{needle}: {err}");
        }
    }

    #[test]
    fn loads_the_shipped_examples() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../templates");
        let store = TemplateStore::load_dir(&dir).expect("shipped templates load");
        let names: Vec<&str> = store.list().into_iter().map(|(name, _)| name).collect();
        assert_eq!(names, vec!["code-review", "rag-answer", "support-agent"]);
        for (name, _) in store.list() {
            let template = store.get(name).expect("exists");
            let variables: HashMap<String, String> = template
                .slots()
                .iter()
                .map(|slot| (slot.name.clone(), format!("<{}>", slot.name)))
                .collect();
            let out = template.render(&variables).expect("renders");
            assert!(out.stable_prefix_len > 0, "{name} has a stable prefix");
        }
    }
}
