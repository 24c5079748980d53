pub mod bench;
pub mod generate;
pub mod inspect;
pub mod kernels;
pub mod perplexity;
pub mod quantize;
pub mod run;
pub mod score;
