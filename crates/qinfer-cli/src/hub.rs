//! `--model` as a Hugging Face repo id, resolved through the `hf-hub` crate
//! into the standard Hugging Face cache (`$HF_HOME/hub`, shared with
//! Python's `huggingface_hub`):
//!
//! - `Qwen/Qwen3-0.6B`: the repo's main revision; its config, tokenizer,
//!   templates and safetensors weights are fetched (other weight formats are
//!   skipped);
//! - `Qwen/Qwen3-0.6B:REVISION`: a branch, tag or commit;
//! - `Qwen/Qwen3-0.6B-GGUF:Qwen3-0.6B-Q8_0.gguf`: one GGUF file of the repo.
//!
//! `HF_ENDPOINT` points at a mirror, `HF_TOKEN` (or the cached token)
//! authenticates, and `HF_HUB_OFFLINE=1` uses the cache only.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use hf_hub::api::sync::ApiBuilder;
use hf_hub::{Cache, Repo, RepoType};

/// Whether `spec` names a repo (`owner/name`, optionally `:suffix`) rather
/// than a local path.
pub fn looks_like_repo(spec: &str) -> bool {
    let id = spec.split_once(':').map_or(spec, |(id, _)| id);
    let mut parts = id.split('/');
    let ok = |p: Option<&str>| {
        p.is_some_and(|p| {
            !p.is_empty() && !p.starts_with('.') && p.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        })
    };
    ok(parts.next()) && ok(parts.next()) && parts.next().is_none() && !Path::new(spec).exists()
}

/// Where models come from and go.
pub struct Hub {
    pub offline: bool,
}

impl Hub {
    pub fn from_env() -> Hub {
        let offline = std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| matches!(v.trim(), "1" | "true" | "TRUE" | "yes"));
        Hub { offline }
    }

    /// The local path of `spec`: a model directory, or a GGUF file.
    pub fn resolve(&self, spec: &str) -> Result<PathBuf> {
        let (id, suffix) = match spec.split_once(':') {
            Some((id, s)) if !s.is_empty() => (id, Some(s)),
            _ => (spec, None),
        };
        let (revision, file) = match suffix {
            Some(s) if s.ends_with(".gguf") => ("main".to_string(), Some(s)),
            Some(s) => (s.to_string(), None),
            None => ("main".to_string(), None),
        };
        let repo = Repo::with_revision(id.to_string(), RepoType::Model, revision.clone());
        if self.offline {
            let cached = Cache::from_env().repo(repo);
            let want = file.unwrap_or("config.json");
            let path = cached.get(want).with_context(|| {
                format!(
                    "HF_HUB_OFFLINE is set and {want} of {id} (revision {revision}) is not in the Hugging Face cache"
                )
            })?;
            return Ok(if file.is_some() { path } else { parent(&path)? });
        }
        let api = ApiBuilder::from_env()
            .with_progress(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .build()
            .context("setting up the Hugging Face client")?;
        let repo = api.repo(repo);
        if let Some(f) = file {
            return repo.get(f).with_context(|| format!("downloading {f} from {id}"));
        }
        let info = repo.info().with_context(|| format!("listing the files of {id} (revision {revision})"))?;
        let names: Vec<&str> = info.siblings.iter().map(|s| s.rfilename.as_str()).collect();
        if !names.iter().any(|n| n.ends_with(".safetensors")) {
            let ggufs: Vec<&str> = names.iter().copied().filter(|n| n.ends_with(".gguf")).collect();
            if !ggufs.is_empty() {
                bail!("{id} holds GGUF files: name one as {id}:FILE (files: {})", ggufs.join(", "));
            }
            bail!("{id} has no safetensors or GGUF weights");
        }
        let mut config = None;
        for name in names.iter().copied().filter(|n| wanted(n)) {
            let path = repo.get(name).with_context(|| format!("downloading {name} from {id}"))?;
            if name == "config.json" {
                config = Some(path);
            }
        }
        let config = config.with_context(|| format!("{id} has no config.json"))?;
        parent(&config)
    }
}

fn parent(p: &Path) -> Result<PathBuf> {
    p.parent().map(Path::to_path_buf).with_context(|| format!("{} has no parent directory", p.display()))
}

/// The files a model directory needs: configs, tokenizer, templates,
/// safetensors weights (not the repo's other weight formats or media).
fn wanted(name: &str) -> bool {
    const SKIP: [&str; 10] = [".bin", ".pt", ".pth", ".h5", ".msgpack", ".onnx", ".gguf", ".ot", ".png", ".jpg"];
    !SKIP.iter().any(|s| name.ends_with(s)) && !name.starts_with("onnx/") && !name.starts_with("openvino/")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repo_ids_and_paths() {
        assert!(looks_like_repo("Qwen/Qwen3-0.6B"));
        assert!(looks_like_repo("Qwen/Qwen3-0.6B-GGUF:Qwen3-0.6B-Q8_0.gguf"));
        assert!(looks_like_repo("org/model:v1.0"));
        for not in ["model.gguf", "/abs/dir", "./rel/dir", "a/b/c", "a/.hidden", "../x"] {
            assert!(!looks_like_repo(not), "{not}");
        }
        assert!(
            wanted("model-00001-of-00002.safetensors")
                && wanted("1_Pooling/config.json")
                && wanted("chat_template.jinja")
        );
        assert!(!wanted("pytorch_model.bin") && !wanted("onnx/model.onnx") && !wanted("model-q4.gguf"));
    }
}
