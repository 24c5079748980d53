//! Requests whose images are still going through the vision tower. The
//! engine runs the tower a block at a time before each step's forward, for
//! about as long as a step of the running requests takes, so that a large
//! image delays each of their tokens by at most about one step instead of
//! by the whole encoding; with nothing running, it encodes at once.

use std::collections::VecDeque;
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
    /// The images not yet begun, in order, with their index.
    queued: VecDeque<(usize, Arc<PreparedImage>)>,
    /// The image under way, with its index.
    current: Option<(usize, ImageEncoding)>,
}

/// What [`ImageQueue::advance`] finished.
#[derive(Default)]
pub struct Encoded {
    pub ready: Vec<RequestId>,
    pub failed: Vec<(RequestId, Error)>,
}

#[derive(Default)]
pub struct ImageQueue {
    jobs: VecDeque<Job>,
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
        let mut queued = VecDeque::with_capacity(images.len());
        for (i, img) in images.iter().enumerate() {
            // The check, without holding anything on the device.
            drop(model.begin_image(img.clone())?);
            queued.push_back((i, img.clone()));
        }
        self.jobs.push_back(Job { id, media, queued, current: None });
        Ok(())
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
            if job.current.is_none() {
                match job.queued.pop_front() {
                    Some((i, img)) => match model.begin_image(img) {
                        Ok(enc) => job.current = Some((i, enc)),
                        Err(e) => {
                            out.failed.push((id, e));
                            self.jobs.pop_front();
                            continue;
                        }
                    },
                    None => {
                        out.ready.push(id);
                        self.jobs.pop_front();
                        continue;
                    }
                }
            }
            if ran && t0.elapsed() >= budget {
                break;
            }
            let (i, enc) = job.current.as_mut().expect("begun above");
            let step = model.advance_image(enc, 1).and_then(|tokens| match tokens {
                Some(tokens) => job.media.set_tokens(*i, tokens).map(|_| true),
                None => Ok(false),
            });
            match step {
                Ok(true) => job.current = None,
                Ok(false) => {}
                Err(e) => {
                    out.failed.push((id, e));
                    self.jobs.pop_front();
                }
            }
            ran = true;
        }
        out
    }
}
