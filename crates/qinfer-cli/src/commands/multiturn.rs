//! `qinfer bench --multi-turn`: conversations that share a long system
//! prompt and resend everything so far on every turn, all running at once
//! through the engine, with the prefix cache on and then off. Reports each
//! mode's time to first token on the first turn and on later turns, and the
//! share of the reusable prompt tokens (what the turn before had computed:
//! its prompt and answer) that the cache served.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use qinfer::engine::core::{EngineConfig, EngineCore};
use qinfer::engine::request::{Request, StopConditions};
use qinfer::models::LanguageModel;
use serde_json::{Value, json};

/// The conversation shape.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub conversations: usize,
    pub turns: usize,
    pub system_tokens: usize,
    pub turn_tokens: usize,
    pub answer_tokens: usize,
}

struct Conversation {
    index: usize,
    tokens: Vec<u32>,
    turn: usize,
    submitted: Instant,
    first_token: Option<Duration>,
    answer: Vec<u32>,
}

fn median(xs: &mut [f64]) -> f64 {
    xs.sort_by(f64::total_cmp);
    if xs.is_empty() { 0.0 } else { xs[xs.len() / 2] }
}

/// One run of `shape` through an engine of `cfg`: a result row.
pub fn run(
    lm: &Arc<dyn LanguageModel>,
    cfg: EngineConfig,
    shape: Shape,
    tokens: &dyn Fn(usize, u64) -> Vec<u32>,
) -> Result<Value> {
    let mut core = EngineCore::new(lm.clone(), None, cfg)?;
    let system = tokens(shape.system_tokens, 0);
    let user = |c: usize, t: usize| tokens(shape.turn_tokens, 1 + (c * shape.turns + t) as u64);
    let mut convs: HashMap<u64, Conversation> = HashMap::new();
    let submit = |core: &mut EngineCore, id: u64, prompt: &[u32]| {
        let stop = StopConditions { max_tokens: shape.answer_tokens, ..Default::default() };
        let req = Request { prompt: prompt.to_vec(), stop, ..Default::default() };
        core.add(id, req)
    };
    let t0 = Instant::now();
    for c in 0..shape.conversations {
        let tokens = [system.clone(), user(c, 0)].concat();
        let id = c as u64;
        submit(&mut core, id, &tokens)?;
        let conv = Conversation {
            index: c,
            tokens,
            turn: 0,
            submitted: Instant::now(),
            first_token: None,
            answer: Vec::new(),
        };
        convs.insert(id, conv);
    }
    let (mut ttft_first, mut ttft_later) = (Vec::new(), Vec::new());
    let (mut reusable, mut cached, mut computed_prompt) = (0usize, 0usize, 0usize);
    let mut next_id = shape.conversations as u64;
    while core.num_unfinished() > 0 {
        for out in core.step()? {
            let mut conv = convs.remove(&out.id).expect("a conversation's request");
            if conv.first_token.is_none() {
                conv.first_token = Some(conv.submitted.elapsed());
            }
            conv.answer.extend(&out.token_ids);
            if out.finish.is_none() {
                convs.insert(out.id, conv);
                continue;
            }
            let ttft = conv.first_token.expect("set above").as_secs_f64() * 1e3;
            computed_prompt += out.usage.prompt_tokens - out.usage.cached_tokens;
            if conv.turn == 0 {
                ttft_first.push(ttft);
            } else {
                ttft_later.push(ttft);
                cached += out.usage.cached_tokens;
            }
            if conv.turn + 1 == shape.turns {
                continue;
            }
            // The next turn resends this one's prompt and answer, all but
            // the answer's last token computed already.
            reusable += conv.tokens.len() + conv.answer.len() - 1;
            conv.tokens.extend(std::mem::take(&mut conv.answer));
            conv.tokens.extend(user(conv.index, conv.turn + 1));
            conv.turn += 1;
            let id = next_id;
            next_id += 1;
            submit(&mut core, id, &conv.tokens)?;
            conv.submitted = Instant::now();
            conv.first_token = None;
            convs.insert(id, conv);
        }
    }
    ensure!(core.pools_whole(), "the engine kept blocks after every conversation finished");
    let seconds = t0.elapsed().as_secs_f64();
    let (first, later) = (median(&mut ttft_first), median(&mut ttft_later));
    let stats = core.prefix_stats();
    let snapshots = core.snapshots();
    Ok(json!({
        "prefix_cache": cfg.prefix_cache.is_some(),
        "ttft_turn1_median_ms": first,
        "ttft_later_turns_median_ms": later,
        "later_over_first": if first > 0.0 { later / first } else { 0.0 },
        "reusable_prompt_tokens": reusable,
        "cached_prompt_tokens": cached,
        "cached_share_of_reusable": if reusable > 0 { cached as f64 / reusable as f64 } else { 0.0 },
        "prompt_tokens_computed": computed_prompt,
        "seconds": seconds,
        "prefix_stats": stats.map(|s| json!({"queried_tokens": s.queried_tokens, "hit_tokens": s.hit_tokens})),
        "snapshots": snapshots.kept,
        "snapshot_slots": snapshots.slots,
        "snapshot_evictions": snapshots.evicted,
        "block_evictions": core.cached_blocks().1,
    }))
}
