//! How a KV cache stores keys and values (`--kv-cache FORMAT`): each side
//! (keys, values) as f32, f16, FP8 E4M3 with a per-vector scale, or
//! TurboQuant at 8, 4, 3 or 2 bits (keys also as TurboQuant_prod: `4p` is 3
//! bits of codebook and a 1-bit residual sketch).
//!
//! Names: `f32`, `f16`, `fp8`, `turbo8`, `turbo4`, `turbo3`, `turbo2` (both
//! sides alike), and `k<K>v<V>` for any pair, e.g. `k8v4`, `k4v3`, `kf16v4`,
//! `k4pv4`.

use std::fmt;

/// One side's storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvSide {
    F32,
    F16,
    Fp8,
    /// TurboQuant_mse at 8, 4, 3 or 2 bits per coordinate.
    Turbo(u8),
    /// TurboQuant_prod at 5, 4, 3 or 2 bits (keys only).
    TurboProd(u8),
}

impl KvSide {
    fn parse(s: &str) -> Option<KvSide> {
        Some(match s {
            "f32" => KvSide::F32,
            "f16" => KvSide::F16,
            "fp8" => KvSide::Fp8,
            "8" => KvSide::Turbo(8),
            "4" => KvSide::Turbo(4),
            "3" => KvSide::Turbo(3),
            "2" => KvSide::Turbo(2),
            "5p" => KvSide::TurboProd(5),
            "4p" => KvSide::TurboProd(4),
            "3p" => KvSide::TurboProd(3),
            "2p" => KvSide::TurboProd(2),
            _ => return None,
        })
    }

    fn name(self) -> String {
        match self {
            KvSide::F32 => "f32".into(),
            KvSide::F16 => "f16".into(),
            KvSide::Fp8 => "fp8".into(),
            KvSide::Turbo(b) => b.to_string(),
            KvSide::TurboProd(b) => format!("{b}p"),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvFormat {
    pub keys: KvSide,
    pub values: KvSide,
}

/// f32, the CPU backend's default (the CUDA backend's is f16).
impl Default for KvFormat {
    fn default() -> Self {
        KvFormat::F32
    }
}

impl KvFormat {
    pub const F32: KvFormat = KvFormat { keys: KvSide::F32, values: KvSide::F32 };
    pub const F16: KvFormat = KvFormat { keys: KvSide::F16, values: KvSide::F16 };

    /// Whether a side is TurboQuant (its vectors are rotated; the head
    /// dimension must be a power of two).
    pub fn rotates(&self) -> bool {
        [self.keys, self.values].iter().any(|s| matches!(s, KvSide::Turbo(_) | KvSide::TurboProd(_)))
    }
}

impl fmt::Display for KvFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.keys, self.values) {
            (k, v) if k == v => match k {
                KvSide::Turbo(b) => write!(f, "turbo{b}"),
                KvSide::TurboProd(_) => write!(f, "k{}v{}", k.name(), v.name()),
                _ => write!(f, "{}", k.name()),
            },
            (k, v) => write!(f, "k{}v{}", k.name(), v.name()),
        }
    }
}

const EXPECTED: &str = "f32, f16, fp8, turbo8, turbo4, turbo3, turbo2, or k<K>v<V> with K one of f32 f16 fp8 8 4 3 2 \
                        5p 4p 3p 2p and V one of f32 f16 fp8 8 4 3 2 (e.g. k8v4)";

impl std::str::FromStr for KvFormat {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let both = |side| Ok(KvFormat { keys: side, values: side });
        match s {
            "f32" => return both(KvSide::F32),
            "f16" => return both(KvSide::F16),
            "fp8" => return both(KvSide::Fp8),
            _ => {}
        }
        if let Some(bits) = s.strip_prefix("turbo") {
            return match bits {
                "8" | "4" | "3" | "2" => both(KvSide::Turbo(bits.parse().expect("a digit"))),
                _ => Err(format!("unknown KV cache format `{s}`: TurboQuant widths are 8, 4, 3 and 2 bits")),
            };
        }
        let pair = s.strip_prefix('k').and_then(|rest| {
            let v = rest.rfind('v')?;
            Some((KvSide::parse(&rest[..v])?, KvSide::parse(&rest[v + 1..])?))
        });
        match pair {
            Some((_, KvSide::TurboProd(_))) => {
                Err(format!("KV cache format `{s}`: TurboQuant_prod (`p`) is for keys; values use the MSE codebooks"))
            }
            Some((keys, values)) => Ok(KvFormat { keys, values }),
            None => Err(format!("unknown KV cache format `{s}` (expected {EXPECTED})")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_parse_and_print_canonically() {
        for name in ["f32", "f16", "fp8", "turbo8", "turbo4", "turbo3", "turbo2", "k8v4", "k4v3", "kf16v4", "k4pv4"] {
            let f: KvFormat = name.parse().unwrap();
            assert_eq!(f.to_string(), name);
        }
        assert_eq!("k4v4".parse::<KvFormat>().unwrap().to_string(), "turbo4");
        assert_eq!("k8v4".parse::<KvFormat>().unwrap(), KvFormat { keys: KvSide::Turbo(8), values: KvSide::Turbo(4) });
        // Keys narrower than values, when asked for, are allowed.
        assert!("k2v8".parse::<KvFormat>().is_ok());
        assert!("k4v4p".parse::<KvFormat>().unwrap_err().contains("for keys"));
        assert!("turbo5".parse::<KvFormat>().unwrap_err().contains("8, 4, 3 and 2"));
        assert!("q8_0".parse::<KvFormat>().unwrap_err().contains("k8v4"));
        // 4.125 bits per value at head_dim 128 (one f16 scale per vector).
        let shape = crate::kv::KvShape { num_layers: 1, num_kv_heads: 2, head_dim: 128 };
        let codecs = crate::kv::codecs::KvCodecs::new("turbo4".parse().unwrap(), shape).unwrap();
        assert_eq!(codecs.key_row_bytes() * 8, 2 * (4 * 128 + 16));
        assert_eq!(codecs.value_row_bytes(), codecs.key_row_bytes());
    }
}
