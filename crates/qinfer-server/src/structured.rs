//! Structured output: `response_format` (`json_object`, `json_schema`)
//! enforced while decoding by the llguidance grammar engine (the one
//! llama.cpp, vLLM and SGLang use), which gives the tokens each step may
//! take. A model that reasons may first think freely: a `<think>` at the
//! start (or a prompt that opens one) defers the grammar until `</think>`,
//! as vLLM applies structured output after the reasoning.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use qinfer::engine::request::{ConstraintFactory, TokenConstraint};
use qinfer::tokenizer::Tokenizer;
use serde_json::{Value, json};

use crate::error::ApiResult;
use crate::params::Body;

/// The grammar engine's view of one model's vocabulary (built once, on the
/// first structured request: a pass over every token).
pub struct Grammars {
    factory: Arc<ParserFactory>,
    /// `<think>` and `</think>`, where the vocabulary has them.
    think: Option<(u32, u32)>,
}

impl Grammars {
    /// `vocab` the model's (logits') size, `eos` the token that ends an answer.
    pub fn new(tok: &Tokenizer, vocab: usize, eos: u32) -> Result<Grammars, String> {
        let words: Vec<Vec<u8>> = (tok.token_bytes(vocab).map_err(|e| e.to_string())?)
            .into_iter()
            .map(|(bytes, special)| {
                if special {
                    // Special tokens match no text: the engine's marker byte first.
                    std::iter::once(TokTrie::SPECIAL_TOKEN_MARKER).chain(bytes).collect()
                } else {
                    bytes
                }
            })
            .collect();
        let info = TokRxInfo {
            vocab_size: vocab as u32,
            tok_eos: eos,
            tok_bos: None,
            tok_pad: None,
            tok_unk: None,
            tok_end_of_turn: None,
        };
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(TokTrie::from(&info, &words)));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        let think = tok.token_to_id("<think>").zip(tok.token_to_id("</think>"));
        Ok(Grammars { factory: Arc::new(factory), think })
    }

    /// A request's constraint: the `grammar` (compiled once now, so that a
    /// bad schema is the request's error) and the reasoning's token
    /// `budget`; `prompt_opens_think` starts the output inside the reasoning.
    pub fn constraint(
        &self,
        grammar: Option<TopLevelGrammar>,
        budget: Option<usize>,
        prompt_opens_think: bool,
    ) -> Result<Arc<dyn ConstraintFactory>, String> {
        if let Some(g) = &grammar {
            self.factory.create_parser(g.clone()).map_err(|e| e.to_string())?;
        }
        Ok(Arc::new(OutputFactory {
            factory: self.factory.clone(),
            grammar,
            think: self.think,
            thinking: prompt_opens_think && self.think.is_some(),
            budget,
        }))
    }

    /// A constraint that applies `grammar` from the first token on, with no
    /// reasoning before it (the rest of a forced tool call).
    pub fn immediate(&self, grammar: TopLevelGrammar) -> Result<Arc<dyn ConstraintFactory>, String> {
        self.factory.create_parser(grammar.clone()).map_err(|e| e.to_string())?;
        Ok(Arc::new(OutputFactory {
            factory: self.factory.clone(),
            grammar: Some(grammar),
            think: None,
            thinking: false,
            budget: None,
        }))
    }

    /// Whether the vocabulary has `<think>` and `</think>`.
    pub fn reasons(&self) -> bool {
        self.think.is_some()
    }
}

/// The grammar `response_format` asks for, None for plain text.
pub fn response_format(b: &Body<'_>) -> ApiResult<Option<TopLevelGrammar>> {
    const F: &str = "response_format";
    let Some(v) = b.get(F) else { return Ok(None) };
    match v.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(TopLevelGrammar::from_json_schema(json!({"type": "object"})))),
        Some("json_schema") => {
            let js = v.get("json_schema").ok_or_else(|| b.bad(F, "of type json_schema needs `json_schema`"))?;
            match js.get("schema") {
                Some(s @ (Value::Object(_) | Value::Bool(true))) => {
                    Ok(Some(TopLevelGrammar::from_json_schema(s.clone())))
                }
                None => Ok(Some(TopLevelGrammar::from_json_schema(json!({"type": "object"})))),
                Some(_) => Err(b.bad(F, "`json_schema.schema` must be a JSON Schema object")),
            }
        }
        _ => Err(b.bad(F, "`type` must be \"text\", \"json_object\" or \"json_schema\"")),
    }
}

