//! Server-side prompt inputs over a real gRPC socket: prompt_text, messages
//! and raw_prompt tokenized with real tokenizer files (fetched by
//! `scripts/setup-tokenizers.sh`), the TIMEOUT bound on slow tokenization,
//! and RenderTemplate over a template directory.

use std::path::PathBuf;

use inference_cache_proto::reason;
use inference_cache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;
use inference_cache_proto::v1alpha1::{
    ChatMessage, LookupRouteRequest, LookupRouteResponse, RenderTemplateRequest,
};
use inference_cache_server::{PromptSettings, ServeConfig};
use inference_cache_tests::{Holder, TestServer, hold_tokens};
use tonic::transport::Channel;

const MODEL: &str = "qwen3";
const TENANT: &str = "team-a";

/// The models directory with the real tokenizer files.
fn models_dir() -> PathBuf {
    let dir = std::env::var_os("INFERENCE_CACHE_TOKENIZERS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.cache/tokenizers"))
        });
    assert!(
        dir.join(MODEL).join("tokenizer.json").is_file(),
        "tokenizer files missing under {}: run scripts/setup-tokenizers.sh",
        dir.display()
    );
    dir
}

async fn server_with(mut config: ServeConfig) -> anyhow::Result<TestServer> {
    config.prompts.tokenizer_models_dir = Some(models_dir());
    TestServer::start_with(config).await
}

fn base_request() -> LookupRouteRequest {
    LookupRouteRequest {
        model_id: MODEL.into(),
        tenant_id: TENANT.into(),
        hash_scheme: "vllm".into(),
        ..Default::default()
    }
}

/// A prompt long enough to clear the default 64-token matched floor.
fn long_prompt() -> String {
    "Summarise the incident report below for the on-call engineer, listing every affected \
     service, the first alert, the mitigation, and the follow-up owners. The database \
     primary in eu-west failed over at 02:14 UTC after disk latency spiked; reads degraded \
     for nine minutes and two batch jobs retried until the replica caught up."
        .to_owned()
}

/// Reports `tokens`' chain as held by `replica`.
async fn ingest(
    client: &mut InferenceCacheClient<Channel>,
    replica: &str,
    tokens: &[u32],
) -> anyhow::Result<()> {
    let holder = Holder {
        replica,
        tenant: TENANT,
        model: MODEL,
        adapter: "",
    };
    hold_tokens(client, holder, tokens).await
}

/// Looks `request` up twice around an ingest of its echoed tokens into
/// replica "holder" (plus a second replica holding an unrelated chain), and
/// returns both answers.
async fn miss_then_hit(
    request: LookupRouteRequest,
) -> anyhow::Result<(LookupRouteResponse, LookupRouteResponse)> {
    let server = server_with(ServeConfig::ephemeral()).await?;
    let mut client = server.client().await?;
    let first = client.lookup_route(request.clone()).await?.into_inner();
    assert!(
        first.token_ids.len() >= 64,
        "echoed token ids: {:?}",
        first.token_ids
    );
    ingest(&mut client, "holder", &first.token_ids).await?;
    ingest(&mut client, "other", &(0..64).collect::<Vec<u32>>()).await?;
    let second = client.lookup_route(request).await?.into_inner();
    server.shutdown().await?;
    Ok((first, second))
}

fn assert_hit(response: &LookupRouteResponse, expected_tokens: &[u32]) {
    assert_eq!(response.reason_code, reason::PREFIX_MATCH, "{response:?}");
    assert_eq!(response.replica_scores[0].replica_id, "holder");
    let full_blocks = (expected_tokens.len() / 16 * 16) as i32;
    assert_eq!(response.replica_scores[0].matched_tokens, full_blocks);
    assert_eq!(response.token_ids, expected_tokens, "token ids are echoed");
}

#[tokio::test]
async fn prompt_text_hits_after_its_chain_is_ingested() -> anyhow::Result<()> {
    let request = LookupRouteRequest {
        prompt_text: long_prompt(),
        ..base_request()
    };
    let (first, second) = miss_then_hit(request).await?;
    assert_eq!(first.reason_code, reason::NO_HINT, "empty index");
    // Qwen3's chat template wraps a single user turn and opens the assistant turn.
    let rendered_start = [151644u32]; // <|im_start|>
    assert_eq!(&first.token_ids[..1], rendered_start);
    assert_hit(&second, &first.token_ids);
    Ok(())
}

