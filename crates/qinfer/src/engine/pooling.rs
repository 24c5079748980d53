//! Embedding and reranking models around the engine's prompt-only
//! requests: how a checkpoint pools (its sentence-transformers files:
//! modules.json, the Pooling module's config, Normalize, and the named
//! prompts), the finishing of a pooled vector (Matryoshka truncation, L2
//! normalization), and Qwen3-Reranker's prompt and yes/no scoring.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

use super::request::Pooling;
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};

/// How an embedding checkpoint turns hidden states into one vector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolingConfig {
    pub pooling: Pooling,
    /// L2-normalize (a Normalize module follows the pooling).
    pub normalize: bool,
    /// Named prompts prepended to inputs (`query`, `document`, …).
    pub prompts: BTreeMap<String, String>,
    /// The prompt used when none is named.
    pub default_prompt_name: Option<String>,
}

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::Invalid(format!("{}: {e}", path.display())))?;
    serde_json::from_str(&text).map_err(|e| Error::Invalid(format!("{}: {e}", path.display())))
}

impl PoolingConfig {
    /// The pooling a sentence-transformers checkpoint in `dir` declares, or
    /// None when `dir` has no modules.json. Fails, naming the file, on a
    /// pooling mode or module qinfer does not run.
    pub fn from_dir(dir: &Path) -> Result<Option<Self>> {
        let modules_path = dir.join("modules.json");
        if !modules_path.is_file() {
            return Ok(None);
        }
        let modules = read_json(&modules_path)?;
        let modules =
            modules.as_array().ok_or_else(|| Error::Invalid(format!("{}: not a list", modules_path.display())))?;
        let (mut pooling, mut normalize) = (None, false);
        for m in modules {
            let kind = m.get("type").and_then(Value::as_str).unwrap_or_default();
            let name = kind.rsplit('.').next().unwrap_or_default();
            let path = dir.join(m.get("path").and_then(Value::as_str).unwrap_or_default());
            match name {
                "Transformer" => {}
                "Pooling" => pooling = Some(read_pooling(&path.join("config.json"))?),
                "Normalize" => normalize = true,
                other => {
                    return Err(Error::Invalid(format!(
                        "{}: module {other} ({kind}) is not supported (Transformer, Pooling, Normalize are)",
                        modules_path.display()
                    )));
                }
            }
        }
        let pooling =
            pooling.ok_or_else(|| Error::Invalid(format!("{}: no Pooling module", modules_path.display())))?;
        let (mut prompts, mut default_prompt_name) = (BTreeMap::new(), None);
        let st = dir.join("config_sentence_transformers.json");
        if st.is_file() {
            let v = read_json(&st)?;
            if let Some(p) = v.get("prompts").and_then(Value::as_object) {
                prompts = p.iter().filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string()))).collect();
            }
            default_prompt_name = v.get("default_prompt_name").and_then(Value::as_str).map(str::to_string);
        }
        Ok(Some(PoolingConfig { pooling, normalize, prompts, default_prompt_name }))
    }

    /// The pooling a GGUF declares (`{arch}.pooling_type`, llama.cpp's
    /// numbering; its server L2-normalizes embeddings by default): None for
    /// 0 (no pooling: a generative model). Rank pooling (llama.cpp's
    /// rerankers, a classifier head made from the yes/no rows) is refused.
    pub fn from_gguf_pooling_type(pooling_type: u64) -> Result<Option<Self>> {
        let pooling = match pooling_type {
            0 => return Ok(None),
            1 => Pooling::Mean,
            2 => Pooling::Cls,
            3 => Pooling::Last,
            4 => {
                return Err(Error::Invalid(
                    "this GGUF declares rank pooling (a reranker converted by llama.cpp), which is not supported: \
                     serve the Hugging Face checkpoint with --task rerank"
                        .into(),
                ));
            }
            other => return Err(Error::Invalid(format!("unknown GGUF pooling_type {other}"))),
        };
        Ok(Some(PoolingConfig { pooling, normalize: true, prompts: BTreeMap::new(), default_prompt_name: None }))
    }

    /// The text a model embeds for `input`: the named prompt (or the default
    /// one) before it, or Qwen3-Embedding's instruction format when a task
    /// description is given.
    pub fn input_text(&self, input: &str, prompt_name: Option<&str>, instruction: Option<&str>) -> Result<String> {
        if let Some(task) = instruction {
            return Ok(format!("Instruct: {task}\nQuery:{input}"));
        }
        match prompt_name.or(self.default_prompt_name.as_deref()) {
            None => Ok(input.to_string()),
            Some(name) => match self.prompts.get(name) {
                Some(p) => Ok(format!("{p}{input}")),
                None => Err(Error::Invalid(format!(
                    "prompt `{name}` is not one of this model's ({})",
                    self.prompts.keys().cloned().collect::<Vec<_>>().join(", ")
                ))),
            },
        }
    }
}

