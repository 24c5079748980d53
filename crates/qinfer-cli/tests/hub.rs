//! `--model OWNER/NAME[:REVISION|:FILE.gguf]` against a mock Hugging Face
//! hub served on 127.0.0.1 by this test (the hub's file-listing and
//! `resolve` endpoints, with the headers the hf-hub client reads): the repo's
//! safetensors model is fetched into `$HF_HOME/hub` and generates
//! transformers' tokens; other weight formats are not fetched; the cache
//! serves it again with `HF_HUB_OFFLINE=1`; one GGUF file of a repo is
//! fetched by name; missing repos and files are clear errors.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};

type Repos = HashMap<String, Vec<(String, Vec<u8>)>>;

/// Serves `repos` until the process ends; returns its address and the
/// paths it was asked for.
fn mock_hub(repos: Repos) -> (String, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = format!("http://{}", listener.local_addr().unwrap());
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut line = String::new();
            if reader.read_line(&mut line).is_err() {
                continue;
            }
            let path = line.split_whitespace().nth(1).unwrap_or("/").to_string();
            let mut range = None;
            loop {
                let mut h = String::new();
                if reader.read_line(&mut h).is_err() || h.trim().is_empty() {
                    break;
                }
                if let Some((k, v)) = h.split_once(':')
                    && k.eq_ignore_ascii_case("range")
                {
                    range = v.trim().strip_prefix("bytes=").map(str::to_string);
                }
            }
            log.lock().unwrap().push(path.clone());
            let (status, headers, body) = answer(&repos, &path, range.as_deref());
            let mut head = format!("HTTP/1.1 {status}\r\nConnection: close\r\nContent-Length: {}\r\n", body.len());
            for (k, v) in headers {
                head.push_str(&format!("{k}: {v}\r\n"));
            }
            head.push_str("\r\n");
            let _ = stream.write_all(head.as_bytes());
            let _ = stream.write_all(&body);
        }
    });
    (addr, seen)
}

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

