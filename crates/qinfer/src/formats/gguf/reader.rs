//! Parses a GGUF v2/v3 header, metadata and tensor infos from the mapped file.
//! Every length, count and offset is checked against the bytes actually
//! present, so a truncated or hostile file yields `Error::Malformed` before any
//! allocation larger than the file itself.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;

use super::ggml_type::GgmlType;
use super::value::{GgufArray, GgufValue, GgufValueType};
use crate::{Error, Result};

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's GGML_MAX_DIMS.
const MAX_DIMS: u32 = 4;
/// Arrays of arrays are legal; deeper nesting than this is treated as hostile.
const MAX_ARRAY_DEPTH: usize = 8;

/// One tensor as listed in the file.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufTensorInfo {
    /// The GGUF name (`blk.0.attn_q.weight`).
    pub name: String,
    /// The raw ggml type id and its name (`Q4_K`), kept even for types qinfer cannot compute with.
    pub ggml_type: u32,
    pub type_name: &'static str,
    /// Outermost first (GGUF stores innermost first: `ne[0]` is the row length).
    pub shape: Vec<usize>,
    /// Absolute byte offset of the data in the file.
    pub offset: usize,
    pub n_bytes: usize,
}

pub(super) struct Parsed {
    pub version: u32,
    pub metadata: BTreeMap<String, GgufValue>,
    pub tensors: Vec<GgufTensorInfo>,
    pub alignment: usize,
    pub data_offset: usize,
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn err(&self, reason: impl std::fmt::Display) -> Error {
        Error::malformed(self.path, format!("{reason} (at byte {} of {})", self.pos, self.buf.len()))
    }

    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(self.err(format!("truncated: {what} needs {n} bytes, {} left", self.remaining())));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count of items each at least `min_item` bytes long, bounded by what is left.
    fn count(&mut self, min_item: usize, what: &str) -> Result<usize> {
        let start = self.pos;
        let n = self.u64(what)?;
        let max = (self.remaining() / min_item.max(1)) as u64;
        if n > max {
            self.pos = start;
            return Err(self.err(format!("{what} {n} cannot fit in the {} bytes left", self.remaining())));
        }
        Ok(n as usize)
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.count(1, &format!("{what} length"))?;
        let bytes = self.take(len, what)?;
        // Metadata strings should be UTF-8; a stray invalid byte is not worth
        // refusing the whole file over.
        Ok(String::from_utf8_lossy(bytes).into_owned())
    }

    fn value_type(&mut self, what: &str) -> Result<GgufValueType> {
        let start = self.pos;
        let id = self.u32(what)?;
        GgufValueType::from_id(id).ok_or_else(|| {
            self.pos = start;
            self.err(format!("{what}: unknown metadata value type {id}"))
        })
    }

    fn value(&mut self, ty: GgufValueType, key: &str, depth: usize) -> Result<GgufValue> {
        Ok(match ty {
            GgufValueType::U8 => GgufValue::U8(self.array::<1>(key)?[0]),
            GgufValueType::I8 => GgufValue::I8(i8::from_le_bytes(self.array(key)?)),
            GgufValueType::U16 => GgufValue::U16(u16::from_le_bytes(self.array(key)?)),
            GgufValueType::I16 => GgufValue::I16(i16::from_le_bytes(self.array(key)?)),
            GgufValueType::U32 => GgufValue::U32(self.u32(key)?),
            GgufValueType::I32 => GgufValue::I32(i32::from_le_bytes(self.array(key)?)),
            GgufValueType::U64 => GgufValue::U64(self.u64(key)?),
            GgufValueType::I64 => GgufValue::I64(i64::from_le_bytes(self.array(key)?)),
            GgufValueType::F32 => GgufValue::F32(f32::from_le_bytes(self.array(key)?)),
            GgufValueType::F64 => GgufValue::F64(f64::from_le_bytes(self.array(key)?)),
            GgufValueType::Bool => {
                let b = self.array::<1>(key)?[0];
                match b {
                    0 => GgufValue::Bool(false),
                    1 => GgufValue::Bool(true),
                    other => return Err(self.err(format!("metadata `{key}`: bool byte is {other}, expected 0 or 1"))),
                }
            }
            GgufValueType::String => GgufValue::String(self.string(&format!("metadata `{key}` string"))?),
            GgufValueType::Array => GgufValue::Array(self.array_value(key, depth)?),
        })
    }

