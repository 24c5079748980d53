//! The LoRA adapters placed beside a decoder's weights, by id, and each
//! forward's view of them: which rows run with which adapter's part of a
//! layer.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use crate::layers::lora::Sites;
use crate::lora::AdapterId;
use crate::{Error, Result};

/// An adapter's part for one decoder layer: its token mixer's sites and
/// its feed-forward's (None for a sparse one, whose experts it does not adapt).
pub(super) struct LayerLora<W> {
    pub mixer: Sites<W>,
    pub ffn: Option<Sites<W>>,
}

/// One adapter, layer by layer.
pub(super) type ModelLora<W> = Vec<LayerLora<W>>;

/// A placed adapter; a retired one serves the sequences that already run
/// with it and no new one, until it is released.
struct Placed<W> {
    lora: Arc<ModelLora<W>>,
    retired: bool,
}

/// The adapters of one model. Ids count up and are never reused.
pub(super) struct Adapters<W> {
    placed: RwLock<HashMap<AdapterId, Placed<W>>>,
    next: AtomicU64,
}

impl<W> Default for Adapters<W> {
    fn default() -> Self {
        Adapters { placed: RwLock::new(HashMap::new()), next: AtomicU64::new(1) }
    }
}

impl<W> Adapters<W> {
    fn read(&self) -> std::sync::RwLockReadGuard<'_, HashMap<AdapterId, Placed<W>>> {
        self.placed.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<AdapterId, Placed<W>>> {
        self.placed.write().unwrap_or_else(|e| e.into_inner())
    }

    pub fn insert(&self, lora: ModelLora<W>) -> AdapterId {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.write().insert(id, Placed { lora: Arc::new(lora), retired: false });
        id
    }

    /// Retires `id`: no new sequence may take it; its weights go once
    /// [`Adapters::release`] hears that no sequence uses it.
    pub fn remove(&self, id: AdapterId) -> Result<()> {
        match self.write().get_mut(&id) {
            Some(p) if !p.retired => {
                p.retired = true;
                Ok(())
            }
            _ => Err(Error::Invalid(format!("no LoRA adapter {id} is loaded"))),
        }
    }

    /// Frees the retired adapters not in `in_use`.
    pub fn release(&self, in_use: &[AdapterId]) {
        if self.read().values().any(|p| p.retired) {
            self.write().retain(|id, p| !p.retired || in_use.contains(id));
        }
    }

    /// Whether a new sequence may take `id`.
    pub fn usable(&self, id: AdapterId) -> bool {
        self.read().get(&id).is_some_and(|p| !p.retired)
    }

    /// `id`'s weights, retired or not (sequences already running with it).
    fn get(&self, id: AdapterId) -> Result<Arc<ModelLora<W>>> {
        let placed = self.read();
        placed.get(&id).map(|p| p.lora.clone()).ok_or_else(|| Error::Invalid(format!("no LoRA adapter {id} is loaded")))
    }

    /// The adapters of a forward's rows: `rows[i]` runs with `ids[i]`;
    /// neighbouring rows of one adapter merge into one segment.
    pub fn active(&self, runs: impl IntoIterator<Item = (Range<usize>, Option<AdapterId>)>) -> Result<Active<W>> {
        let mut segs: Vec<(Range<usize>, AdapterId, Arc<ModelLora<W>>)> = Vec::new();
        for (rows, id) in runs {
            let Some(id) = id else { continue };
            match segs.last_mut() {
                Some((r, last, _)) if *last == id && r.end == rows.start => r.end = rows.end,
                _ => segs.push((rows, id, self.get(id)?)),
            }
        }
        Ok(Active(segs.into_iter().map(|(r, _, l)| (r, l)).collect()))
    }
}

/// The adapters of one forward's rows.
pub(super) struct Active<W>(Vec<(Range<usize>, Arc<ModelLora<W>>)>);

impl<W> Active<W> {
    pub fn none() -> Self {
        Active(Vec::new())
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Layer `l`'s token-mixer parts, by rows.
    pub fn mixer(&self, l: usize) -> Vec<(Range<usize>, &Sites<W>)> {
        self.0.iter().map(|(r, m)| (r.clone(), &m[l].mixer)).collect()
    }

    /// Layer `l`'s MLP parts, by rows.
    pub fn ffn(&self, l: usize) -> Vec<(Range<usize>, &Sites<W>)> {
        self.0.iter().filter_map(|(r, m)| m[l].ffn.as_ref().map(|p| (r.clone(), p))).collect()
    }
}

impl<B: crate::backend::ops::ModelBackend> super::DecoderModel<B> {
    /// `adapter`'s pairs placed beside this model's projections, in the
    /// form each layer stores them; an error names a pair the model has no
    /// projection for (or one of another shape).
    pub(super) fn place_adapter(&self, adapter: &crate::lora::LoraAdapter) -> Result<ModelLora<B::Weight>> {
        let b = &self.backend;
        let mut pending = adapter.modules.clone();
        let mut layers = Vec::with_capacity(self.layers.len());
        let named = |e: Error| Error::Invalid(format!("LoRA adapter {}: {e}", adapter.path.display()));
        for (l, layer) in self.layers.iter().enumerate() {
            let mixer = match &layer.mixer {
                super::Mixer::Attention(a) => a.lora(b, &mut pending, &self.cfg, l).map_err(named)?,
                super::Mixer::Linear(g) => g.lora(b, &mut pending, l).map_err(named)?,
            };
            let ffn = match &layer.ffn {
                super::FeedForward::Dense(m) => Some(m.lora(b, &mut pending, "mlp", l).map_err(named)?),
                super::FeedForward::Sparse(_) => None,
            };
            layers.push(LayerLora { mixer, ffn });
        }
        if let Some((l, module)) = pending.keys().next() {
            let what = if *l >= self.layers.len() {
                format!("the model has {} layers", self.layers.len())
            } else if module.starts_with("mlp.") && matches!(self.layers[*l].ffn, super::FeedForward::Sparse(_)) {
                "LoRA on mixture-of-experts blocks (experts, router, shared expert) is not supported".to_string()
            } else {
                format!("{} has no such projection in this layer", self.cfg.arch.name())
            };
            return Err(Error::Invalid(format!(
                "LoRA adapter {}: layers.{l}.{module} cannot be applied: {what}",
                adapter.path.display()
            )));
        }
        Ok(layers)
    }
}