#[tokio::test]
async fn messages_hit_after_their_chain_is_ingested() -> anyhow::Result<()> {
    let request = LookupRouteRequest {
        messages: vec![
            ChatMessage {
                role: "system".into(),
                content: "You are a concise SRE assistant.".into(),
            },
            ChatMessage {
                role: "user".into(),
                content: long_prompt(),
            },
            ChatMessage {
                role: "assistant".into(),
                content: "Which format do you want?".into(),
            },
            ChatMessage {
                role: "user".into(),
                content: "Bullet points, please.".into(),
            },
        ],
        ..base_request()
    };
    let (first, second) = miss_then_hit(request).await?;
    assert_hit(&second, &first.token_ids);

    // The same conversation sent as prompt_text of its last message tokenizes differently.
    let server = server_with(ServeConfig::ephemeral()).await?;
    let mut client = server.client().await?;
    let single = client
        .lookup_route(LookupRouteRequest {
            prompt_text: "Bullet points, please.".into(),
            ..base_request()
        })
        .await?
        .into_inner();
    assert_ne!(single.token_ids, first.token_ids);
    server.shutdown().await
}

#[tokio::test]
async fn raw_prompt_is_tokenized_without_a_chat_template() -> anyhow::Result<()> {
    let request = LookupRouteRequest {
        raw_prompt: long_prompt(),
        ..base_request()
    };
    let (first, second) = miss_then_hit(request).await?;
    assert_ne!(
        first.token_ids[0], 151644,
        "no chat template on raw prompts"
    );
    assert_hit(&second, &first.token_ids);
    Ok(())
}

#[tokio::test]
async fn input_precedence_prefers_token_ids_then_messages() -> anyhow::Result<()> {
    let server = server_with(ServeConfig::ephemeral()).await?;
    let mut client = server.client().await?;
    // token_ids win over every text input: nothing is tokenized, nothing echoed.
    let response = client
        .lookup_route(LookupRouteRequest {
            token_ids: (0..64).collect(),
            prompt_text: long_prompt(),
            ..base_request()
        })
        .await?
        .into_inner();
    assert!(response.token_ids.is_empty());
    // messages win over raw_prompt and prompt_text.
    let messages = vec![ChatMessage {
        role: "user".into(),
        content: "hello".into(),
    }];
    let both = client
        .lookup_route(LookupRouteRequest {
            messages: messages.clone(),
            raw_prompt: long_prompt(),
            prompt_text: long_prompt(),
            ..base_request()
        })
        .await?
        .into_inner();
    let only = client
        .lookup_route(LookupRouteRequest {
            messages,
            ..base_request()
        })
        .await?
        .into_inner();
    assert!(!only.token_ids.is_empty());
    assert_eq!(both.token_ids, only.token_ids);
    server.shutdown().await
}

#[tokio::test]
async fn unknown_model_fails_open_without_tokens() -> anyhow::Result<()> {
    let server = server_with(ServeConfig::ephemeral()).await?;
    let mut client = server.client().await?;
    let response = client
        .lookup_route(LookupRouteRequest {
            model_id: "no-such-model".into(),
            prompt_text: long_prompt(),
            adapter_id: "sql-lora".into(),
            ..base_request()
        })
        .await?
        .into_inner();
    assert_eq!(response.reason_code, reason::NO_HINT);
    assert!(response.replica_scores.is_empty());
    assert!(response.token_ids.is_empty());
    assert!(
        response.adapter_id.is_empty(),
        "fail-open envelope carries no partition"
    );
    server.shutdown().await
}

#[tokio::test]
async fn slow_tokenization_times_out_and_fails_open() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let policy = dir.path().join("policy.yaml");
    std::fs::write(
        &policy,
        "apiVersion: inferencecache.io/v1alpha1\nkind: CachePolicy\n\
         metadata: { name: team-a, namespace: team-a }\nspec: { lookupTimeoutMs: 1 }\n",
    )?;
    let mut config = ServeConfig::ephemeral();
    config.index.policy_file = Some(policy);
    // Let the prompt past the byte limit so the tokenizer itself is timed.
    config.limits.max_prompt_bytes = 64 << 20;
    let server = server_with(config).await?;
    let mut client = server.client().await?;
    // Several megabytes of text take far longer than 1 ms to tokenize.
    let huge = long_prompt().repeat(12_000);
    let started = std::time::Instant::now();
    let response = client
        .lookup_route(LookupRouteRequest {
            prompt_text: huge,
            ..base_request()
        })
        .await?
        .into_inner();
    assert_eq!(response.reason_code, reason::TIMEOUT);
    assert!(response.replica_scores.is_empty() && response.token_ids.is_empty());
    assert!(response.adapter_id.is_empty());
    assert!(
        started.elapsed() < std::time::Duration::from_secs(2),
        "the answer did not wait for the tokenizer"
    );

    // Meanwhile the server keeps answering other lookups: another tenant's,
    // under the default budget (team-a's 1 ms would make this answer depend
    // on how loaded the machine is).
    let quick = client
        .lookup_route(LookupRouteRequest {
            token_ids: (0..64).collect(),
            tenant_id: "team-b".into(),
            ..base_request()
        })
        .await?
        .into_inner();
    assert_eq!(quick.reason_code, reason::NO_HINT);
    let metrics = server.admin_get("/metrics").await?.body;
    assert!(
        metrics.contains("inferencecache_tokenize_latency_seconds_count"),
        "{metrics}"
    );
    server.shutdown().await
}

