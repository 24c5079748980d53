//! The tokenizer embedded in GGUF metadata (`tokenizer.ggml.*`), rebuilt as a
//! `tokenizers` byte-level BPE that tokenizes like llama.cpp: same vocabulary
//! and merge ranks, the pre-tokenizer regexes llama.cpp picks from
//! `tokenizer.ggml.pre` (src/llama-vocab.cpp), control and user-defined tokens
//! matched atomically, and llama.cpp's BOS/EOS flags.

use std::collections::{BTreeMap, HashMap};

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

use super::{BosRule, Parts, SpecialTokens, Tokenizer};
use crate::formats::gguf::{GgufFile, GgufValue};
use crate::{Error, Result};

/// llama.cpp's token types (`llama_token_type`).
const TYPE_CONTROL: i64 = 3;
const TYPE_USER_DEFINED: i64 = 4;

const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN35: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// How llama.cpp pre-tokenizes for one `tokenizer.ggml.pre` family: regexes
/// applied in turn (each splits the pieces of the previous one, keeping the
/// unmatched stretches), whether whole words found in the vocabulary skip the
/// merges, whether BOS is added by default, and whether detokenized text gets
/// its spaces cleaned up (llama.cpp's `clean_spaces`; we apply transformers' rules).
struct PreTokenizer {
    regexes: &'static [&'static str],
    ignore_merges: bool,
    add_bos: bool,
    clean_spaces: bool,
}

fn pre_tokenizer(pre: Option<&str>) -> PreTokenizer {
    let p =
        |regexes, ignore_merges, add_bos, clean_spaces| PreTokenizer { regexes, ignore_merges, add_bos, clean_spaces };
    const DEFAULT: &[&str] = &[
        r"[\p{P}\$\+<=>\^~\|]+",
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
        r"\p{N}+",
        "[0-9][0-9][0-9]",
    ];
    const DIGITS_THEN_GPT2: &[&str] = &[r"\p{N}", GPT2];
    match pre {
        None | Some("default") => p(DEFAULT, false, false, true),
        Some("llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0" | "lfm2") => {
            p(&[LLAMA3], true, true, true)
        }
        Some("dbrx" | "smaug-bpe") => p(&[LLAMA3], false, false, true),
        Some("qwen2" | "deepseek-r1-qwen" | "hunyuan") => p(&[QWEN2], false, false, false),
        Some("megrez" | "stablelm2") => p(&[QWEN2], false, false, true),
        Some("qwen35") => p(&[QWEN35], false, false, false),
        Some("smollm" | "command-r") => p(DIGITS_THEN_GPT2, false, false, false),
        Some("starcoder" | "refact" | "codeshell" | "exaone" | "minerva-7b") => p(DIGITS_THEN_GPT2, false, false, true),
        Some("trillion") => p(&[GPT2], false, false, false),
        Some(
            "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es" | "jina-v2-de" | "a.x-4.0" | "mellum"
            | "mpt" | "olmo" | "jais" | "exaone4",
        ) => p(&[GPT2], false, false, true),
        Some(other) => {
            tracing::warn!("GGUF pre-tokenizer `{other}` is not known to qinfer; using the GPT-2 regex");
            p(&[GPT2], false, false, true)
        }
    }
}

fn get<'a>(meta: &'a BTreeMap<String, GgufValue>, key: &str) -> Option<&'a GgufValue> {
    meta.get(key)
}

fn opt_id(meta: &BTreeMap<String, GgufValue>, key: &str, n_tokens: usize) -> Result<Option<u32>> {
    match get(meta, key) {
        None => Ok(None),
        Some(v) => match v.as_u64() {
            // llama.cpp ignores out-of-range special ids (with a warning).
            Some(id) if (id as usize) < n_tokens => Ok(Some(id as u32)),
            Some(id) => {
                tracing::warn!("{key} = {id} is outside the vocabulary ({n_tokens} tokens); ignored");
                Ok(None)
            }
            None => Err(Error::Tokenizer(format!("`{key}`: expected a token id, found {v}"))),
        },
    }
}

fn opt_bool(meta: &BTreeMap<String, GgufValue>, key: &str) -> Result<Option<bool>> {
    match get(meta, key) {
        None => Ok(None),
        Some(v) => {
            v.as_bool().map(Some).ok_or_else(|| Error::Tokenizer(format!("`{key}`: expected a bool, found {v}")))
        }
    }
}

fn string_list<'a>(meta: &'a BTreeMap<String, GgufValue>, key: &str) -> Result<Option<&'a [String]>> {
    match get(meta, key) {
        None => Ok(None),
        Some(v) => v
            .as_array()
            .and_then(|a| a.as_strings())
            .map(Some)
            .ok_or_else(|| Error::Tokenizer(format!("`{key}`: expected an array of strings"))),
    }
}

