//! The `qinfer` command's contracts, run as a user would run them.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn qinfer(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_qinfer")).args(args).output().expect("qinfer runs")
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny").join(name)
}

fn reference(name: &str) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture(name).join("reference.json")).unwrap()).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u64> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect()
}

fn csv(v: &[u64]) -> String {
    v.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(",")
}

fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("qinfer-cli-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn generate_json_prints_only_new_tokens_matching_transformers() {
    let r = reference("qwen3");
    let prompt = ids(&r["greedy"]["prompt"]);
    let want = ids(&r["greedy"]["new_tokens"]);
    let dir = fixture("qwen3");
    let n = want.len().to_string();
    let o = qinfer(&[
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--tokens",
        &csv(&prompt),
        "--max-tokens",
        &n,
        "--ignore-eos",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("stdout is one JSON object");
    assert_eq!(ids(&v["tokens"]), want);
    assert!(v["text"].is_string());
}

/// `generate --lora`: peft's greedy continuation of the adapted model
/// (tests/fixtures/lora), in PEFT's layout and in mlx-lm's.
#[test]
fn generate_with_a_lora_adapter_matches_peft() {
    let lora = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/lora/qwen3_all");
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(lora.join("reference.json")).unwrap()).unwrap();
    let prompt = ids(&r["greedy"]["prompt"]);
    let want = ids(&r["greedy"]["new_tokens"]);
    let base = ids(&reference("qwen3")["greedy"]["new_tokens"]);
    assert_ne!(want, base);
    for adapter in [lora.clone(), lora.join("mlx")] {
        let dir = fixture("qwen3");
        let o = qinfer(&[
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--lora",
            adapter.to_str().unwrap(),
            "--tokens",
            &csv(&prompt),
            "--max-tokens",
            &want.len().to_string(),
            "--ignore-eos",
            "--json",
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("stdout is one JSON object");
        assert_eq!(ids(&v["tokens"]), want, "{}", adapter.display());
    }
    // bench and score take it too: score's logits are the adapted model's.
    let o = qinfer(&[
        "bench",
        "--model",
        fixture("qwen3").to_str().unwrap(),
        "--lora",
        lora.to_str().unwrap(),
        "-p",
        "8",
        "-n",
        "4",
        "-r",
        "1",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["lora"].as_str(), lora.to_str());
    let out = temp_dir("lora-score").join("logits.npy");
    let input = ids(&r["input_ids"]);
    let o = qinfer(&[
        "score",
        "--model",
        fixture("qwen3").to_str().unwrap(),
        "--lora",
        lora.to_str().unwrap(),
        "--tokens",
        &csv(&input),
        "--logits-out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let (_, got) = qinfer::npy::read_f32(&out).unwrap();
    let (_, want) = qinfer::npy::read_f32(&lora.join("logits.npy")).unwrap();
    let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(worst <= 1e-4, "score --lora: max |Δlogit| {worst}");
    // An adapter for another model is refused, naming the projection.
    let o = qinfer(&[
        "generate",
        "--model",
        fixture("qwen2").to_str().unwrap(),
        "--lora",
        lora.to_str().unwrap(),
        "--tokens",
        "1,2,3",
        "--json",
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("LoRA adapter"), "{}", stderr(&o));
}

/// With no token asked for, nothing runs, and the rates say so (not a
/// prompt rate over no time).
#[test]
fn generate_of_no_tokens_reports_no_prompt_run() {
    let dir = fixture("qwen3");
    let o = qinfer(&["generate", "--model", dir.to_str().unwrap(), "--tokens", "1,2,3", "--max-tokens", "0"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains("prompt: 0 tokens, 0.0 tok/s | decode: 0 tokens, 0.0 tok/s"), "{e}");
}

#[test]
fn score_writes_reference_logits_as_npy() {
    let r = reference("qwen2");
    let input = ids(&r["input_ids"]);
    let out = temp_dir("score").join("logits.npy");
    let dir = fixture("qwen2");
    let o = qinfer(&[
        "score",
        "--model",
        dir.to_str().unwrap(),
        "--tokens",
        &csv(&input),
        "--logits-out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let (shape, got) = qinfer::npy::read_f32(&out).unwrap();
    let (wshape, want) = qinfer::npy::read_f32(&dir.join("logits.npy")).unwrap();
    assert_eq!(shape, wshape);
    let d = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(d <= 1e-3, "max |Δ| {d}");
}

#[test]
fn embed_writes_sentence_transformers_vectors() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/pooling/qwen3_embedding_mean");
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
    let tmp = temp_dir("embed");
    // Strings and {"text"} objects, one per line.
    let lines: Vec<String> = (r["texts"].as_array().unwrap().iter().enumerate())
        .map(|(i, t)| if i % 2 == 0 { t.to_string() } else { serde_json::json!({"text": t}).to_string() })
        .collect();
    let input = tmp.join("texts.jsonl");
    std::fs::write(&input, lines.join("\n") + "\n").unwrap();
    let out = tmp.join("vectors.npy");
    let args = ["embed", "--model", dir.to_str().unwrap(), "--input", input.to_str().unwrap(), "--output"];
    let o = qinfer(&[&args[..], &[out.to_str().unwrap()]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let (shape, got) = qinfer::npy::read_f32(&out).unwrap();
    let want: Vec<f32> = (r["embeddings"].as_array().unwrap().iter())
        .flat_map(|v| v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect::<Vec<_>>())
        .collect();
    assert_eq!(shape, vec![lines.len(), want.len() / lines.len()]);
    let d = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(d <= 1e-5, "max |Δ| {d}");
    // A bad line fails the run, naming it, and writes nothing.
    std::fs::write(&input, "\"fine\"\n42\n").unwrap();
    let bad = tmp.join("bad.jsonl");
    let o = qinfer(&[&args[..], &[bad.to_str().unwrap()]].concat());
    assert!(!o.status.success() && stderr(&o).contains("texts.jsonl:2"), "{}", stderr(&o));
    assert!(!bad.exists());
}

#[test]
fn score_into_a_missing_directory_fails_without_output() {
    let dir = fixture("llama");
    let out = temp_dir("noout").join("missing/sub/logits.npy");
    let o = qinfer(&[
        "score",
        "--model",
        dir.to_str().unwrap(),
        "--tokens",
        "1,2,3",
        "--logits-out",
        out.to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("logits.npy"), "{}", stderr(&o));
    assert!(!out.exists());
}

#[test]
fn inspect_reports_architecture_and_parameters() {
    let dir = fixture("qwen3");
    let o = qinfer(&["inspect", dir.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let s = String::from_utf8_lossy(&o.stdout);
    assert!(s.contains("architecture:  qwen3"), "{s}");
    assert!(s.contains("parameters:"), "{s}");
    assert!(s.contains("BF16"), "{s}");
}

#[test]
fn bad_inputs_are_clear_errors() {
    // Missing path.
    let o = qinfer(&["inspect", "/nonexistent/model"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("/nonexistent/model"), "{}", stderr(&o));

    // A missing file: its path and the system's reason, said once.
    let o = qinfer(&["bench", "--random-weights", "--config", "/nonexistent/config.json"]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(e.contains("/nonexistent/config.json") && e.matches("os error").count() == 1, "{e}");

    // Unknown architecture: the error lists what is supported.
    let d = temp_dir("arch");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("llama").join("config.json")).unwrap()).unwrap();
    cfg["model_type"] = "gpt_neox".into();
    std::fs::write(d.join("config.json"), cfg.to_string()).unwrap();
    std::fs::copy(fixture("llama").join("model.safetensors"), d.join("model.safetensors")).unwrap();
    let o = qinfer(&["inspect", d.to_str().unwrap()]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(e.contains("gpt_neox") && e.contains("qwen3") && e.contains("config.json"), "{e}");

    // Truncated weights: the error names the file.
    let d = temp_dir("trunc");
    std::fs::copy(fixture("llama").join("config.json"), d.join("config.json")).unwrap();
    let bytes = std::fs::read(fixture("llama").join("model.safetensors")).unwrap();
    std::fs::write(d.join("model.safetensors"), &bytes[..bytes.len() / 2]).unwrap();
    let o = qinfer(&["generate", "--model", d.to_str().unwrap(), "--tokens", "1,2", "--max-tokens", "2"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("model.safetensors"), "{}", stderr(&o));

    // Token ids beyond the vocabulary.
    let dir = fixture("llama");
    let o = qinfer(&["generate", "--model", dir.to_str().unwrap(), "--tokens", "1,999999", "--max-tokens", "2"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("999999"), "{}", stderr(&o));

    // --prompt on a model without a tokenizer.
    let o = qinfer(&["generate", "--model", dir.to_str().unwrap(), "--prompt", "hi", "--max-tokens", "2"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("tokenizer"), "{}", stderr(&o));
}

/// `qinfer kernels` names what is wrong and writes nothing: a build without
/// CUDA says so, and a CUDA build rejects an architecture NVRTC does not
/// name (`sm_90a` is a real GPU's, not a virtual architecture).
#[test]
fn kernels_say_what_is_wrong_and_write_nothing() {
    let cache = temp_dir("kernels");
    let o = Command::new(env!("CARGO_BIN_EXE_qinfer"))
        .args(["kernels", "--arch", "sm_90a"])
        .env("QINFER_CACHE", &cache)
        .output()
        .unwrap();
    assert!(!o.status.success());
    let e = stderr(&o);
    if cfg!(feature = "cuda") {
        assert!(e.contains("--arch sm_90a") && e.contains("compute_90a"), "{e}");
    } else {
        assert!(e.contains("no CUDA support") && e.contains("--features cuda"), "{e}");
    }
    assert!(!cache.join("kernels").exists(), "a failed kernels command wrote to the cache");
}

#[test]
fn run_without_the_default_model_says_how_to_fetch_it() {
    let empty = temp_dir("cache");
    let o =
        Command::new(env!("CARGO_BIN_EXE_qinfer")).args(["run", "hello"]).env("QINFER_CACHE", &empty).output().unwrap();
    assert!(!o.status.success());
    assert!(stderr(&o).contains("fetch_default_model.sh"), "{}", stderr(&o));
}

/// The default model where `scripts/fetch_default_model.sh` puts it
/// (`$QINFER_CACHE/models`, else `~/.cache/qinfer/models`), as
/// crates/qinfer/tests/common/mod.rs finds it: None when absent, which
/// `.ci/run` (`QINFER_CI=1`) turns into a failure.
fn default_model() -> Option<PathBuf> {
    let cache = std::env::var_os("QINFER_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/qinfer")));
    let p = cache.map(|c| c.join("models/SmolLM2-135M-Instruct.Q4_1.gguf"));
    if let Some(p) = p.filter(|p| p.exists()) {
        return Some(p);
    }
    let reason = "the default model is absent (scripts/fetch_default_model.sh fetches it)";
    assert!(std::env::var_os("QINFER_CI").is_none_or(|v| v != "1"), "QINFER_CI=1 forbids skipping: {reason}");
    eprintln!("skipping: {reason}");
    None
}

#[test]
fn run_answers_a_question_with_the_default_model() {
    if default_model().is_none() {
        return;
    }
    let o = qinfer(&["run", "--max-tokens", "24", "Name the capital city of France."]);
    assert!(o.status.success(), "{}", stderr(&o));
    let answer = String::from_utf8_lossy(&o.stdout);
    assert!(answer.contains("Paris"), "{answer}");
    assert!(stderr(&o).contains("tok/s"), "{}", stderr(&o));
}

#[test]
fn run_with_speculation_gives_the_same_greedy_answer() {
    if default_model().is_none() {
        return;
    }
    let prompt = "Repeat this list exactly twice: apple, banana, cherry, date, elderberry, fig, grape.";
    let plain = qinfer(&["run", "--temperature", "0", "--max-tokens", "60", prompt]);
    assert!(plain.status.success(), "{}", stderr(&plain));
    for spec in [&["--speculative", "ngram"][..], &["--speculative", "ngram", "--fixed-draft-tokens"]] {
        let o = qinfer(&[&["run", "--temperature", "0", "--max-tokens", "60"], spec, &[prompt]].concat());
        assert!(o.status.success(), "{}", stderr(&o));
        assert_eq!(String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&plain.stdout), "{spec:?}");
        assert!(stderr(&o).contains("drafts accepted"), "{}", stderr(&o));
    }
    let o = qinfer(&["run", "--speculative", "mtp", "hello"]);
    assert!(!o.status.success() && stderr(&o).contains("multi-token-prediction"), "{}", stderr(&o));
}

/// `generate --speculative` (through the engine) prints transformers' greedy
/// tokens, as plain `generate` does: prompt lookup on a dense model, and the
/// hybrid's own multi-token-prediction head.
#[test]
fn generate_with_speculation_gives_transformers_greedy_tokens() {
    for (name, specs) in [
        ("qwen3", &[&["--speculative", "ngram"][..], &["--speculative", "ngram", "--fixed-draft-tokens"]][..]),
        ("qwen3_next", &[&["--speculative", "mtp", "--draft-tokens", "2"][..], &["--speculative", "ngram"]]),
    ] {
        let r = reference(name);
        let (prompt, want) = (ids(&r["greedy"]["prompt"]), ids(&r["greedy"]["new_tokens"]));
        let dir = fixture(name);
        let n = want.len().to_string();
        for spec in specs {
            let args = ["generate", "--model", dir.to_str().unwrap(), "--tokens", &csv(&prompt), "--max-tokens", &n];
            let o = qinfer(&[&args[..], &["--ignore-eos", "--json"], spec].concat());
            assert!(o.status.success(), "{name} {spec:?}: {}", stderr(&o));
            let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("stdout is one JSON object");
            assert_eq!(ids(&v["tokens"]), want, "{name} {spec:?}");
        }
    }
}

/// `--speculative mtp:PATH`: a GGUF converted without its head (`--no-mtp`)
/// with the head from the file llama.cpp's converter writes with `--mtp`
/// changes no greedy token; a head for another model is refused by name.
#[test]
fn a_head_from_its_own_gguf_changes_no_greedy_token() {
    let root = fixture("qwen3").join("../..");
    let (model, head) = (root.join("gguf_arch/qwen35/model.gguf"), root.join("gguf_mtp/qwen35/mtp-model.gguf"));
    let args = ["generate", "--model", model.to_str().unwrap(), "--tokens", "5,9,17,33", "--max-tokens", "12"];
    let plain = qinfer(&[&args[..], &["--ignore-eos", "--json"]].concat());
    assert!(plain.status.success(), "{}", stderr(&plain));
    let spec = format!("mtp:{}", head.display());
    let o = qinfer(&[&args[..], &["--ignore-eos", "--json", "--speculative", &spec, "--fixed-draft-tokens"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let tokens = |o: &std::process::Output| {
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("stdout is one JSON object");
        ids(&v["tokens"])
    };
    assert_eq!(tokens(&o), tokens(&plain));
    let other = root.join("gguf_arch/qwen35moe/model.gguf");
    let o = qinfer(&["generate", "--model", other.to_str().unwrap(), "--tokens", "5", "--speculative", &spec]);
    assert!(!o.status.success() && stderr(&o).contains("is no head for"), "{}", stderr(&o));
}

#[test]
fn bench_json_reports_pp_and_tg() {
    let dir = fixture("qwen3");
    let o = qinfer(&["bench", "--model", dir.to_str().unwrap(), "-p", "16", "-n", "4", "-r", "2", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let tests: Vec<&str> = v["results"].as_array().unwrap().iter().map(|r| r["test"].as_str().unwrap()).collect();
    assert_eq!(tests, vec!["pp16", "tg4"]);
    for r in v["results"].as_array().unwrap() {
        assert!(r["avg_ts"].as_f64().unwrap() > 0.0);
    }
}

#[test]
fn bench_concurrency_reports_aggregate_and_per_sequence_rates() {
    let dir = fixture("qwen3_next");
    let o = qinfer(&[
        "bench",
        "--model",
        dir.to_str().unwrap(),
        "-p",
        "16",
        "-n",
        "4",
        "-r",
        "1",
        "--concurrency",
        "1,3",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let rows = v["results"].as_array().unwrap();
    let got: Vec<(String, u64)> =
        rows.iter().map(|r| (r["test"].as_str().unwrap().to_string(), r["concurrency"].as_u64().unwrap())).collect();
    let want = [("pp16", 1), ("tg4", 1), ("pp16", 3), ("tg4", 3)].map(|(t, c)| (t.to_string(), c));
    assert_eq!(got, want);
    for r in rows {
        assert!(r["avg_ts"].as_f64().unwrap() > 0.0 && r["kv_cache_bytes"].as_u64().unwrap() > 0);
        if r["test"] == "tg4" {
            let (agg, per) = (r["avg_ts"].as_f64().unwrap(), r["per_seq_ts"].as_f64().unwrap());
            assert!((agg / r["concurrency"].as_f64().unwrap() - per).abs() < 1e-6 * agg);
        }
    }
}

#[test]
fn batch_runs_every_valid_line_in_input_order_and_names_bad_ones() {
    let Some(model) = default_model() else { return };
    let model = model.to_str().unwrap();
    let dir = temp_dir("batch");
    let input = dir.join("requests.jsonl");
    let output = dir.join("results.jsonl");
    let lines = [
        r#"{"id": "raw", "prompt": "The capital of France is", "max_tokens": 16}"#,
        r#"{"id": 7, "prompt": 5}"#,
        r#"{"id": "chat", "messages": [{"role": "user", "content": "Name the capital city of France."}], "max_tokens": 24}"#,
        r#"{"id": "stop", "prompt": "The capital of France is", "max_tokens": 16, "stop": ["\n"]}"#,
        "not json",
    ];
    std::fs::write(&input, lines.join("\n")).unwrap();
    let o =
        qinfer(&["batch", "--model", model, "--input", input.to_str().unwrap(), "--output", output.to_str().unwrap()]);
    assert!(!o.status.success(), "two lines are bad: the exit status says so");
    let err = stderr(&o);
    assert!(err.contains(":2: field `prompt` must be a string") && err.contains(":5: not JSON"), "{err}");
    let rows: Vec<serde_json::Value> =
        std::fs::read_to_string(&output).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let ids: Vec<String> = rows.iter().map(|r| r["id"].to_string()).collect();
    assert_eq!(ids, ["\"raw\"", "7", "\"chat\"", "\"stop\"", "null"]);
    assert!(rows[1]["error"].as_str().unwrap().contains("line 2"));
    // The raw prompt continues as `generate` continues it (the one-sequence path).
    let g =
        qinfer(&["generate", "--model", model, "--prompt", "The capital of France is", "--max-tokens", "16", "--json"]);
    assert!(g.status.success(), "{}", stderr(&g));
    let g: serde_json::Value = serde_json::from_slice(&g.stdout).unwrap();
    assert_eq!(rows[0]["tokens"], g["tokens"]);
    assert_eq!(rows[0]["text"], g["text"]);
    assert_eq!(rows[0]["usage"]["completion_tokens"], 16);
    assert!(rows[2]["text"].as_str().unwrap().contains("Paris"), "{}", rows[2]);
    // The stop string ends the text before it; the finish says so.
    let full = rows[0]["text"].as_str().unwrap();
    let cut = &full[..full.find('\n').expect("the continuation has a line break")];
    assert_eq!((rows[3]["text"].as_str().unwrap(), rows[3]["finish_reason"].as_str().unwrap()), (cut, "stop"));
    assert!(!dir.join("results.partial").exists());
}

/// `--kv-cache`: an encoded cache runs (at 8 bits the fixture's greedy
/// continuation is still transformers'), and formats a device or model
/// cannot take are errors naming the format, the device or the head size.
#[test]
fn kv_cache_formats_run_or_say_why_not() {
    let r = reference("qwen3");
    let (prompt, want) = (ids(&r["greedy"]["prompt"]), ids(&r["greedy"]["new_tokens"]));
    let dir = fixture("qwen3");
    let n = want.len().to_string();
    let args = ["generate", "--model", dir.to_str().unwrap(), "--tokens", &csv(&prompt), "--max-tokens", &n];
    let o = qinfer(&[&["--kv-cache", "turbo8"], &args[..], &["--ignore-eos", "--json"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(ids(&v["tokens"]), want);

    let o = qinfer(&[&["--kv-cache", "q8_0"], &args[..]].concat());
    assert!(!o.status.success());
    assert!(stderr(&o).contains("q8_0") && stderr(&o).contains("k8v4"), "{}", stderr(&o));

    // On CUDA an encoded format is the batching engine's; here (no GPU, or
    // a build without CUDA) asking for it fails on the device, by name.
    // Which formats the CUDA pool takes is the CUDA backend's unit test.
    let o = qinfer(&[&["--device", "cuda", "--kv-cache", "turbo4"], &args[..]].concat());
    assert!(!o.status.success());
    assert!(stderr(&o).to_lowercase().contains("cuda"), "{}", stderr(&o));

    // TurboQuant's rotation needs a power-of-two head size.
    let d = temp_dir("kvhead");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    cfg["head_dim"] = 24.into();
    let path = d.join("config.json");
    std::fs::write(&path, cfg.to_string()).unwrap();
    let bench = ["bench", "--random-weights", "--config", path.to_str().unwrap(), "-p", "4", "-n", "2", "-r", "1"];
    let o = qinfer(&[&["--kv-cache", "turbo4"], &bench[..]].concat());
    assert!(!o.status.success());
    assert!(stderr(&o).contains("head dimension") && stderr(&o).contains("24"), "{}", stderr(&o));
    // fp8 has no rotation, so the same model runs.
    let o = qinfer(&[&["--kv-cache", "fp8"], &bench[..]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
}

/// `perplexity --kl-base-kv-cache`: a cache against itself diverges by
/// nothing and agrees on every top token; a 3-bit cache diverges.
#[test]
fn perplexity_reports_kl_divergence_between_kv_formats() {
    let Some(model) = default_model() else {
        return;
    };
    let text = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/text/gpl3_excerpt.txt");
    let d = temp_dir("kl");
    let run = |kv: &str| {
        let out = d.join(format!("{kv}.json"));
        let o = qinfer(&[
            "--kv-cache",
            kv,
            "perplexity",
            "--model",
            model.to_str().unwrap(),
            "--file",
            text.to_str().unwrap(),
            "--ctx",
            "128",
            "--kl-base-kv-cache",
            "f32",
            "--json",
            out.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_str::<serde_json::Value>(&std::fs::read_to_string(out).unwrap()).unwrap()
    };
    let same = run("f32");
    assert_eq!(same["mean_kl"].as_f64().unwrap(), 0.0);
    assert_eq!(same["same_top"].as_f64().unwrap(), 1.0);
    assert_eq!(same["ppl"], same["ppl_base"]);
    let turbo3 = run("turbo3");
    assert!(turbo3["mean_kl"].as_f64().unwrap() > 1e-4, "{turbo3}");
    assert_eq!(turbo3["ppl_base"], same["ppl_base"]);
}
