pub mod bench;
pub mod generate;
pub mod inspect;
pub mod perplexity;
pub mod run;
pub mod score;
