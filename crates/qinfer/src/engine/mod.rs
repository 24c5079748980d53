//! Generation: the prefill/decode loop and perplexity.

pub mod generate;
pub mod perplexity;
