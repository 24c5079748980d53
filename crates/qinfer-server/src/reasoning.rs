//! Qwen's reasoning, separated from the answer as vLLM's Qwen3 reasoning
//! parser separates it: text between `<think>` and `</think>` is reasoning
//! (`reasoning_content`), the rest is content. Templates that open `<think>`
//! in the prompt (Qwen3.5; Qwen3 with thinking on) leave only `</think>` in
//! the output, so the split starts in reasoning when the prompt ends in an
//! open tag. Works on streamed text: a tag split across deltas is held back
//! until it is whole or cannot be one.
//!
//! With tools offered, a `<tool_call>` inside the reasoning ends it: Qwen3
//! models sometimes call a tool before closing their thinking, and such a
//! call belongs with the calls, not in the reasoning. The `</think>` that may
//! follow later is then dropped from the content.

use crate::tool_parser::partial_suffix;

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";
const TOOL_CALL: &str = "<tool_call>";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Before any output: an opening tag here starts reasoning.
    Start,
    Reasoning,
    Content,
}

/// Splits a stream of text into reasoning and content.
#[derive(Debug, Clone)]
pub struct ReasoningSplitter {
    mode: Mode,
    /// Text held back: it may be the start of the tag looked for.
    held: String,
    /// A `<tool_call>` ends the reasoning.
    tools: bool,
    /// The reasoning ended at a tool call: drop the first `</think>` of the content.
    stray_close: bool,
}

/// What one piece of text adds to each part.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Split {
    pub reasoning: String,
    pub content: String,
}

impl ReasoningSplitter {
    /// `prompt_text` is the rendered prompt: ending in an open `<think>`
    /// (whitespace aside) starts the output in reasoning.
    pub fn new(prompt_text: &str) -> Self {
        let opened = prompt_text.trim_end().ends_with(OPEN);
        ReasoningSplitter {
            mode: if opened { Mode::Reasoning } else { Mode::Start },
            held: String::new(),
            tools: false,
            stray_close: false,
        }
    }

    /// The same, with a `<tool_call>` inside the reasoning ending it.
    pub fn with_tool_calls(mut self) -> Self {
        self.tools = true;
        self
    }

    /// Adds `text`; returns what is now known of each part.
    pub fn push(&mut self, text: &str) -> Split {
        let mut out = Split::default();
        self.held.push_str(text);
        loop {
            match self.mode {
                Mode::Start => {
                    let trimmed = self.held.trim_start();
                    if trimmed.starts_with(OPEN) {
                        let skip = self.held.len() - trimmed.len() + OPEN.len();
                        self.held.drain(..skip);
                        self.mode = Mode::Reasoning;
                    } else if trimmed.is_empty() || OPEN.starts_with(trimmed) {
                        return out;
                    } else {
                        self.mode = Mode::Content;
                    }
                }
                Mode::Reasoning => match (self.held.find(CLOSE), self.tool_call_at()) {
                    (close, Some(at)) if close.is_none_or(|c| at < c) => {
                        out.reasoning.push_str(&self.held[..at]);
                        self.held.drain(..at);
                        self.mode = Mode::Content;
                        self.stray_close = true;
                    }
                    (Some(at), _) => {
                        out.reasoning.push_str(&self.held[..at]);
                        self.held.drain(..at + CLOSE.len());
                        self.mode = Mode::Content;
                    }
                    (None, _) => {
                        let tool = if self.tools { partial_suffix(&self.held, TOOL_CALL) } else { 0 };
                        let keep = partial_suffix(&self.held, CLOSE).max(tool);
                        let cut = self.held.len() - keep;
                        out.reasoning.push_str(&self.held[..cut]);
                        self.held.drain(..cut);
                        return out;
                    }
                },
                Mode::Content if self.stray_close => {
                    if let Some(at) = self.held.find(CLOSE) {
                        self.held.replace_range(at..at + CLOSE.len(), "");
                        self.stray_close = false;
                        continue;
                    }
                    let cut = self.held.len() - partial_suffix(&self.held, CLOSE);
                    out.content.push_str(&self.held[..cut]);
                    self.held.drain(..cut);
                    return out;
                }
                Mode::Content => {
                    out.content.push_str(&self.held);
                    self.held.clear();
                    return out;
                }
            }
        }
    }

