//! transformers' `clean_up_tokenization`: drops the space before punctuation
//! and English contractions, applied after decoding when the tokenizer config
//! sets `clean_up_tokenization_spaces`.

/// Replacements in transformers' order; each is a global, left-to-right,
/// non-overlapping replace, so the order matters.
const RULES: &[(&str, &str)] = &[
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
];

/// Longest rule pattern, in chars.
const MAX_PATTERN_CHARS: usize = 4;

pub(crate) fn clean_up_tokenization(text: &str) -> String {
    let mut s = text.to_string();
    for (from, to) in RULES {
        if s.contains(from) {
            s = s.replace(from, to);
        }
    }
    s
}

/// A space a rule could still consume: followed by a char some rule starts
/// with after its space (or a space, which `" ' "` chains through), or at the end.
fn relevant_space(text: &str, i: usize) -> bool {
    text.as_bytes()[i] == b' '
        && matches!(text.as_bytes().get(i + 1), None | Some(b'.' | b'?' | b'!' | b',' | b'\'' | b'n' | b' '))
}

/// Where streamed text can be cut so that cleaning the two parts separately
/// equals cleaning the whole, whatever text follows: before any space within
/// reach (`MAX_PATTERN_CHARS`) of the end or of an earlier cut that a rule
/// could still consume.
pub(crate) fn safe_split(text: &str) -> usize {
    let mut cut = text.len();
    loop {
        let window_start = text[..cut].char_indices().rev().nth(MAX_PATTERN_CHARS - 1).map_or(0, |(i, _)| i);
        match (window_start..cut).find(|&i| relevant_space(text, i)) {
            Some(i) if i < cut => cut = i,
            _ => return cut,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_transformers_rules() {
        assert_eq!(clean_up_tokenization("Hello , world . I do n't know ' s"), "Hello, world. I don't know's");
        assert_eq!(clean_up_tokenization("a  ."), "a .");
    }

    /// Streams random text in random chunks through `safe_split` and checks
    /// the cleaned pieces concatenate to the cleaned whole.
    #[test]
    fn streamed_cleanup_equals_whole() {
        let alphabet = ['a', 'n', '\'', 't', 's', 'm', 'v', 'e', 'r', '.', ',', ' ', ' ', 'é'];
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = |m: usize| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % m as u64) as usize
        };
        for _ in 0..20_000 {
            let len = next(14);
            let full: String = (0..len).map(|_| alphabet[next(alphabet.len())]).collect();
            let chars: Vec<char> = full.chars().collect();
            let (mut out, mut pending, mut i) = (String::new(), String::new(), 0);
            while i < chars.len() {
                let step = 1 + next(3);
                pending.extend(&chars[i..(i + step).min(chars.len())]);
                i += step;
                let cut = safe_split(&pending);
                out.push_str(&clean_up_tokenization(&pending[..cut]));
                pending.drain(..cut);
            }
            out.push_str(&clean_up_tokenization(&pending));
            assert_eq!(out, clean_up_tokenization(&full), "{full:?}");
        }
    }

    #[test]
    fn split_halves_clean_like_the_whole() {
        let samples = ["a ' s", "x n't", "ab cd . e", "no spaces", "end ", "é ' ", "  .  , ! ?"];
        for s in samples {
            let cut = safe_split(s);
            let halves = clean_up_tokenization(&s[..cut]);
            // The held tail is cleaned later with whatever follows it.
            for next in ["", "s", "t", ".", " x"] {
                let full = format!("{s}{next}");
                let rest = format!("{}{next}", &s[cut..]);
                assert_eq!(
                    format!("{halves}{}", clean_up_tokenization(&rest)),
                    clean_up_tokenization(&full),
                    "{full:?}"
                );
            }
        }
    }
}