/// The tokenizer embedded in `file`, or None when it has no
/// `tokenizer.ggml.model`; errors name the file.
pub fn from_file(file: &GgufFile) -> Result<Option<Tokenizer>> {
    from_metadata(file.metadata()).map_err(|e| match e {
        Error::Tokenizer(reason) => Error::Tokenizer(format!("{}: {reason}", file.path().display())),
        other => other,
    })
}

/// Builds the tokenizer described by GGUF metadata; None when the file has no
/// `tokenizer.ggml.model`.
pub fn from_metadata(meta: &BTreeMap<String, GgufValue>) -> Result<Option<Tokenizer>> {
    let Some(model) = get(meta, "tokenizer.ggml.model") else { return Ok(None) };
    let model = model.as_str().ok_or_else(|| Error::Tokenizer("`tokenizer.ggml.model`: expected a string".into()))?;
    match model {
        "gpt2" => {}
        "none" | "no_vocab" => return Ok(None),
        other => {
            return Err(Error::Tokenizer(format!(
                "unsupported GGUF tokenizer model {other} (supported: gpt2, the byte-level BPE of Llama 3, Qwen and SmolLM)"
            )));
        }
    }
    let tokens = string_list(meta, "tokenizer.ggml.tokens")?
        .ok_or_else(|| Error::Tokenizer("`tokenizer.ggml.tokens` is missing".into()))?;
    let merges_raw = string_list(meta, "tokenizer.ggml.merges")?
        .ok_or_else(|| Error::Tokenizer("`tokenizer.ggml.merges` is missing".into()))?;
    let n = tokens.len();
    let types: Vec<i64> = match get(meta, "tokenizer.ggml.token_type") {
        None => vec![1; n],
        Some(v) => {
            let t = v
                .as_array()
                .and_then(|a| a.to_i64s())
                .ok_or_else(|| Error::Tokenizer("`tokenizer.ggml.token_type`: expected an integer array".into()))?;
            if t.len() < n {
                return Err(Error::Tokenizer(format!(
                    "`tokenizer.ggml.token_type` has {} entries for {n} tokens",
                    t.len()
                )));
            }
            t
        }
    };

    // Vocabulary: llama.cpp names empty tokens `[EMPTY_i]` and rejects duplicates.
    let names: Vec<String> =
        tokens.iter().enumerate().map(|(i, t)| if t.is_empty() { format!("[EMPTY_{i}]") } else { t.clone() }).collect();
    let mut vocab: HashMap<String, u32> = HashMap::with_capacity(n);
    for (i, t) in names.iter().enumerate() {
        if let Some(prev) = vocab.insert(t.clone(), i as u32) {
            return Err(Error::Tokenizer(format!("duplicate token {t:?} in the vocabulary (ids {prev} and {i})")));
        }
    }
    // Merges are "left right", split at the first space after the first byte.
    // Ones that name tokens outside the vocabulary can never apply; drop them
    // (the BPE builder would refuse them).
    let mut merges = Vec::with_capacity(merges_raw.len());
    let mut dropped = 0usize;
    for m in merges_raw {
        let split = m.char_indices().skip(1).find(|&(_, c)| c == ' ').map(|(i, _)| i);
        let Some(i) = split else {
            dropped += 1;
            continue;
        };
        let (a, b) = (&m[..i], &m[i + 1..]);
        if vocab.contains_key(a) && vocab.contains_key(b) && vocab.contains_key(&format!("{a}{b}")) {
            merges.push((a.to_string(), b.to_string()));
        } else {
            dropped += 1;
        }
    }
    if dropped > 0 {
        tracing::warn!("GGUF tokenizer: ignored {dropped} merges that do not form vocabulary tokens");
    }

    let pre_name = match get(meta, "tokenizer.ggml.pre") {
        None => None,
        Some(v) => Some(v.as_str().ok_or_else(|| Error::Tokenizer("`tokenizer.ggml.pre`: expected a string".into()))?),
    };
    let pre = pre_tokenizer(pre_name);

    let bpe = BPE::builder()
        .vocab_and_merges(vocab.into_iter().collect::<Vocab>(), merges)
        .ignore_merges(pre.ignore_merges)
        .build()
        .map_err(|e| Error::Tokenizer(format!("building BPE: {e}")))?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    let mut steps: Vec<PreTokenizerWrapper> = Vec::new();
    for r in pre.regexes {
        let split = Split::new(SplitPattern::Regex((*r).to_string()), SplitDelimiterBehavior::Isolated, false)
            .map_err(|e| Error::Tokenizer(format!("pre-tokenizer regex {r:?}: {e}")))?;
        steps.push(split.into());
    }
    steps.push(ByteLevel::new(false, false, false).into());
    inner.with_pre_tokenizer(Some(Sequence::new(steps)));
    inner.with_decoder(Some(ByteLevelDecoder::default()));

    // Control tokens are special (skipped when decoding with skip_special_tokens);
    // user-defined ones are ordinary added tokens. Both match atomically in text.
    let added: Vec<AddedToken> = names
        .iter()
        .zip(&types)
        .filter(|(_, t)| matches!(**t, TYPE_CONTROL | TYPE_USER_DEFINED))
        .map(|(name, &t)| AddedToken::from(name.clone(), t == TYPE_CONTROL).normalized(false))
        .collect();
    inner.add_tokens(&added);

    let bos = opt_id(meta, "tokenizer.ggml.bos_token_id", n)?;
    let eos = opt_id(meta, "tokenizer.ggml.eos_token_id", n)?;
    let eot = opt_id(meta, "tokenizer.ggml.eot_token_id", n)?;
    let unk = opt_id(meta, "tokenizer.ggml.unknown_token_id", n)?;
    let pad = opt_id(meta, "tokenizer.ggml.padding_token_id", n)?;
    let add_bos = opt_bool(meta, "tokenizer.ggml.add_bos_token")?.unwrap_or(pre.add_bos);
    let add_eos = opt_bool(meta, "tokenizer.ggml.add_eos_token")?.unwrap_or(false);
    let bos_rule = match (add_bos, bos) {
        (true, Some(id)) => BosRule::Ensure(id),
        (true, None) => {
            return Err(Error::Tokenizer("tokenizer.ggml.add_bos_token is true but no bos_token_id is set".into()));
        }
        (false, _) => BosRule::AsTokenizer,
    };
    let append_eos = match (add_eos, eos) {
        (true, Some(id)) => Some(id),
        (true, None) => {
            return Err(Error::Tokenizer("tokenizer.ggml.add_eos_token is true but no eos_token_id is set".into()));
        }
        (false, _) => None,
    };
    let name = |id: Option<u32>| id.map(|i| names[i as usize].clone());
    let specials =
        SpecialTokens { bos: name(bos), eos: name(eos), unk: name(unk), pad: name(pad), ..SpecialTokens::default() };
    let mut eos_ids: Vec<u32> = eos.into_iter().collect();
    if let Some(eot) = eot.filter(|e| !eos_ids.contains(e)) {
        eos_ids.push(eot);
    }
    let chat_template = match get(meta, "tokenizer.chat_template") {
        None => None,
        Some(v) => Some(
            v.as_str()
                .ok_or_else(|| Error::Tokenizer("`tokenizer.chat_template`: expected a string".into()))?
                .to_string(),
        ),
    };
    Tokenizer::from_parts(Parts {
        inner,
        specials,
        eos_ids,
        bos_rule,
        append_eos,
        clean_up_spaces: pre.clean_spaces,
        chat_template,
    })
    .map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::gguf::GgufArray;

    /// A byte-level vocabulary: the 256 byte symbols, "he", "hel", a control
    /// token and a user-defined one.
    fn meta(extra: &[(&str, GgufValue)]) -> BTreeMap<String, GgufValue> {
        let mut alphabet: Vec<char> = ByteLevel::alphabet().into_iter().collect();
        alphabet.sort();
        let mut tokens: Vec<String> = alphabet.iter().map(|c| c.to_string()).collect();
        tokens.extend(["he", "hel", "<|end|>", "<think>"].map(String::from));
        let n = tokens.len();
        let mut types = vec![1i32; n];
        types[n - 2] = 3;
        types[n - 1] = 4;
        let mut m = BTreeMap::new();
        m.insert("tokenizer.ggml.model".into(), GgufValue::String("gpt2".into()));
        m.insert("tokenizer.ggml.pre".into(), GgufValue::String("smollm".into()));
        m.insert("tokenizer.ggml.tokens".into(), GgufValue::Array(GgufArray::String(tokens)));
        m.insert("tokenizer.ggml.token_type".into(), GgufValue::Array(GgufArray::I32(types)));
        m.insert(
            "tokenizer.ggml.merges".into(),
            GgufValue::Array(GgufArray::String(vec!["h e".into(), "he l".into(), "x y".into()])),
        );
        m.insert("tokenizer.ggml.eos_token_id".into(), GgufValue::U32(n as u32 - 2));
        m.insert("tokenizer.ggml.bos_token_id".into(), GgufValue::U32(n as u32 - 2));
        for (k, v) in extra {
            m.insert(k.to_string(), v.clone());
        }
        m
    }

    fn tok(extra: &[(&str, GgufValue)]) -> Tokenizer {
        from_metadata(&meta(extra)).unwrap().unwrap()
    }

    #[test]
    fn encodes_with_merges_and_atomic_added_tokens() {
        let t = tok(&[]);
        let n = t.vocab_size() as u32;
        assert_eq!(n, 260);
        let ids = t.encode("hello<|end|><think>", false).unwrap();
        let h = |s: &str| t.token_to_id(s).unwrap();
        assert_eq!(ids, vec![h("hel"), h("l"), h("o"), n - 2, n - 1]);
        assert_eq!(t.decode(&ids, false).unwrap(), "hello<|end|><think>");
        // Control tokens are skippable, user-defined ones are not.
        assert_eq!(t.decode(&ids, true).unwrap(), "hello<think>");
        // Unknown ids decode to nothing, as in transformers.
        assert_eq!(t.decode(&[h("o"), 100_000], false).unwrap(), "o");
        assert_eq!(t.eos_token_ids(), vec![n - 2]);
    }

    #[test]
    fn streams_multibyte_characters_whole() {
        let t = tok(&[]);
        let ids = t.encode("é🦀", false).unwrap();
        assert_eq!(ids.len(), 6, "no merges: one token per byte");
        let mut s = t.stream_decoder();
        let pieces: Vec<Option<String>> = ids.iter().map(|&id| s.push(id).unwrap()).collect();
        assert_eq!(pieces, vec![None, Some("é".into()), None, None, None, Some("🦀".into())]);
        // An incomplete character is flushed (as U+FFFD, like decode) by finish.
        let mut s = t.stream_decoder();
        assert_eq!(s.push(ids[2]).unwrap(), None);
        assert_eq!(s.finish().unwrap().as_deref(), Some("\u{FFFD}"));
    }

    #[test]
    fn streamed_text_with_space_cleanup_equals_decode() {
        // llama.cpp cleans spaces for the gpt-2 pre-tokenizer; transformers' rules apply.
        let t = tok(&[("tokenizer.ggml.pre", GgufValue::String("gpt-2".into()))]);
        let text = "I do n't know . Really ? He ' s here , they 're  . ok ' ";
        let ids = t.encode(text, false).unwrap();
        let want = t.decode(&ids, false).unwrap();
        assert_eq!(want, "I don't know. Really? He's here, they're . ok'");
        let mut s = t.stream_decoder();
        let mut got = String::new();
        for &id in &ids {
            got.push_str(&s.push(id).unwrap().unwrap_or_default());
        }
        got.push_str(&s.finish().unwrap().unwrap_or_default());
        assert_eq!(got, want);
    }

    #[test]
    fn add_bos_and_eos_flags() {
        let t = tok(&[
            ("tokenizer.ggml.add_bos_token", GgufValue::Bool(true)),
            ("tokenizer.ggml.add_eos_token", GgufValue::Bool(true)),
        ]);
        let end = t.token_to_id("<|end|>").unwrap();
        let ids = t.encode("o", true).unwrap();
        assert_eq!(ids, vec![end, t.token_to_id("o").unwrap(), end]);
        assert_eq!(t.encode("o", false).unwrap().len(), 1);
    }

    #[test]
    fn bad_metadata_is_an_error() {
        let mut m = meta(&[]);
        m.insert("tokenizer.ggml.model".into(), GgufValue::String("llama".into()));
        let e = from_metadata(&m).unwrap_err().to_string();
        assert!(e.contains("unsupported GGUF tokenizer model llama"), "{e}");

        let mut m = meta(&[]);
        if let Some(GgufValue::Array(GgufArray::String(t))) = m.get_mut("tokenizer.ggml.tokens") {
            t[257] = "he".into();
        }
        let e = from_metadata(&m).unwrap_err().to_string();
        assert!(e.contains("duplicate token"), "{e}");

        let mut m = meta(&[]);
        m.remove("tokenizer.ggml.merges");
        assert!(from_metadata(&m).unwrap_err().to_string().contains("merges"));

        let mut m = meta(&[]);
        m.insert("tokenizer.ggml.token_type".into(), GgufValue::Array(GgufArray::I32(vec![1; 3])));
        assert!(from_metadata(&m).unwrap_err().to_string().contains("token_type"));

        let mut m = meta(&[]);
        m.remove("tokenizer.ggml.model");
        assert!(from_metadata(&m).unwrap().is_none());
    }

    #[test]
    fn tokenizer_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<Tokenizer>();
    }
}