/// A Pooling module's config.json, in either of the forms
/// sentence-transformers writes (`pooling_mode` or `pooling_mode_*` flags).
fn read_pooling(path: &Path) -> Result<Pooling> {
    let v = read_json(path)?;
    let bad = |what: String| Error::Invalid(format!("{}: {what}", path.display()));
    if v.get("include_prompt").and_then(Value::as_bool) == Some(false) {
        return Err(bad("include_prompt false (pooling without the prompt's tokens) is not supported".into()));
    }
    let mode = match v.get("pooling_mode").and_then(Value::as_str) {
        Some(m) => m.to_string(),
        None => {
            let on: Vec<&str> = v
                .as_object()
                .into_iter()
                .flatten()
                .filter(|(_, x)| x.as_bool() == Some(true))
                .filter_map(|(k, _)| k.strip_prefix("pooling_mode_"))
                .collect();
            match on.as_slice() {
                [one] => one.to_string(),
                _ => return Err(bad(format!("{} pooling modes on ({}); one is supported", on.len(), on.join(", ")))),
            }
        }
    };
    match mode.as_str() {
        "lasttoken" => Ok(Pooling::Last),
        "mean" | "mean_tokens" => Ok(Pooling::Mean),
        "cls" | "cls_token" => Ok(Pooling::Cls),
        other => Err(bad(format!("pooling mode `{other}` is not supported (lasttoken, mean, cls are)"))),
    }
}

/// A pooled vector as served: its first `dimensions` values (Matryoshka),
/// then L2-normalized when the model normalizes.
pub fn finish_embedding(mut v: Vec<f32>, normalize: bool, dimensions: Option<usize>) -> Result<Vec<f32>> {
    if let Some(d) = dimensions {
        if d == 0 || d > v.len() {
            return Err(Error::Invalid(format!("dimensions must be between 1 and {}", v.len())));
        }
        v.truncate(d);
    }
    if normalize {
        let norm = v.iter().map(|x| (*x as f64) * (*x as f64)).sum::<f64>().sqrt();
        // sentence-transformers' Normalize (torch's F.normalize): eps 1e-12.
        let scale = 1.0 / norm.max(1e-12);
        v.iter_mut().for_each(|x| *x = (*x as f64 * scale) as f32);
    }
    Ok(v)
}

/// Qwen3-Reranker's prompt (its model card): a system message asking for
/// "yes" or "no", the instruction, query and document, then an empty
/// thinking block; the score is P(yes) over the last position's yes and no.
#[derive(Debug, Clone)]
pub struct RerankFormat {
    pub yes: u32,
    pub no: u32,
}

impl RerankFormat {
    pub const DEFAULT_INSTRUCTION: &'static str =
        "Given a web search query, retrieve relevant passages that answer the query";
    const PREFIX: &'static str = "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n";
    const SUFFIX: &'static str = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n";

    /// The format for `tok`'s vocabulary, which must hold "yes" and "no" as
    /// single tokens.
    pub fn for_tokenizer(tok: &Tokenizer) -> Result<Self> {
        let id = |t: &str| {
            tok.token_to_id(t).ok_or_else(|| {
                Error::Invalid(format!("the vocabulary has no single `{t}` token: not a Qwen3-Reranker-style model"))
            })
        };
        Ok(RerankFormat { yes: id("yes")?, no: id("no")? })
    }

    /// The prompt scoring `document` against `query`.
    pub fn prompt(&self, query: &str, document: &str, instruction: Option<&str>) -> String {
        let instruction = instruction.unwrap_or(Self::DEFAULT_INSTRUCTION);
        format!("{}<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}{}", Self::PREFIX, Self::SUFFIX)
    }

    /// The ids a score request asks the logits of: [no, yes].
    pub fn score_ids(&self) -> Vec<u32> {
        vec![self.no, self.yes]
    }

    /// P(yes) from the [no, yes] logits (a two-way softmax).
    pub fn relevance(scores: &[f32]) -> f32 {
        let (no, yes) = (scores[0] as f64, scores[1] as f64);
        let m = no.max(yes);
        let (en, ey) = ((no - m).exp(), (yes - m).exp());
        (ey / (en + ey)) as f32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matryoshka_truncates_then_normalizes() {
        let v = finish_embedding(vec![3.0, 4.0, 12.0], true, Some(2)).unwrap();
        assert_eq!(v, vec![0.6, 0.8]);
        assert_eq!(finish_embedding(vec![3.0, 4.0], false, None).unwrap(), vec![3.0, 4.0]);
        assert!(finish_embedding(vec![1.0], true, Some(2)).is_err());
        assert!(finish_embedding(vec![1.0], true, Some(0)).is_err());
        assert_eq!(finish_embedding(vec![0.0, 0.0], true, None).unwrap(), vec![0.0, 0.0]);
    }

    #[test]
    fn gguf_pooling_types_follow_llama_cpp() {
        let p = |t| PoolingConfig::from_gguf_pooling_type(t).unwrap().map(|c| c.pooling);
        assert_eq!([p(0), p(1), p(2), p(3)], [None, Some(Pooling::Mean), Some(Pooling::Cls), Some(Pooling::Last)]);
        assert!(PoolingConfig::from_gguf_pooling_type(4).unwrap_err().to_string().contains("rank pooling"));
        assert!(PoolingConfig::from_gguf_pooling_type(9).is_err());
    }

    #[test]
    fn yes_over_no() {
        assert!((RerankFormat::relevance(&[0.0, 0.0]) - 0.5).abs() < 1e-7);
        assert!(RerankFormat::relevance(&[-100.0, 100.0]) > 0.999);
    }
}