fn answer(repos: &Repos, path: &str, range: Option<&str>) -> (&'static str, Vec<(String, String)>, Vec<u8>) {
    let not_found = ("404 Not Found", vec![], b"{\"error\": \"Repository not found\"}".to_vec());
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    match parts.as_slice() {
        ["api", "models", owner, name, "revision", _rev] => {
            let Some(files) = repos.get(&format!("{owner}/{name}")) else { return not_found };
            let siblings: Vec<_> = files.iter().map(|(f, _)| serde_json::json!({"rfilename": f})).collect();
            let body = serde_json::json!({"sha": COMMIT, "siblings": siblings}).to_string().into_bytes();
            ("200 OK", vec![("Content-Type".into(), "application/json".into())], body)
        }
        [owner, name, "resolve", _rev, file @ ..] => {
            let file = file.join("/");
            let Some(bytes) = repos.get(&format!("{owner}/{name}")).and_then(|fs| fs.iter().find(|(f, _)| *f == file))
            else {
                return not_found;
            };
            let bytes = &bytes.1;
            let (start, end) = match range.and_then(|r| r.split_once('-')) {
                Some((s, e)) => {
                    let s: usize = s.parse().unwrap_or(0);
                    let e: usize = e.parse().unwrap_or(bytes.len().saturating_sub(1));
                    (s, e.min(bytes.len().saturating_sub(1)))
                }
                None => (0, bytes.len().saturating_sub(1)),
            };
            let etag = format!(
                "\"{:016x}{}\"",
                bytes.iter().fold(0xcbf29ce484222325u64, |h, b| (h ^ *b as u64).wrapping_mul(0x100000001b3)),
                bytes.len()
            );
            let headers = vec![
                ("ETag".into(), etag),
                ("X-Repo-Commit".into(), COMMIT.into()),
                ("Content-Range".into(), format!("bytes {start}-{end}/{}", bytes.len())),
            ];
            let body = if start < bytes.len() { bytes[start..=end].to_vec() } else { Vec::new() };
            ("206 Partial Content", headers, body)
        }
        _ => not_found,
    }
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn qinfer(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_qinfer"));
    c.args(args).env_remove("HF_HUB_OFFLINE").env_remove("HF_TOKEN");
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("qinfer runs")
}

fn read(p: PathBuf) -> Vec<u8> {
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn ids(v: &serde_json::Value) -> Vec<u64> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect()
}

#[test]
fn models_come_from_a_hub_into_its_cache() {
    let tiny = fixtures().join("tiny/qwen3");
    let mut repos = Repos::new();
    repos.insert(
        "test-org/tiny-qwen3".into(),
        vec![
            ("config.json".into(), read(tiny.join("config.json"))),
            ("generation_config.json".into(), read(tiny.join("generation_config.json"))),
            ("model.safetensors".into(), read(tiny.join("model.safetensors"))),
            ("pytorch_model.bin".into(), b"not fetched".to_vec()),
            ("README.md".into(), b"# tiny".to_vec()),
        ],
    );
    let gguf = read(fixtures().join("gguf_arch/qwen3moe/model.gguf"));
    repos.insert("test-org/tiny-GGUF".into(), vec![("tiny-Q8_0.gguf".into(), gguf.clone())]);
    let (endpoint, seen) = mock_hub(repos);
    let home = std::env::temp_dir().join(format!("qinfer-hub-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&home);
    let home_s = home.to_str().unwrap();
    let online = [("HF_ENDPOINT", endpoint.as_str()), ("HF_HOME", home_s)];

    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tiny.join("reference.json")).unwrap()).unwrap();
    let prompt: Vec<String> = ids(&r["greedy"]["prompt"]).iter().map(u64::to_string).collect();
    let want = ids(&r["greedy"]["new_tokens"]);
    let n = want.len().to_string();
    let generate = |model: &str, env: &[(&str, &str)]| {
        let args =
            ["generate", "--model", model, "--tokens", &prompt.join(","), "--max-tokens", &n, "--ignore-eos", "--json"];
        qinfer(&args, env)
    };
    for model in ["test-org/tiny-qwen3", "test-org/tiny-qwen3:main"] {
        let o = generate(model, &online);
        assert!(o.status.success(), "{model}: {}", String::from_utf8_lossy(&o.stderr));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(ids(&v["tokens"]), want, "{model}");
    }
    // In the standard cache layout, byte-identical; the .bin never asked for.
    let snap = home.join("hub/models--test-org--tiny-qwen3/snapshots").join(COMMIT);
    assert_eq!(read(snap.join("model.safetensors")), read(tiny.join("model.safetensors")));
    assert!(!seen.lock().unwrap().iter().any(|p| p.ends_with("pytorch_model.bin")), "{:?}", seen.lock().unwrap());
    // Offline: the cache alone, with the hub unreachable.
    let offline = [("HF_ENDPOINT", "http://127.0.0.1:9"), ("HF_HOME", home_s), ("HF_HUB_OFFLINE", "1")];
    let o = generate("test-org/tiny-qwen3", &offline);
    assert!(o.status.success(), "offline: {}", String::from_utf8_lossy(&o.stderr));
    let o = generate("test-org/never-fetched", &offline);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("HF_HUB_OFFLINE"));
    // One GGUF file by name; a GGUF repo without one names its files.
    let o = qinfer(
        &[
            "generate",
            "--model",
            "test-org/tiny-GGUF:tiny-Q8_0.gguf",
            "--tokens",
            "1,2,3",
            "--max-tokens",
            "2",
            "--json",
        ],
        &online,
    );
    assert!(o.status.success(), "gguf: {}", String::from_utf8_lossy(&o.stderr));
    let blob = home.join("hub/models--test-org--tiny-GGUF/snapshots").join(COMMIT).join("tiny-Q8_0.gguf");
    assert_eq!(read(blob), gguf);
    let o = generate("test-org/tiny-GGUF", &online);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("tiny-Q8_0.gguf"), "{err}");
    // Missing repos and files.
    for (model, what) in [("test-org/missing", "test-org/missing"), ("test-org/tiny-GGUF:nope.gguf", "nope.gguf")] {
        let o = generate(model, &online);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(what), "{model}: {err}");
    }
    let _ = std::fs::remove_dir_all(&home);
}
