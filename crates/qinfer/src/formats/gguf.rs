//! GGUF v2/v3 (placeholder: being written).
