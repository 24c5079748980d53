//! Requests whose images are still going through the vision tower. The
//! engine runs the tower a block at a time before each step's forward, for
//! about as long as a step of the running requests takes, so that a large
//! image delays each of their tokens by at most about one step instead of
//! by the whole encoding; with nothing running, it encodes at once. The
//! tokens of recent images are kept by the image's hash, so that the
//! earlier images of a conversation, sent again with every turn, are not
//! encoded again.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::request::RequestId;
use crate::image::PreparedImage;
use crate::models::{ImageEncoding, LanguageModel};
use crate::runner::media::Media;
use crate::{Error, Result};

/// One request's images, encoded in order.
struct Job {
    id: RequestId,
    media: Arc<Media>,
    /// The images not yet encoded, in order, with their index; the first
    /// may be partway through the tower.
    pending: VecDeque<(usize, ImageEncoding)>,
}

/// What [`ImageQueue::advance`] finished.
#[derive(Default)]
pub struct Encoded {
    pub ready: Vec<RequestId>,
    pub failed: Vec<(RequestId, Error)>,
}

/// Host memory the tokens of recent images may take.
const TOKEN_CACHE_BYTES: usize = 512 << 20;

/// Recent images' tokens by hash, least recently used out first.
#[derive(Default)]
struct TokenCache {
    map: HashMap<[u8; 32], (Arc<Vec<f32>>, u64)>,
    bytes: usize,
    clock: u64,
}

impl TokenCache {
    fn get(&mut self, hash: &[u8; 32]) -> Option<Arc<Vec<f32>>> {
        self.clock += 1;
        let (tokens, used) = self.map.get_mut(hash)?;
        *used = self.clock;
        Some(tokens.clone())
    }

    fn insert(&mut self, hash: [u8; 32], tokens: Arc<Vec<f32>>) {
        let size = tokens.len() * 4;
        if size > TOKEN_CACHE_BYTES || self.map.contains_key(&hash) {
            return;
        }
        while self.bytes + size > TOKEN_CACHE_BYTES {
            let oldest = *self.map.iter().min_by_key(|(_, (_, used))| *used).expect("bytes are held").0;
            let (gone, _) = self.map.remove(&oldest).expect("just found");
            self.bytes -= gone.len() * 4;
        }
        self.clock += 1;
        self.bytes += size;
        self.map.insert(hash, (tokens, self.clock));
    }
}

#[derive(Default)]
pub struct ImageQueue {
    jobs: VecDeque<Job>,
    cache: TokenCache,
    /// Images whose tokens came from the cache.
    reused: u64,
}

impl ImageQueue {
    /// Queues a request's images, checking each against the model's tower
    /// now so that a bad one refuses the request.
    pub fn push(
        &mut self,
        model: &dyn LanguageModel,
        id: RequestId,
        media: Arc<Media>,
        images: &[Arc<PreparedImage>],
    ) -> Result<()> {
        // Begun images hold nothing on the device until their first block.
        let pending = images.iter().map(|img| model.begin_image(img.clone())).enumerate();
        let pending = pending.map(|(i, enc)| enc.map(|enc| (i, enc))).collect::<Result<_>>()?;
        self.jobs.push_back(Job { id, media, pending });
        Ok(())
    }

    /// Images whose tokens were kept from an earlier request.
    pub fn reused(&self) -> u64 {
        self.reused
    }

    pub fn len(&self) -> usize {
        self.jobs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.jobs.is_empty()
    }

    /// Drops request `id`'s job, if it has one; whether it had.
    pub fn remove(&mut self, id: RequestId) -> bool {
        let before = self.jobs.len();
        self.jobs.retain(|j| j.id != id);
        self.jobs.len() != before
    }

    /// Runs tower blocks, oldest request first, until `budget` has passed
    /// (at least one block when anything is queued): the requests whose
    /// images are now all encoded, in order, and those whose encoding
    /// failed (their jobs dropped), with the error.
    pub fn advance(&mut self, model: &dyn LanguageModel, budget: Duration) -> Encoded {
        let t0 = Instant::now();
        let mut out = Encoded::default();
        let mut ran = false;
        while let Some(job) = self.jobs.front_mut() {
            let id = job.id;
            let Some((i, enc)) = job.pending.front_mut() else {
                out.ready.push(id);
                self.jobs.pop_front();
                continue;
            };
            let (i, hash) = (*i, job.media.hash(*i));
            let step = match self.cache.get(&hash) {
                Some(tokens) => {
                    self.reused += 1;
                    job.media.set_tokens(i, tokens).map(|_| true)
                }
                None if ran && t0.elapsed() >= budget => break,
                None => {
                    ran = true;
                    model.advance_image(enc, 1).and_then(|tokens| match tokens {
                        Some(tokens) => {
                            let tokens = Arc::new(tokens);
                            self.cache.insert(hash, tokens.clone());
                            job.media.set_tokens(i, tokens).map(|_| true)
                        }
                        None => Ok(false),
                    })
                }
            };
            match step {
                Ok(true) => drop(job.pending.pop_front()),
                Ok(false) => {}
                Err(e) => {
                    out.failed.push((id, e));
                    self.jobs.pop_front();
                }
            }
        }
        out
    }
}
