//! qinfer: an inference engine for the Qwen family of language models.
//!
//! Data flow: `formats` turn files into named tensors and a [`config::ModelConfig`];
//! `models` place those tensors on a [`backend::Backend`]; `runner` turns
//! scheduled sequences into one batched forward; `engine` drives requests
//! (continuous batching) and generation; `tokenizer` turns text into ids
//! and back.

pub mod backend;
pub mod config;
pub mod engine;
pub mod error;
pub mod formats;
pub mod image;
pub mod kv;
pub mod layers;
pub mod loader;
pub mod lora;
pub mod models;
pub mod npy;
pub mod quant;
pub mod quantize;
pub mod runner;
pub mod sampling;
pub mod tensor;
pub mod tokenizer;
pub mod weights;

pub use error::{Error, Result};