struct OutputFactory {
    factory: Arc<ParserFactory>,
    grammar: Option<TopLevelGrammar>,
    think: Option<(u32, u32)>,
    thinking: bool,
    budget: Option<usize>,
}

impl std::fmt::Debug for OutputFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        (f.debug_struct("OutputFactory"))
            .field("grammar", &self.grammar.is_some())
            .field("think", &self.think)
            .field("thinking", &self.thinking)
            .field("budget", &self.budget)
            .finish()
    }
}

impl ConstraintFactory for OutputFactory {
    fn start(&self) -> Result<Box<dyn TokenConstraint>, String> {
        let matcher = match &self.grammar {
            Some(g) => Some(Matcher::new(Ok(self.factory.create_parser(g.clone()).map_err(|e| e.to_string())?))),
            None => None,
        };
        let gate = match (self.think, self.thinking) {
            (Some((_, close)), true) => Gate::Thinking { close },
            (Some((open, close)), false) => Gate::Start { open, close },
            (None, _) => Gate::After,
        };
        Ok(Box::new(OutputConstraint { matcher, gate, budget: self.budget, used: 0 }))
    }
}

/// Where the output is relative to the reasoning.
enum Gate {
    /// Nothing yet: the grammar's first tokens, or `<think>`.
    Start { open: u32, close: u32 },
    /// Inside the reasoning: anything until `</think>` (only it once the
    /// budget is spent).
    Thinking { close: u32 },
    /// Past the reasoning (or a model without it): the grammar, if any.
    After,
}

/// The grammar after the reasoning, and the reasoning's budget.
struct OutputConstraint {
    matcher: Option<Matcher>,
    gate: Gate,
    budget: Option<usize>,
    /// Tokens generated inside the reasoning.
    used: usize,
}

fn only(token: u32) -> Vec<u32> {
    let mut m = vec![0u32; token as usize / 32 + 1];
    m[token as usize / 32] = 1 << (token % 32);
    m
}

impl OutputConstraint {
    fn mask(&mut self) -> Result<Option<Vec<u32>>, String> {
        match &mut self.matcher {
            Some(m) => Ok(Some(m.compute_mask_or_eos().map_err(|e| e.to_string())?.as_slice().to_vec())),
            None => Ok(None),
        }
    }
}

impl TokenConstraint for OutputConstraint {
    fn allowed(&mut self) -> Result<Option<Vec<u32>>, String> {
        match self.gate {
            Gate::Thinking { close } if self.budget.is_some_and(|b| self.used >= b) => Ok(Some(only(close))),
            Gate::Thinking { .. } => Ok(None),
            Gate::Start { open, .. } => {
                let Some(mut m) = self.mask()? else { return Ok(None) };
                let (w, b) = (open as usize / 32, open % 32);
                if w < m.len() {
                    m[w] |= 1 << b;
                }
                Ok(Some(m))
            }
            Gate::After => self.mask(),
        }
    }

