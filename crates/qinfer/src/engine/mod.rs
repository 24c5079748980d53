//! Requests and their lifecycle: the continuous-batching engine (`core`:
//! scheduler and step; `handle`: its thread), the request and sequence
//! types, speculative decoding's proposers, and the single-sequence
//! generation loop and perplexity.

pub mod adaptive;
pub mod config;
pub mod core;
pub mod draft;
pub mod encoding;
pub mod generate;
pub mod handle;
mod mtp;
pub mod perplexity;
pub mod pooling;
pub mod prefix;
pub mod request;
pub mod sequence;
pub mod speculative;
