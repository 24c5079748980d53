//! GGUF metadata values: the thirteen scalar/string/array kinds of the format.

use std::fmt;

/// The on-disk type tag of a metadata value (`gguf_type` in ggml).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufValueType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    Array,
    U64,
    I64,
    F64,
}

impl GgufValueType {
    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => GgufValueType::U8,
            1 => GgufValueType::I8,
            2 => GgufValueType::U16,
            3 => GgufValueType::I16,
            4 => GgufValueType::U32,
            5 => GgufValueType::I32,
            6 => GgufValueType::F32,
            7 => GgufValueType::Bool,
            8 => GgufValueType::String,
            9 => GgufValueType::Array,
            10 => GgufValueType::U64,
            11 => GgufValueType::I64,
            12 => GgufValueType::F64,
            _ => return None,
        })
    }

    pub fn id(self) -> u32 {
        match self {
            GgufValueType::U8 => 0,
            GgufValueType::I8 => 1,
            GgufValueType::U16 => 2,
            GgufValueType::I16 => 3,
            GgufValueType::U32 => 4,
            GgufValueType::I32 => 5,
            GgufValueType::F32 => 6,
            GgufValueType::Bool => 7,
            GgufValueType::String => 8,
            GgufValueType::Array => 9,
            GgufValueType::U64 => 10,
            GgufValueType::I64 => 11,
            GgufValueType::F64 => 12,
        }
    }

    /// The fewest bytes one value of this type occupies on disk (a string is at
    /// least its u64 length; an array at least its u32 type + u64 count). Used to
    /// bound element counts by the bytes left in the file.
    pub fn min_encoded_len(self) -> usize {
        match self {
            GgufValueType::U8 | GgufValueType::I8 | GgufValueType::Bool => 1,
            GgufValueType::U16 | GgufValueType::I16 => 2,
            GgufValueType::U32 | GgufValueType::I32 | GgufValueType::F32 => 4,
            GgufValueType::U64 | GgufValueType::I64 | GgufValueType::F64 | GgufValueType::String => 8,
            GgufValueType::Array => 12,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            GgufValueType::U8 => "u8",
            GgufValueType::I8 => "i8",
            GgufValueType::U16 => "u16",
            GgufValueType::I16 => "i16",
            GgufValueType::U32 => "u32",
            GgufValueType::I32 => "i32",
            GgufValueType::F32 => "f32",
            GgufValueType::Bool => "bool",
            GgufValueType::String => "string",
            GgufValueType::Array => "array",
            GgufValueType::U64 => "u64",
            GgufValueType::I64 => "i64",
            GgufValueType::F64 => "f64",
        }
    }
}

/// A typed array, stored compactly per element type (token lists hold
/// hundreds of thousands of entries). Nested arrays may each have their own type.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufArray {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F32(Vec<f32>),
    F64(Vec<f64>),
    Bool(Vec<bool>),
    String(Vec<String>),
    Array(Vec<GgufArray>),
}

