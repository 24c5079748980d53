//! One chat choice's output as both APIs present it: the text split into
//! reasoning and content (where the vocabulary has Qwen's reasoning tags),
//! and the content into text and tool calls (where tools were offered).

use crate::reasoning::ReasoningSplitter;
use crate::tool_parser::{ParamTypes, ToolCallParser, ToolEvent};

/// A piece of a choice's output, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    Reasoning(String),
    Content(String),
    ToolStart { index: usize, name: String },
    ToolArgs { index: usize, delta: String },
    ToolEnd { index: usize },
}

#[derive(Debug)]
pub struct ChatStream {
    splitter: Option<ReasoningSplitter>,
    parser: Option<ToolCallParser>,
    /// Only the first call is kept (`parallel_tool_calls: false`).
    single_call: bool,
}

/// How a chat's output is read.
#[derive(Debug, Clone, Default)]
pub struct ChatFormat {
    /// The rendered prompt (with any forced start), when reasoning is split
    /// out (the vocabulary has the tags): it tells whether the output starts
    /// inside `<think>`.
    pub reasoning_prompt: Option<String>,
    /// `<think>` and `</think>`'s ids, to count reasoning tokens.
    pub think_ids: Option<(u32, u32)>,
    /// The offered tools' parameter types, when tool calls are parsed.
    pub tools: Option<ParamTypes>,
    /// What a required or named call's arguments must follow after the
    /// forced opening (llguidance Lark), where the format allows.
    pub call_grammar: Option<String>,
    /// Text forced at the start of the output (a required call's opening):
    /// already in the prompt, read as if generated.
    pub forced: String,
    pub single_call: bool,
}

impl ChatFormat {
    /// Whether the prompt leaves `<think>` open, so the output starts in the reasoning.
    pub fn opens_think(&self) -> bool {
        self.reasoning_prompt.as_ref().is_some_and(|p| p.trim_end().ends_with("<think>"))
    }
}

impl ChatStream {
    /// A whole answer read at once, and whether it called a tool.
    pub fn whole(f: &ChatFormat, text: &str) -> (Whole, bool) {
        let (mut s, mut pieces) = ChatStream::new(f);
        pieces.extend(s.push(text));
        pieces.extend(s.finish());
        (fold(pieces), s.called())
    }

    /// The stream, and the pieces its forced start makes.
    pub fn new(f: &ChatFormat) -> (ChatStream, Vec<Piece>) {
        let tools = f.tools.is_some();
        let splitter = f.reasoning_prompt.as_ref().map(|p| {
            let s = ReasoningSplitter::new(p);
            if tools { s.with_tool_calls() } else { s }
        });
        let mut s =
            ChatStream { splitter, parser: f.tools.clone().map(ToolCallParser::new), single_call: f.single_call };
        let first = if f.forced.is_empty() { Vec::new() } else { s.content(f.forced.clone()) };
        (s, first)
    }

    /// Whether any tool call started.
    pub fn called(&self) -> bool {
        self.parser.as_ref().is_some_and(|p| p.calls() > 0)
    }

    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        let (reasoning, content) = match &mut self.splitter {
            Some(s) => {
                let p = s.push(text);
                (p.reasoning, p.content)
            }
            None => (String::new(), text.to_string()),
        };
        let mut out = Vec::new();
        if !reasoning.is_empty() {
            out.push(Piece::Reasoning(reasoning));
        }
        out.extend(self.content(content));
        out
    }

    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        if let Some(s) = &mut self.splitter {
            let p = s.finish();
            if !p.reasoning.is_empty() {
                out.push(Piece::Reasoning(p.reasoning));
            }
            out.extend(self.content(p.content));
        }
        if let Some(p) = &mut self.parser {
            let events = p.finish();
            out.extend(self.pieces(events));
        }
        out
    }

    fn content(&mut self, text: String) -> Vec<Piece> {
        match &mut self.parser {
            Some(p) => {
                let events = p.push(&text);
                self.pieces(events)
            }
            None if text.is_empty() => Vec::new(),
            None => vec![Piece::Content(text)],
        }
    }

    fn pieces(&self, events: Vec<ToolEvent>) -> Vec<Piece> {
        let keep = |i: usize| !self.single_call || i == 0;
        events
            .into_iter()
            .filter_map(|e| match e {
                ToolEvent::Content(c) => Some(Piece::Content(c)),
                ToolEvent::Start { index, name } => keep(index).then_some(Piece::ToolStart { index, name }),
                ToolEvent::Args { index, delta } => keep(index).then_some(Piece::ToolArgs { index, delta }),
                ToolEvent::End { index } => keep(index).then_some(Piece::ToolEnd { index }),
            })
            .collect()
    }
}

/// Counts the tokens generated inside the reasoning (between the tags).
#[derive(Debug, Clone)]
pub struct ReasoningTokens {
    ids: Option<(u32, u32)>,
    /// 0: before any output, 1: inside, 2: past the reasoning.
    state: u8,
    pub count: usize,
}

impl ReasoningTokens {
    pub fn new(f: &ChatFormat) -> Self {
        ReasoningTokens { ids: f.think_ids, state: if f.opens_think() { 1 } else { 0 }, count: 0 }
    }

    pub fn push(&mut self, tokens: &[u32]) {
        let Some((open, close)) = self.ids else { return };
        for &t in tokens {
            self.state = match (self.state, t) {
                (0, t) if t == open => 1,
                (0, _) => 2,
                (1, t) if t == close => 2,
                (1, _) => {
                    self.count += 1;
                    1
                }
                (s, _) => s,
            };
        }
    }
}

/// A whole choice: reasoning, content, and each call's name and arguments.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Whole {
    pub reasoning: String,
    pub content: String,
    pub calls: Vec<(String, String)>,
}

fn fold(pieces: impl IntoIterator<Item = Piece>) -> Whole {
    let mut w = Whole::default();
    for p in pieces {
        match p {
            Piece::Reasoning(r) => w.reasoning.push_str(&r),
            Piece::Content(c) => w.content.push_str(&c),
            Piece::ToolStart { name, .. } => w.calls.push((name, String::new())),
            Piece::ToolArgs { delta, .. } => {
                if let Some(c) = w.calls.last_mut() {
                    c.1.push_str(&delta)
                }
            }
            Piece::ToolEnd { .. } => {}
        }
    }
    w
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasoning_tokens_are_those_between_the_tags() {
        let f = |prompt: &str| ChatFormat {
            reasoning_prompt: Some(prompt.into()),
            think_ids: Some((1, 2)),
            ..Default::default()
        };
        let count = |prompt: &str, pieces: &[&[u32]]| {
            let mut r = ReasoningTokens::new(&f(prompt));
            pieces.iter().for_each(|p| r.push(p));
            r.count
        };
        assert_eq!(count("assistant\n", &[&[1, 7, 8], &[9, 2, 5, 6]]), 3);
        assert_eq!(count("assistant\n<think>\n", &[&[7, 8, 2, 1, 5]]), 2);
        assert_eq!(count("assistant\n", &[&[5, 1, 7, 2]]), 0, "a tag after the answer began is text");
        assert_eq!(count("assistant\n<think>\n", &[&[7, 8]]), 2, "cut off while reasoning");
    }
}