const TEMPLATES: &str = "\
name: answer
revision: 1
body: |
  Answer from the documents.
  {{ documents }}
  Q: {{ question }}
slots:
  - { name: documents, type: Stable }
  - { name: question, type: Mutable }
---
name: answer
revision: 2
body: |
  Answer only from the documents below.
  {{ documents }}
  Question: {{ question }}
slots:
  - { name: documents, type: Stable }
  - { name: question, type: Mutable }
";

async fn render(
    client: &mut InferenceCacheClient<Channel>,
    template_ref: &str,
    variables: &[(&str, &str)],
) -> anyhow::Result<tonic::Response<inference_cache_proto::v1alpha1::RenderTemplateResponse>> {
    Ok(client
        .render_template(RenderTemplateRequest {
            template_ref: template_ref.into(),
            variables: variables
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            tenant_id: TENANT.into(),
        })
        .await?)
}

#[tokio::test]
async fn render_template_ok_pinned_missing_and_deterministic() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("answer.yaml"), TEMPLATES)?;
    let mut config = ServeConfig::ephemeral();
    config.prompts = PromptSettings {
        templates_dir: Some(dir.path().to_path_buf()),
        ..config.prompts
    };
    let server = TestServer::start_with(config).await?;
    let mut client = server.client().await?;

    let vars = [("documents", "Doc A.\nDoc B."), ("question", "What is A?")];
    let latest = render(&mut client, "answer", &vars).await?.into_inner();
    assert_eq!(latest.reason_code, reason::OK);
    assert_eq!(latest.template_revision, "2");
    let text = String::from_utf8(latest.rendered_prompt.clone())?;
    assert_eq!(
        text,
        "Answer only from the documents below.\nDoc A.\nDoc B.\nQuestion: What is A?\n"
    );
    assert_eq!(latest.tenant_namespace, TENANT.as_bytes());
    let stable = "Answer only from the documents below.\nDoc A.\nDoc B.\nQuestion: ";
    let expected_hash = inference_cache_fingerprint::text_hash(stable.as_bytes()).to_be_bytes();
    assert_eq!(latest.stable_prefix_hash, expected_hash);

    // Identical inputs give identical bytes; another question keeps the stable hash.
    let again = render(&mut client, "answer", &vars).await?.into_inner();
    assert_eq!(again, latest);
    let other = render(
        &mut client,
        "answer",
        &[("documents", "Doc A.\nDoc B."), ("question", "B?")],
    )
    .await?
    .into_inner();
    assert_eq!(other.stable_prefix_hash, latest.stable_prefix_hash);
    assert_ne!(other.rendered_prompt, latest.rendered_prompt);

    // Revision pinning.
    let pinned = render(&mut client, "answer@1", &vars).await?.into_inner();
    assert_eq!(pinned.template_revision, "1");
    assert!(String::from_utf8(pinned.rendered_prompt)?.starts_with("Answer from the documents.\n"));

    // Not found: unknown name, unknown revision.
    for missing in ["nope", "answer@9"] {
        let response = render(&mut client, missing, &vars).await?.into_inner();
        assert_eq!(
            response.reason_code,
            reason::TEMPLATE_NOT_FOUND,
            "{missing}"
        );
        assert!(response.rendered_prompt.is_empty());
    }

    // A missing required slot is a RENDER_ERROR naming the slot.
    let response = render(&mut client, "answer", &[("documents", "Doc A.")]).await?;
    let detail = response
        .metadata()
        .get("x-inferencecache-render-error")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    assert_eq!(response.into_inner().reason_code, reason::RENDER_ERROR);
    assert!(detail.contains("question"), "{detail}");
    server.shutdown().await
}
