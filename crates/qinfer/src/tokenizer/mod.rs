//! Tokenizer and chat templates (placeholder: being written).
