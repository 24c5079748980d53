//! The default model (SmolLM2-135M-Instruct, Q4_1 GGUF, fetched by
//! scripts/fetch_default_model.sh): header, config, tensors and tokenizer.
//! Skips with a message when the file is absent (fails under `QINFER_CI=1`).

mod common;

use qinfer::config::{Architecture, RopeStyle};
use qinfer::formats::TensorSource;
use qinfer::formats::gguf::GgufFile;
use qinfer::tensor::DType;
use qinfer::tokenizer::{ChatMessage, ChatOptions};

#[test]
fn header_and_config() {
    let Some(path) = common::default_model() else { return };
    let f = GgufFile::open(&path).unwrap();
    assert!(matches!(f.version(), 2 | 3));
    assert_eq!(f.architecture(), Some("llama"));
    for (k, v) in f.metadata() {
        if !k.starts_with("tokenizer.ggml.") || !matches!(v, qinfer::formats::gguf::GgufValue::Array(_)) {
            eprintln!("{k} = {v}");
        }
    }
    let c = f.model_config().unwrap();
    eprintln!("{c:?}");
    assert_eq!(c.arch, Architecture::Llama);
    assert_eq!(c.num_layers, 30);
    assert_eq!(c.hidden_size, 576);
    assert_eq!(c.intermediate_size, 1536);
    assert_eq!(c.num_heads, 9);
    assert_eq!(c.num_kv_heads, 3);
    assert_eq!(c.head_dim, 64);
    assert_eq!(c.vocab_size, 49152);
    assert!(c.tie_word_embeddings);
    assert_eq!(c.rope.style, RopeStyle::Interleaved);
    assert_eq!(c.rope.theta, 100_000.0);
    assert!(c.rope.scaling.is_none());
    assert!(!c.attention_bias && !c.o_bias && !c.qk_norm);
    assert_eq!(c.layer_windows, vec![None; 30]);
    assert!(!c.eos_token_ids.is_empty());
}

#[test]
fn tensors_resolve_by_hf_name() {
    let Some(path) = common::default_model() else { return };
    let f = GgufFile::open(&path).unwrap();
    // 30 layers × 9 tensors + embedding + final norm.
    assert_eq!(f.tensor_infos().len(), 30 * 9 + 2);
    let mut last_end = f.data_offset();
    for t in f.tensor_infos() {
        assert_eq!((t.offset - f.data_offset()) % f.alignment(), 0, "{}", t.name);
        assert!(t.offset >= last_end, "{} overlaps the previous tensor", t.name);
        last_end = t.offset + t.n_bytes;
    }
    let emb = f.tensor("model.embed_tokens.weight").unwrap();
    assert_eq!(emb.shape, vec![49152, 576]);
    let q = f.tensor("model.layers.0.self_attn.q_proj.weight").unwrap();
    assert_eq!(q.shape, vec![576, 576]);
    assert_eq!(q.name, "model.layers.0.self_attn.q_proj.weight");
    let k = f.tensor("model.layers.29.self_attn.k_proj.weight").unwrap();
    assert_eq!(k.shape, vec![192, 576]);
    let down = f.tensor("model.layers.3.mlp.down_proj.weight").unwrap();
    assert_eq!(down.shape, vec![576, 1536]);
    let norm = f.tensor("model.norm.weight").unwrap();
    assert_eq!((norm.dtype, norm.shape.as_slice()), (DType::F32, &[576][..]));
    assert!(f.contains("model.layers.0.input_layernorm.weight"));
    assert!(f.contains("blk.0.attn_norm.weight"), "GGUF names resolve too");
    assert!(!f.contains("lm_head.weight"), "tied");
    let e = f.tensor("lm_head.weight").unwrap_err().to_string();
    assert!(e.contains("lm_head.weight") && e.contains("output.weight"), "{e}");
    let names = f.names();
    assert!(names.iter().any(|n| n == "token_embd.weight"));
    let raw = f.raw_tensor("blk.0.ffn_up.weight").unwrap();
    assert_eq!(raw.shape, vec![1536, 576]);
    assert!(matches!(raw.dtype, DType::Q4_1 | DType::Q8_0 | DType::Q4_0 | DType::F16 | DType::F32 | DType::BF16));
}

#[test]
fn tokenizer_round_trips() {
    let Some(path) = common::default_model() else { return };
    let f = GgufFile::open(&path).unwrap();
    let tok = qinfer::tokenizer::gguf::from_file(&f).unwrap().expect("SmolLM2 GGUF embeds a tokenizer");
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!(tok.token_to_id("<|im_start|>"), Some(1));
    assert_eq!(tok.token_to_id("<|im_end|>"), Some(2));
    let texts = [
        "Hello, world!",
        "The year 2024 has 366 days; π ≈ 3.14159.",
        "  leading spaces and\ttabs\n\nnewlines  ",
        "日本語のテキスト, émojis 🎉🦀 and Ünïcödé",
        "<|im_start|>user\nWhat's up?<|im_end|>\n",
        "",
    ];
    for text in texts {
        let ids = tok.encode(text, false).unwrap();
        assert_eq!(tok.decode(&ids, false).unwrap(), text, "{ids:?}");
        // Streaming reproduces decode exactly, emojis split across tokens included.
        let mut s = tok.stream_decoder_with(false);
        let mut streamed = String::new();
        for &id in &ids {
            if let Some(piece) = s.push(id).unwrap() {
                assert!(!piece.contains('\u{FFFD}'), "{piece:?}");
                streamed.push_str(&piece);
            }
        }
        if let Some(rest) = s.finish().unwrap() {
            streamed.push_str(&rest);
        }
        assert_eq!(streamed, text);
    }
    // Special tokens are atomic and skipped on request.
    let ids = tok.encode("<|im_start|>user", false).unwrap();
    assert_eq!(ids[0], 1);
    assert_eq!(tok.decode(&ids, true).unwrap(), "user");
    // Digits are split one by one (the `smollm` pre-tokenizer).
    let ids = tok.encode("12345", false).unwrap();
    assert_eq!(ids.len(), 5);
}

#[test]
fn chat_template_renders() {
    let Some(path) = common::default_model() else { return };
    let f = GgufFile::open(&path).unwrap();
    let tok = qinfer::tokenizer::gguf::from_file(&f).unwrap().unwrap();
    assert!(tok.has_chat_template());
    let msgs = [ChatMessage::new("user", "Hi")];
    let out =
        tok.apply_chat_template(&msgs, &ChatOptions { add_generation_prompt: true, ..Default::default() }).unwrap();
    eprintln!("{out:?}");
    assert!(out.contains("<|im_start|>user\nHi<|im_end|>\n"), "{out:?}");
    assert!(out.ends_with("<|im_start|>assistant\n"), "{out:?}");
}
