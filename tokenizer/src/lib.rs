//! Tokenizer registry: loads model tokenizers and chat templates, turns prompts into token ids.