impl GgufArray {
    pub fn elem_type(&self) -> GgufValueType {
        match self {
            GgufArray::U8(_) => GgufValueType::U8,
            GgufArray::I8(_) => GgufValueType::I8,
            GgufArray::U16(_) => GgufValueType::U16,
            GgufArray::I16(_) => GgufValueType::I16,
            GgufArray::U32(_) => GgufValueType::U32,
            GgufArray::I32(_) => GgufValueType::I32,
            GgufArray::U64(_) => GgufValueType::U64,
            GgufArray::I64(_) => GgufValueType::I64,
            GgufArray::F32(_) => GgufValueType::F32,
            GgufArray::F64(_) => GgufValueType::F64,
            GgufArray::Bool(_) => GgufValueType::Bool,
            GgufArray::String(_) => GgufValueType::String,
            GgufArray::Array(_) => GgufValueType::Array,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            GgufArray::U8(v) => v.len(),
            GgufArray::I8(v) => v.len(),
            GgufArray::U16(v) => v.len(),
            GgufArray::I16(v) => v.len(),
            GgufArray::U32(v) => v.len(),
            GgufArray::I32(v) => v.len(),
            GgufArray::U64(v) => v.len(),
            GgufArray::I64(v) => v.len(),
            GgufArray::F32(v) => v.len(),
            GgufArray::F64(v) => v.len(),
            GgufArray::Bool(v) => v.len(),
            GgufArray::String(v) => v.len(),
            GgufArray::Array(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn as_strings(&self) -> Option<&[String]> {
        match self {
            GgufArray::String(v) => Some(v),
            _ => None,
        }
    }

    /// Every element as i64, for arrays of any integer type (None otherwise, or
    /// when a u64 does not fit).
    pub fn to_i64s(&self) -> Option<Vec<i64>> {
        fn conv<T: Copy>(v: &[T], f: impl Fn(T) -> Option<i64>) -> Option<Vec<i64>> {
            v.iter().map(|&x| f(x)).collect()
        }
        match self {
            GgufArray::U8(v) => conv(v, |x| Some(x.into())),
            GgufArray::I8(v) => conv(v, |x| Some(x.into())),
            GgufArray::U16(v) => conv(v, |x| Some(x.into())),
            GgufArray::I16(v) => conv(v, |x| Some(x.into())),
            GgufArray::U32(v) => conv(v, |x| Some(x.into())),
            GgufArray::I32(v) => conv(v, |x| Some(x.into())),
            GgufArray::U64(v) => conv(v, |x| i64::try_from(x).ok()),
            GgufArray::I64(v) => Some(v.clone()),
            GgufArray::F32(_) | GgufArray::F64(_) | GgufArray::Bool(_) | GgufArray::String(_) | GgufArray::Array(_) => {
                None
            }
        }
    }

    /// One element rendered for display.
    fn item_string(&self, i: usize) -> String {
        match self {
            GgufArray::U8(v) => v[i].to_string(),
            GgufArray::I8(v) => v[i].to_string(),
            GgufArray::U16(v) => v[i].to_string(),
            GgufArray::I16(v) => v[i].to_string(),
            GgufArray::U32(v) => v[i].to_string(),
            GgufArray::I32(v) => v[i].to_string(),
            GgufArray::U64(v) => v[i].to_string(),
            GgufArray::I64(v) => v[i].to_string(),
            GgufArray::F32(v) => v[i].to_string(),
            GgufArray::F64(v) => v[i].to_string(),
            GgufArray::Bool(v) => v[i].to_string(),
            GgufArray::String(v) => GgufValue::String(v[i].clone()).to_string(),
            GgufArray::Array(v) => GgufValue::Array(v[i].clone()).to_string(),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(GgufArray),
}

impl GgufValue {
    pub fn value_type(&self) -> GgufValueType {
        match self {
            GgufValue::U8(_) => GgufValueType::U8,
            GgufValue::I8(_) => GgufValueType::I8,
            GgufValue::U16(_) => GgufValueType::U16,
            GgufValue::I16(_) => GgufValueType::I16,
            GgufValue::U32(_) => GgufValueType::U32,
            GgufValue::I32(_) => GgufValueType::I32,
            GgufValue::U64(_) => GgufValueType::U64,
            GgufValue::I64(_) => GgufValueType::I64,
            GgufValue::F32(_) => GgufValueType::F32,
            GgufValue::F64(_) => GgufValueType::F64,
            GgufValue::Bool(_) => GgufValueType::Bool,
            GgufValue::String(_) => GgufValueType::String,
            GgufValue::Array(_) => GgufValueType::Array,
        }
    }

    /// Any integer kind that is non-negative.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(x) => Some(x.into()),
            GgufValue::U16(x) => Some(x.into()),
            GgufValue::U32(x) => Some(x.into()),
            GgufValue::U64(x) => Some(x),
            GgufValue::I8(x) => u64::try_from(x).ok(),
            GgufValue::I16(x) => u64::try_from(x).ok(),
            GgufValue::I32(x) => u64::try_from(x).ok(),
            GgufValue::I64(x) => u64::try_from(x).ok(),
            GgufValue::F32(_) | GgufValue::F64(_) | GgufValue::Bool(_) | GgufValue::String(_) | GgufValue::Array(_) => {
                None
            }
        }
    }

    /// Any integer kind, as i64 when it fits.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            GgufValue::U8(x) => Some(x.into()),
            GgufValue::U16(x) => Some(x.into()),
            GgufValue::U32(x) => Some(x.into()),
            GgufValue::U64(x) => i64::try_from(x).ok(),
            GgufValue::I8(x) => Some(x.into()),
            GgufValue::I16(x) => Some(x.into()),
            GgufValue::I32(x) => Some(x.into()),
            GgufValue::I64(x) => Some(x),
            GgufValue::F32(_) | GgufValue::F64(_) | GgufValue::Bool(_) | GgufValue::String(_) | GgufValue::Array(_) => {
                None
            }
        }
    }

    /// Floats and integers, as f64.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(x) => Some(x.into()),
            GgufValue::F64(x) => Some(x),
            GgufValue::U8(_)
            | GgufValue::I8(_)
            | GgufValue::U16(_)
            | GgufValue::I16(_)
            | GgufValue::U32(_)
            | GgufValue::I32(_)
            | GgufValue::U64(_)
            | GgufValue::I64(_) => self.as_i64().map(|x| x as f64).or(self.as_u64().map(|x| x as f64)),
            GgufValue::Bool(_) | GgufValue::String(_) | GgufValue::Array(_) => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match self {
            GgufValue::Bool(b) => Some(*b),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&GgufArray> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// Short human-readable rendering for `inspect`: long arrays are elided.
impl fmt::Display for GgufValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GgufValue::U8(x) => write!(f, "{x}"),
            GgufValue::I8(x) => write!(f, "{x}"),
            GgufValue::U16(x) => write!(f, "{x}"),
            GgufValue::I16(x) => write!(f, "{x}"),
            GgufValue::U32(x) => write!(f, "{x}"),
            GgufValue::I32(x) => write!(f, "{x}"),
            GgufValue::U64(x) => write!(f, "{x}"),
            GgufValue::I64(x) => write!(f, "{x}"),
            GgufValue::F32(x) => write!(f, "{x}"),
            GgufValue::F64(x) => write!(f, "{x}"),
            GgufValue::Bool(x) => write!(f, "{x}"),
            GgufValue::String(s) => {
                const MAX: usize = 80;
                if s.chars().count() > MAX {
                    let head: String = s.chars().take(MAX).collect();
                    write!(f, "{head:?}… ({} chars)", s.chars().count())
                } else {
                    write!(f, "{s:?}")
                }
            }
            GgufValue::Array(a) => {
                const SHOWN: usize = 5;
                write!(f, "[{}; {}] [", a.elem_type().name(), a.len())?;
                for i in 0..a.len().min(SHOWN) {
                    if i > 0 {
                        write!(f, ", ")?;
                    }
                    write!(f, "{}", a.item_string(i))?;
                }
                if a.len() > SHOWN {
                    write!(f, ", …")?;
                }
                write!(f, "]")
            }
        }
    }
}