    fn array_value(&mut self, key: &str, depth: usize) -> Result<GgufArray> {
        if depth >= MAX_ARRAY_DEPTH {
            return Err(self.err(format!("metadata `{key}`: arrays nested deeper than {MAX_ARRAY_DEPTH}")));
        }
        let elem_type = self.value_type(&format!("metadata `{key}` array element type"))?;
        let n = self.count(elem_type.min_encoded_len(), &format!("metadata `{key}` array length"))?;
        // `n` is bounded by the bytes left, so these allocations are too.
        macro_rules! fixed {
            ($variant:ident, $t:ty) => {{
                let bytes = self.take(n * std::mem::size_of::<$t>(), key)?;
                GgufArray::$variant(
                    bytes
                        .chunks_exact(std::mem::size_of::<$t>())
                        .map(|c| <$t>::from_le_bytes(std::array::from_fn(|i| c[i])))
                        .collect(),
                )
            }};
        }
        Ok(match elem_type {
            GgufValueType::U8 => GgufArray::U8(self.take(n, key)?.to_vec()),
            GgufValueType::I8 => fixed!(I8, i8),
            GgufValueType::U16 => fixed!(U16, u16),
            GgufValueType::I16 => fixed!(I16, i16),
            GgufValueType::U32 => fixed!(U32, u32),
            GgufValueType::I32 => fixed!(I32, i32),
            GgufValueType::U64 => fixed!(U64, u64),
            GgufValueType::I64 => fixed!(I64, i64),
            GgufValueType::F32 => fixed!(F32, f32),
            GgufValueType::F64 => fixed!(F64, f64),
            GgufValueType::Bool => {
                let bytes = self.take(n, key)?;
                if let Some(b) = bytes.iter().find(|&&b| b > 1) {
                    return Err(self.err(format!("metadata `{key}`: bool byte is {b}, expected 0 or 1")));
                }
                GgufArray::Bool(bytes.iter().map(|&b| b == 1).collect())
            }
            GgufValueType::String => {
                let what = format!("metadata `{key}` string");
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.string(&what)?);
                }
                GgufArray::String(v)
            }
            GgufValueType::Array => {
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.array_value(key, depth + 1)?);
                }
                GgufArray::Array(v)
            }
        })
    }
}

fn read_version(c: &mut Cursor) -> Result<u32> {
    let version = c.u32("version")?;
    match version {
        2 | 3 => Ok(version),
        1 => Err(c.err("GGUF version 1 is not supported (expected 2 or 3); re-convert the model")),
        v if matches!(v.swap_bytes(), 2 | 3) => Err(c.err("big-endian GGUF files are not supported")),
        v => Err(c.err(format!("unsupported GGUF version {v} (expected 2 or 3)"))),
    }
}

fn read_alignment(c: &Cursor, metadata: &BTreeMap<String, GgufValue>) -> Result<u64> {
    match metadata.get("general.alignment") {
        None => Ok(DEFAULT_ALIGNMENT),
        Some(GgufValue::U32(a)) if *a != 0 && a.is_power_of_two() => Ok((*a).into()),
        Some(other) => Err(c.err(format!("`general.alignment` must be a non-zero power of two u32, found {}", other))),
    }
}

