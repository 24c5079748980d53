//! Images in chat requests: OpenAI `image_url` parts and Anthropic `image`
//! blocks become bytes (data URLs and base64 always; http(s) URLs only
//! where the server was started with `--allow-remote-images`), are prepared
//! as the model's vision processor does, and the prompt's image markers are
//! widened to each image's tokens. Every failure is a 400 naming the field.

use std::io::Read;
use std::sync::Arc;

use base64::Engine as _;
use qinfer::engine::request::{ImageLimits, ImageProcessorConfig, PreparedImage, expand_placeholders, prepare_image};

use crate::error::{ApiError, ApiResult, Flavor};

/// What a server whose model takes images needs to prepare them.
#[derive(Debug, Clone)]
pub struct ImageSupport {
    pub processor: ImageProcessorConfig,
    /// The placeholder each image token takes in the prompt.
    pub image_token_id: u32,
    /// Patches per token side (the vision tower's merge size).
    pub merge_size: usize,
    /// Fetch http(s) image URLs.
    pub allow_remote: bool,
    /// Most images one request may carry.
    pub max_images: usize,
    pub limits: ImageLimits,
}

/// Largest remote image the server downloads.
const MAX_REMOTE_BYTES: u64 = 32 << 20;

/// An image as a request gives it, with the field it came from.
pub struct ImageRef {
    pub field: String,
    pub source: Source,
}

pub enum Source {
    /// Base64 data (a data URL's payload, or an Anthropic base64 block).
    Base64(String),
    /// An http(s) URL.
    Url(String),
}

impl ImageRef {
    /// An OpenAI `image_url.url`: a `data:` URL or an http(s) one.
    pub fn from_url(field: String, url: &str, flavor: Flavor) -> ApiResult<Self> {
        if let Some(rest) = url.strip_prefix("data:") {
            let Some((meta, data)) = rest.split_once(',') else {
                return Err(ApiError::bad_request(flavor, Some(&field), "is a data URL without a `,`"));
            };
            if !meta.ends_with(";base64") {
                return Err(ApiError::bad_request(flavor, Some(&field), "is a data URL that is not base64"));
            }
            return Ok(ImageRef { field, source: Source::Base64(data.to_string()) });
        }
        if url.starts_with("http://") || url.starts_with("https://") {
            return Ok(ImageRef { field, source: Source::Url(url.to_string()) });
        }
        Err(ApiError::bad_request(
            flavor,
            Some(&field),
            "must be a data URL (data:image/...;base64,...) or an http(s) URL",
        ))
    }

    async fn bytes(&self, support: &ImageSupport, flavor: Flavor) -> ApiResult<Vec<u8>> {
        let bad = |m: String| ApiError::bad_request(flavor, Some(&self.field), m);
        match &self.source {
            Source::Base64(data) => (base64::engine::general_purpose::STANDARD)
                .decode(data.trim())
                .map_err(|e| bad(format!("is not valid base64: {e}"))),
            Source::Url(url) if !support.allow_remote => Err(bad(format!(
                "is a remote URL ({url}); this server fetches none (start it with --allow-remote-images)"
            ))),
            Source::Url(url) => {
                let url = url.clone();
                let fetched = tokio::task::spawn_blocking(move || -> Result<Vec<u8>, String> {
                    let resp = ureq::get(&url).call().map_err(|e| format!("could not be fetched: {e}"))?;
                    let mut out = Vec::new();
                    (resp.into_reader().take(MAX_REMOTE_BYTES + 1).read_to_end(&mut out))
                        .map_err(|e| format!("could not be read: {e}"))?;
                    Ok(out)
                })
                .await
                .map_err(|e| internal(flavor, format!("fetching an image failed: {e}")))?;
                let out = fetched.map_err(bad)?;
                if out.len() as u64 > MAX_REMOTE_BYTES {
                    return Err(bad(format!("is larger than {MAX_REMOTE_BYTES} bytes")));
                }
                Ok(out)
            }
        }
    }
}

/// Refuses images for a model that takes none (before its template sees
/// them: a text-only template fails on image parts in its own words).
pub fn supported(support: Option<&ImageSupport>, refs: &[ImageRef], flavor: Flavor) -> ApiResult<()> {
    match (refs.first(), support) {
        (Some(first), None) => Err(ApiError::bad_request(flavor, Some(&first.field), "this model takes no images")),
        _ => Ok(()),
    }
}

/// Prepares a request's images (none: nothing to do) and widens the
/// prompt's markers; the images come back in prompt order.
pub async fn prepare(
    support: Option<&ImageSupport>,
    refs: &[ImageRef],
    prompt: &mut Vec<u32>,
    flavor: Flavor,
) -> ApiResult<Vec<Arc<PreparedImage>>> {
    supported(support, refs, flavor)?;
    let Some(support) = support.filter(|_| !refs.is_empty()) else { return Ok(Vec::new()) };
    if refs.len() > support.max_images {
        return Err(ApiError::bad_request(
            flavor,
            Some(&refs[support.max_images].field),
            format!("is one image too many: a request may carry {}", support.max_images),
        ));
    }
    let mut images = Vec::with_capacity(refs.len());
    for r in refs {
        let bytes = r.bytes(support, flavor).await?;
        let (processor, limits) = (support.processor.clone(), support.limits);
        // Decoding and resizing take milliseconds to seconds: off the async workers.
        let img = tokio::task::spawn_blocking(move || prepare_image(&bytes, &processor, &limits))
            .await
            .map_err(|e| internal(flavor, format!("preparing an image failed: {e}")))?
            .map_err(|e| ApiError::bad_request(flavor, Some(&r.field), e.to_string()))?;
        images.push(Arc::new(img));
    }
    let counts: Vec<usize> = images.iter().map(|i| i.tokens(support.merge_size)).collect();
    *prompt = expand_placeholders(prompt, support.image_token_id, &counts)
        .map_err(|e| ApiError::bad_request(flavor, Some("messages"), format!("the chat template: {e}")))?;
    Ok(images)
}

/// A task of ours that panicked or was cancelled: the server's fault, a 500.
fn internal(flavor: Flavor, message: String) -> ApiError {
    ApiError::with_status(flavor, axum::http::StatusCode::INTERNAL_SERVER_ERROR, message)
}
