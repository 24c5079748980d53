//! Each token's bytes, as a grammar engine matches tokens against text: the
//! byte-level alphabet of GPT-2-style BPE mapped back to bytes, SentencePiece
//! byte-fallback tokens (`<0x0A>`) and `▁` spaces undone, added tokens as
//! their text, and special tokens flagged (they match no text).

use tokenizers::DecoderWrapper;

use crate::{Error, Result};

/// A token's bytes, and whether it is special (never part of text).
pub type TokenText = (Vec<u8>, bool);

/// GPT-2's table from the printable characters its byte-level BPE writes
/// back to the bytes they stand for: bytes that are printable map to
/// themselves, the rest to U+0100 onward in byte order.
fn byte_level_table() -> std::collections::HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 0x100u32;
    (0..=255u8)
        .map(|b| {
            if printable(b) {
                (b as char, b)
            } else {
                let c = char::from_u32(next).expect("below U+0200");
                next += 1;
                (c, b)
            }
        })
        .collect()
}

#[derive(Default)]
struct Decoding {
    byte_level: bool,
    byte_fallback: bool,
    /// A character the decoder turns into a space (SentencePiece's `▁`).
    space: Option<char>,
}

fn inspect(d: &DecoderWrapper, out: &mut Decoding) -> Result<()> {
    match d {
        DecoderWrapper::ByteLevel(_) => out.byte_level = true,
        DecoderWrapper::ByteFallback(_) => out.byte_fallback = true,
        DecoderWrapper::Metaspace(m) => out.space = Some(m.get_replacement()),
        DecoderWrapper::Replace(_) => out.space = Some('▁'),
        DecoderWrapper::Sequence(s) => {
            for d in s.get_decoders() {
                inspect(d, out)?;
            }
        }
        DecoderWrapper::Fuse(_) | DecoderWrapper::Strip(_) => {}
        other => {
            return Err(Error::Tokenizer(format!(
                "token bytes: the decoder {other:?} is not supported (byte-level or byte-fallback BPE only)"
            )));
        }
    }
    Ok(())
}

/// Every id below `vocab`'s bytes (ids the tokenizer does not know: empty).
pub(crate) fn token_bytes(inner: &tokenizers::Tokenizer, vocab: usize) -> Result<Vec<TokenText>> {
    let mut how = Decoding::default();
    match inner.get_decoder() {
        Some(d) => inspect(d, &mut how)?,
        None => return Err(Error::Tokenizer("token bytes: the tokenizer has no decoder".into())),
    }
    if !how.byte_level && !how.byte_fallback {
        return Err(Error::Tokenizer("token bytes: neither a byte-level nor a byte-fallback decoder".into()));
    }
    let table = byte_level_table();
    let added = inner.get_added_tokens_decoder();
    let mut out = Vec::with_capacity(vocab);
    for id in 0..vocab as u32 {
        if let Some(a) = added.get(&id) {
            out.push((a.content.as_bytes().to_vec(), a.special));
            continue;
        }
        let Some(piece) = inner.id_to_token(id) else {
            out.push((Vec::new(), false));
            continue;
        };
        let bytes = if how.byte_level {
            piece.chars().map(|c| table.get(&c).copied()).collect::<Option<Vec<u8>>>().ok_or_else(|| {
                Error::Tokenizer(format!("token bytes: token {id} ({piece:?}) is outside the byte-level alphabet"))
            })?
        } else if let Some(b) = piece
            .strip_prefix("<0x")
            .and_then(|h| h.strip_suffix('>'))
            .filter(|h| h.len() == 2)
            .and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            vec![b]
        } else {
            match how.space {
                Some(sp) => piece.replace(sp, " ").into_bytes(),
                None => piece.into_bytes(),
            }
        };
        out.push((bytes, false));
    }
    Ok(out)
}