    fn tool_call_at(&self) -> Option<usize> {
        if self.tools { self.held.find(TOOL_CALL) } else { None }
    }

    /// Flushes what is held at the end of the output.
    pub fn finish(&mut self) -> Split {
        let held = std::mem::take(&mut self.held);
        match self.mode {
            Mode::Reasoning => Split { reasoning: held, content: String::new() },
            Mode::Start | Mode::Content => Split { reasoning: String::new(), content: held },
        }
    }
}

/// Whether a tokenizer's vocabulary has Qwen's reasoning tags as tokens:
/// only then is reasoning split out.
pub fn has_reasoning_tags(token_to_id: impl Fn(&str) -> Option<u32>) -> bool {
    token_to_id(OPEN).is_some() && token_to_id(CLOSE).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `text` fed in pieces cut at every pair of byte positions gives the
    /// same parts as fed whole.
    fn check(prompt: &str, text: &str, reasoning: &str, content: &str) {
        check_with(ReasoningSplitter::new(prompt), text, reasoning, content)
    }

    fn check_with(splitter: ReasoningSplitter, text: &str, reasoning: &str, content: &str) {
        let whole = {
            let mut s = splitter.clone();
            let (a, b) = (s.push(text), s.finish());
            (a.reasoning + &b.reasoning, a.content + &b.content)
        };
        assert_eq!((whole.0.as_str(), whole.1.as_str()), (reasoning, content), "{text:?}");
        let cuts: Vec<usize> = (0..=text.len()).filter(|&i| text.is_char_boundary(i)).collect();
        for &i in &cuts {
            for &j in cuts.iter().filter(|&&j| j >= i) {
                let mut s = splitter.clone();
                let (mut r, mut c) = (String::new(), String::new());
                for piece in [&text[..i], &text[i..j], &text[j..]] {
                    let p = s.push(piece);
                    r += &p.reasoning;
                    c += &p.content;
                }
                let p = s.finish();
                r += &p.reasoning;
                c += &p.content;
                assert_eq!((r.as_str(), c.as_str()), (reasoning, content), "{text:?} cut at {i}, {j}");
            }
        }
    }

    #[test]
    fn tags_in_the_output() {
        check("<|im_start|>assistant\n", "<think>\nPlan: add.\n</think>\n\n4", "\nPlan: add.\n", "\n\n4");
        check("<|im_start|>assistant\n", "\n<think>x</think>y", "x", "y");
    }

    #[test]
    fn a_prompt_that_opens_the_tag() {
        check("<|im_start|>assistant\n<think>\n", "a < b, so</think>\n\nyes", "a < b, so", "\n\nyes");
        check("<think>", "never closed <", "never closed <", "");
    }

    #[test]
    fn a_tool_call_inside_the_reasoning_ends_it() {
        let tools = || ReasoningSplitter::new("<think>\n").with_tool_calls();
        check_with(
            tools(),
            "I should look.\n<tool_call>\n{}\n</tool_call>\n</think>\n\nok",
            "I should look.\n",
            "<tool_call>\n{}\n</tool_call>\n\n\nok",
        );
        check_with(tools(), "plain</think>x<tool_call>", "plain", "x<tool_call>");
        // Without tools the tag is reasoning text like any other.
        check("<think>\n", "a<tool_call>b</think>c", "a<tool_call>b", "c");
    }

    #[test]
    fn no_reasoning() {
        check("user: hi\nassistant:", "Hello <there> </thin", "", "Hello <there> </thin");
        check("", "", "", "");
        check("", "é<th", "", "é<th");
        check("", "<th", "", "<th");
    }
}