/// One tensor info record; `data_offset` is not yet known, so `offset` is relative here.
fn read_tensor_info(c: &mut Cursor) -> Result<GgufTensorInfo> {
    let name = c.string("tensor name")?;
    let n_dims = c.u32("tensor dimension count")?;
    if n_dims > MAX_DIMS {
        return Err(c.err(format!("tensor `{name}` has {n_dims} dimensions (at most {MAX_DIMS})")));
    }
    let mut ne = Vec::with_capacity(n_dims as usize);
    for _ in 0..n_dims {
        ne.push(c.u64("tensor dimension")?);
    }
    let type_id = c.u32("tensor type")?;
    let rel_offset = c.u64("tensor offset")?;
    let ty = GgmlType::from_id(type_id)
        .ok_or_else(|| c.err(format!("tensor `{name}` has unknown ggml type id {type_id}")))?;
    // ggml keeps element counts in int64.
    let numel = ne
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .filter(|&n| n <= i64::MAX as u64)
        .ok_or_else(|| c.err(format!("tensor `{name}` dimensions {ne:?} overflow")))?;
    let row_len = ne.first().copied().unwrap_or(1);
    let n_bytes = ty.bytes_for(row_len, numel).ok_or_else(|| {
        c.err(format!(
            "tensor `{name}`: row length {row_len} is not a multiple of the {} block ({})",
            ty.name, ty.block_len
        ))
    })?;
    let shape = ne
        .iter()
        .rev()
        .map(|&d| usize::try_from(d))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| c.err(format!("tensor `{name}` dimensions {ne:?} do not fit this machine")))?;
    let offset =
        usize::try_from(rel_offset).map_err(|_| c.err(format!("tensor `{name}` offset {rel_offset} too large")))?;
    let n_bytes = usize::try_from(n_bytes).map_err(|_| c.err(format!("tensor `{name}` too large")))?;
    Ok(GgufTensorInfo { name, ggml_type: type_id, type_name: ty.name, shape, offset, n_bytes })
}

pub(super) fn parse(buf: &[u8], path: &Path) -> Result<Parsed> {
    let mut c = Cursor { buf, pos: 0, path };
    let magic = c.take(4, "magic")?;
    if magic != MAGIC {
        return Err(Error::malformed(path, format!("not a GGUF file (magic {magic:02x?}, expected \"GGUF\")")));
    }
    let version = read_version(&mut c)?;
    // Smallest tensor info: name length, n_dims, type, offset.
    let n_tensors = c.count(8 + 4 + 4 + 8, "tensor count")?;
    // Smallest key/value: key length, value type, one-byte value.
    let n_kv = c.count(8 + 4 + 1, "metadata count")?;

    let mut metadata = BTreeMap::new();
    for _ in 0..n_kv {
        let key = c.string("metadata key")?;
        let ty = c.value_type(&format!("metadata `{key}` type"))?;
        let value = c.value(ty, &key, 0)?;
        if metadata.insert(key.clone(), value).is_some() {
            return Err(c.err(format!("duplicate metadata key `{key}`")));
        }
    }
    let alignment = read_alignment(&c, &metadata)?;

    let mut tensors = Vec::with_capacity(n_tensors);
    let mut seen = HashSet::with_capacity(n_tensors);
    for _ in 0..n_tensors {
        let t = read_tensor_info(&mut c)?;
        if !seen.insert(t.name.clone()) {
            return Err(c.err(format!("duplicate tensor `{}`", t.name)));
        }
        tensors.push(t);
    }

    let data_offset = (c.pos as u64).div_ceil(alignment) * alignment;
    let file_len = buf.len() as u64;
    for t in &mut tensors {
        let rel = t.offset as u64;
        if !rel.is_multiple_of(alignment) {
            return Err(Error::malformed(
                path,
                format!("tensor `{}` offset {rel} is not a multiple of the alignment {alignment}", t.name),
            ));
        }
        let end = data_offset.checked_add(rel).and_then(|s| s.checked_add(t.n_bytes as u64));
        match end {
            Some(end) if end <= file_len => t.offset = (data_offset + rel) as usize,
            _ => {
                return Err(Error::malformed(
                    path,
                    format!(
                        "tensor `{}` ({} bytes at data offset {rel}) runs past the end of the file ({file_len} bytes; data starts at {data_offset})",
                        t.name, t.n_bytes
                    ),
                ));
            }
        }
    }
    Ok(Parsed { version, metadata, tensors, alignment: alignment as usize, data_offset: data_offset as usize })
}