    fn accept(&mut self, token: u32) -> Result<(), String> {
        match self.gate {
            Gate::Thinking { close } => {
                if token == close {
                    self.gate = Gate::After;
                } else {
                    self.used += 1;
                }
                Ok(())
            }
            Gate::Start { open, close } if token == open => {
                self.gate = Gate::Thinking { close };
                Ok(())
            }
            Gate::Start { .. } | Gate::After => {
                self.gate = Gate::After;
                match &mut self.matcher {
                    Some(m) if !m.is_stopped() => m.consume_token(token).map_err(|e| e.to_string()),
                    _ => Ok(()),
                }
            }
        }
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    fn qwen3() -> Tokenizer {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/tokenizer/qwen3");
        Tokenizer::from_dir(std::path::Path::new(dir)).unwrap().unwrap()
    }

    fn allowed(mask: &Option<Vec<u32>>, t: u32) -> bool {
        mask.as_ref().is_none_or(|m| m[t as usize / 32] >> (t % 32) & 1 == 1)
    }

    /// Walks `text`'s tokens through a constraint: each must be allowed
    /// before it is taken; returns the mask after them.
    fn walk(c: &mut dyn TokenConstraint, tok: &Tokenizer, text: &str) -> Option<Vec<u32>> {
        for t in tok.encode(text, false).unwrap() {
            let m = c.allowed().unwrap();
            assert!(allowed(&m, t), "{:?} refused in {text:?}", tok.decode(&[t], false).unwrap());
            c.accept(t).unwrap();
        }
        c.allowed().unwrap()
    }

    #[test]
    fn a_schema_allows_its_json_and_then_only_the_end() {
        let tok = qwen3();
        let eos = tok.token_to_id("<|im_end|>").unwrap();
        let g = Grammars::new(&tok, tok.vocab_size(), eos).unwrap();
        let schema = json!({"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}},
            "required": ["n", "s"], "additionalProperties": false});
        let f = g.constraint(Some(TopLevelGrammar::from_json_schema(schema)), None, false).unwrap();
        let mut c = f.start().unwrap();
        let end = walk(c.as_mut(), &tok, "{\"n\": 12, \"s\": \"é 東\"}");
        assert!(allowed(&end, eos));
        assert_eq!(end.unwrap().iter().map(|w| w.count_ones()).sum::<u32>(), 1, "only the end is left");
        // What breaks the schema is refused.
        let mut c = f.start().unwrap();
        walk(c.as_mut(), &tok, "{\"n\": ");
        let m = c.allowed().unwrap();
        for bad in ["\"", "true", "}"] {
            let t = tok.encode(bad, false).unwrap()[0];
            assert!(!allowed(&m, t), "{bad:?} allowed where an integer must come");
        }
    }

    #[test]
    fn reasoning_comes_first_unconstrained() {
        let tok = qwen3();
        let eos = tok.token_to_id("<|im_end|>").unwrap();
        let g = Grammars::new(&tok, tok.vocab_size(), eos).unwrap();
        let (open, close) = (tok.token_to_id("<think>").unwrap(), tok.token_to_id("</think>").unwrap());
        let f = g.constraint(Some(TopLevelGrammar::from_json_schema(json!({"type": "object"}))), None, false).unwrap();
        let mut c = f.start().unwrap();
        let m = c.allowed().unwrap();
        assert!(allowed(&m, open) && !allowed(&m, tok.encode("Sure", false).unwrap()[0]));
        c.accept(open).unwrap();
        assert_eq!(c.allowed().unwrap(), None, "free inside the reasoning");
        walk(c.as_mut(), &tok, "Plan: any text { here.");
        c.accept(close).unwrap();
        let m = c.allowed().unwrap();
        assert!(!allowed(&m, tok.encode("Sure", false).unwrap()[0]) && allowed(&m, tok.encode("{", false).unwrap()[0]));
        // A prompt that opened the reasoning starts inside it.
        let f = g.constraint(Some(TopLevelGrammar::from_json_schema(json!({"type": "object"}))), None, true).unwrap();
        assert_eq!(f.start().unwrap().allowed().unwrap(), None);
    }

    #[test]
    fn a_spent_budget_closes_the_reasoning() {
        let tok = qwen3();
        let eos = tok.token_to_id("<|im_end|>").unwrap();
        let g = Grammars::new(&tok, tok.vocab_size(), eos).unwrap();
        let (open, close) = (tok.token_to_id("<think>").unwrap(), tok.token_to_id("</think>").unwrap());
        for opened in [false, true] {
            let mut c = g.constraint(None, Some(3), opened).unwrap().start().unwrap();
            if !opened {
                assert_eq!(c.allowed().unwrap(), None, "no grammar: free at the start");
                c.accept(open).unwrap();
            }
            for t in tok.encode(" a b c", false).unwrap() {
                assert_eq!(c.allowed().unwrap(), None);
                c.accept(t).unwrap();
            }
            assert_eq!(c.allowed().unwrap(), Some(only(close)), "the budget of 3 is spent");
            c.accept(close).unwrap();
            assert_eq!(c.allowed().unwrap(), None, "the answer is free");
        }
    }
}
