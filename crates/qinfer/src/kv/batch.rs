//! What one forward over many sequences is told: which rows of the flat
//! batch belong to which sequence, at which positions, where their keys and
//! values go (the slot mapping) and which blocks hold their context (block
//! tables). Models, layers and backends see only this, never a sequence,
//! the scheduler or a sampler.

use std::ops::Range;
use std::sync::Arc;

/// One sequence's part of a batch: a prefill chunk or a decode token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchSeq {
    /// Its rows in the flat batch (its new tokens, in order).
    pub rows: Range<usize>,
    /// Positions already in its cache: row `i` of `rows` is at position
    /// `start + i`, and attends to positions `[0, start + i]`.
    pub start: usize,
    /// The blocks holding positions `[0, start + rows.len())`.
    pub block_table: Vec<u32>,
    /// Its recurrent-state slot (models with Gated DeltaNet layers).
    pub state_slot: Option<u32>,
    /// The rows are (part of) its prompt: recurrent layers take the chunked
    /// form over them however few they are, so a prompt split across steps
    /// computes as it does in one piece; decode tokens step one at a time.
    pub prompt: bool,
    /// After the first `n` of its rows, copy its recurrent states into state
    /// slot `slot`, for each `(n, slot)` (in increasing `n`): prefix-cache
    /// snapshots of prompt rows, and the states after each draft token of a
    /// verification, to roll back to.
    pub snapshots: Vec<(usize, u32)>,
    /// The LoRA adapter its rows run with (None: the base model).
    pub adapter: Option<u64>,
}

impl BatchSeq {
    pub fn len(&self) -> usize {
        self.rows.len()
    }
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }
    /// Positions of its context after this step.
    pub fn context_len(&self) -> usize {
        self.start + self.rows.len()
    }
}

/// A ragged batch: sequences' rows back to back.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BatchLayout {
    pub seqs: Vec<BatchSeq>,
    /// Every row's position.
    pub positions: Vec<usize>,
    /// Every row's KV storage slot (`block · block_size + offset`).
    pub slots: Vec<u32>,
    pub block_size: usize,
    /// The rows whose logits the step returns, in this order.
    pub logits_rows: Vec<usize>,
    /// The rows whose final normed hidden states the step returns (pooling
    /// requests), in this order.
    pub hidden_rows: Vec<usize>,
    /// Every row's temporal, height and width rotary positions, where some
    /// sequence of the batch holds images (empty otherwise: each row's
    /// three positions are its position).
    pub mrope_positions: Vec<[u32; 3]>,
    /// Rows whose input is given as embeddings (image tokens), not looked
    /// up by token id.
    pub embeds: Vec<InputEmbeds>,
}

/// Consecutive batch rows whose inputs are rows of a precomputed embedding
/// matrix (an image's merged vision tokens).
#[derive(Debug, Clone)]
pub struct InputEmbeds {
    /// The first batch row.
    pub row: usize,
    /// `[n, hidden]` values, row-major.
    pub values: Arc<Vec<f32>>,
    /// The rows of `values` taken, in order, one per batch row.
    pub take: Range<usize>,
}

impl PartialEq for InputEmbeds {
    fn eq(&self, o: &Self) -> bool {
        self.row == o.row && self.take == o.take && Arc::ptr_eq(&self.values, &o.values)
    }
}

impl Eq for InputEmbeds {}

impl BatchLayout {
    /// Builds the layout from each sequence's part; positions and the slot
    /// mapping follow from their block tables.
    pub fn new(seqs: Vec<BatchSeq>, block_size: usize, logits_rows: Vec<usize>) -> Self {
        let mut positions = Vec::new();
        let mut slots = Vec::new();
        for s in &seqs {
            debug_assert_eq!(s.rows.start, positions.len(), "sequences' rows are back to back");
            for p in s.start..s.context_len() {
                positions.push(p);
                slots.push(s.block_table[p / block_size] * block_size as u32 + (p % block_size) as u32);
            }
        }
        BatchLayout {
            seqs,
            positions,
            slots,
            block_size,
            logits_rows,
            hidden_rows: Vec::new(),
            mrope_positions: Vec::new(),
            embeds: Vec::new(),
        }
    }

    pub fn rows(&self) -> usize {
        self.positions.len()
    }
}
