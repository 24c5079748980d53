//! Generation: sampling and the prefill/decode loop.

pub mod generate;
pub mod perplexity;
pub mod sampler;
