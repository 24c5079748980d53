//! GGUF reader robustness: small files written by a tiny writer below (v3 and
//! v2) parse exactly; truncated, corrupted and hostile variants give
//! `Error::Malformed` naming the file — never a panic or a huge allocation.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use qinfer::Error;
use qinfer::config::{Architecture, RopeScaling, RopeStyle};
use qinfer::formats::TensorSource;
use qinfer::formats::gguf::{GgufArray, GgufFile, GgufValue, GgufValueType};
use qinfer::tensor::DType;

// ---------------------------------------------------------------- writer

#[derive(Clone)]
enum V {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    /// Element type id and elements (all of that type).
    Arr(u32, Vec<V>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl V {
    fn type_id(&self) -> u32 {
        match self {
            V::U8(_) => 0,
            V::I8(_) => 1,
            V::U16(_) => 2,
            V::I16(_) => 3,
            V::U32(_) => 4,
            V::I32(_) => 5,
            V::F32(_) => 6,
            V::Bool(_) => 7,
            V::Str(_) => 8,
            V::Arr(..) => 9,
            V::U64(_) => 10,
            V::I64(_) => 11,
            V::F64(_) => 12,
        }
    }
    fn write(&self, out: &mut Vec<u8>) {
        match self {
            V::U8(x) => out.push(*x),
            V::I8(x) => out.extend(x.to_le_bytes()),
            V::U16(x) => out.extend(x.to_le_bytes()),
            V::I16(x) => out.extend(x.to_le_bytes()),
            V::U32(x) => out.extend(x.to_le_bytes()),
            V::I32(x) => out.extend(x.to_le_bytes()),
            V::F32(x) => out.extend(x.to_le_bytes()),
            V::Bool(x) => out.push(u8::from(*x)),
            V::Str(s) => write_str(out, s),
            V::Arr(ty, items) => {
                out.extend(ty.to_le_bytes());
                out.extend((items.len() as u64).to_le_bytes());
                for i in items {
                    i.write(out);
                }
            }
            V::U64(x) => out.extend(x.to_le_bytes()),
            V::I64(x) => out.extend(x.to_le_bytes()),
            V::F64(x) => out.extend(x.to_le_bytes()),
        }
    }
}

fn s(x: &str) -> V {
    V::Str(x.to_string())
}

fn write_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

#[derive(Clone)]
struct T {
    name: String,
    /// Innermost first, as GGUF stores them.
    ne: Vec<u64>,
    ty: u32,
    data: Vec<u8>,
}

#[derive(Clone)]
struct Writer {
    version: u32,
    kvs: Vec<(String, V)>,
    tensors: Vec<T>,
    /// The alignment the writer pads to (set `general.alignment` to match).
    alignment: usize,
}

/// Byte positions of interesting fields in the written file.
type Marks = HashMap<String, usize>;

impl Writer {
    fn new(version: u32) -> Self {
        Writer { version, kvs: vec![], tensors: vec![], alignment: 32 }
    }
    fn kv(mut self, k: &str, v: V) -> Self {
        self.kvs.push((k.to_string(), v));
        self
    }
    fn tensor(mut self, name: &str, ne: &[u64], ty: u32, data: Vec<u8>) -> Self {
        self.tensors.push(T { name: name.to_string(), ne: ne.to_vec(), ty, data });
        self
    }
    fn build(&self) -> (Vec<u8>, Marks) {
        let mut m = Marks::new();
        let mut out = b"GGUF".to_vec();
        m.insert("version".into(), out.len());
        out.extend(self.version.to_le_bytes());
        m.insert("n_tensors".into(), out.len());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        m.insert("n_kv".into(), out.len());
        out.extend((self.kvs.len() as u64).to_le_bytes());
        for (k, v) in &self.kvs {
            m.insert(format!("kv.{k}"), out.len());
            write_str(&mut out, k);
            m.insert(format!("kv.{k}.type"), out.len());
            out.extend(v.type_id().to_le_bytes());
            m.insert(format!("kv.{k}.value"), out.len());
            v.write(&mut out);
        }
        let mut rel = 0usize;
        let mut offsets = vec![];
        for t in &self.tensors {
            m.insert(format!("t.{}", t.name), out.len());
            write_str(&mut out, &t.name);
            m.insert(format!("t.{}.ndims", t.name), out.len());
            out.extend((t.ne.len() as u32).to_le_bytes());
            m.insert(format!("t.{}.ne", t.name), out.len());
            for d in &t.ne {
                out.extend(d.to_le_bytes());
            }
            m.insert(format!("t.{}.type", t.name), out.len());
            out.extend(t.ty.to_le_bytes());
            m.insert(format!("t.{}.offset", t.name), out.len());
            out.extend((rel as u64).to_le_bytes());
            offsets.push(rel);
            rel = (rel + t.data.len()).div_ceil(self.alignment) * self.alignment;
        }
        let data_start = out.len().div_ceil(self.alignment) * self.alignment;
        out.resize(data_start, 0);
        m.insert("data".into(), data_start);
        for (t, off) in self.tensors.iter().zip(offsets) {
            out.resize(data_start + off, 0);
            out.extend(&t.data);
        }
        (out, m)
    }
}

// ---------------------------------------------------------------- helpers

struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let p = std::env::temp_dir().join(format!("qinfer_gguf_{name}_{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    fn write(&self, name: &str, bytes: &[u8]) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A file exercising every metadata type and four tensors: F32 [2, 3],
/// Q8_0 [4, 32], IQ4_XS [1, 256] (listed, but not loadable) and Q6_K [1, 256]
/// (last, so that truncations cut into K-quant block data).
fn sample(version: u32) -> Writer {
    let mut q8 = vec![];
    for row in 0..4u8 {
        q8.extend(half::f16::from_f32(0.5).to_le_bytes());
        q8.extend((0..32).map(|i| (i as i8 - row as i8) as u8));
    }
    Writer::new(version)
        .kv("general.name", s("tiny"))
        .kv("t.u8", V::U8(200))
        .kv("t.i8", V::I8(-5))
        .kv("t.u16", V::U16(65000))
        .kv("t.i16", V::I16(-300))
        .kv("t.u32", V::U32(4_000_000_000))
        .kv("t.i32", V::I32(-70_000))
        .kv("t.f32", V::F32(1.5))
        .kv("t.bool", V::Bool(true))
        .kv("t.u64", V::U64(1 << 40))
        .kv("t.i64", V::I64(-(1 << 40)))
        .kv("t.f64", V::F64(-2.25))
        .kv("t.empty_str", s(""))
        .kv("t.utf8", s("héllo ✓"))
        .kv("t.arr_u32", V::Arr(4, vec![V::U32(1), V::U32(2), V::U32(3)]))
        .kv("t.arr_str", V::Arr(8, vec![s("a"), s(""), s("<|im_start|>")]))
        .kv("t.arr_empty", V::Arr(6, vec![]))
        .kv("t.arr_bool", V::Arr(7, vec![V::Bool(false), V::Bool(true)]))
        .kv("t.nested", V::Arr(9, vec![V::Arr(5, vec![V::I32(-1)]), V::Arr(8, vec![s("x"), s("y")])]))
        .tensor("a.weight", &[3, 2], 0, f32_bytes(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]))
        .tensor("b.weight", &[32, 4], 8, q8)
        .tensor("k.weight", &[256, 1], 23, vec![7u8; 136])
        .tensor("q6.weight", &[256, 1], 14, vec![7u8; 210])
}

fn expect_malformed(path: &Path, what: &str) -> String {
    match GgufFile::open(path) {
        Ok(_) => panic!("{what}: expected an error, parsed fine"),
        Err(e) => {
            let msg = e.to_string();
            assert!(matches!(e, Error::Malformed { .. }), "{what}: wrong error kind: {msg}");
            assert!(msg.contains(&path.display().to_string()), "{what}: error does not name the file: {msg}");
            msg
        }
    }
}

fn patch(bytes: &[u8], at: usize, with: &[u8]) -> Vec<u8> {
    let mut b = bytes.to_vec();
    b[at..at + with.len()].copy_from_slice(with);
    b
}

// ---------------------------------------------------------------- valid files

#[test]
fn parses_valid_v3_and_v2() {
    let dir = TempDir::new("valid");
    for version in [3, 2] {
        let (bytes, marks) = sample(version).build();
        let path = dir.write(&format!("v{version}.gguf"), &bytes);
        let f = GgufFile::open(&path).unwrap();
        assert_eq!(f.version(), version);
        assert_eq!(f.alignment(), 32);
        assert_eq!(f.data_offset(), marks["data"]);
        assert_eq!(f.data_offset() % 32, 0);
        let md = f.metadata();
        assert_eq!(md.len(), 19);
        assert_eq!(md["general.name"], GgufValue::String("tiny".into()));
        assert_eq!(md["t.u8"], GgufValue::U8(200));
        assert_eq!(md["t.i8"], GgufValue::I8(-5));
        assert_eq!(md["t.u16"], GgufValue::U16(65000));
        assert_eq!(md["t.i16"], GgufValue::I16(-300));
        assert_eq!(md["t.u32"].as_u64(), Some(4_000_000_000));
        assert_eq!(md["t.i32"].as_i64(), Some(-70_000));
        assert_eq!(md["t.f32"].as_f64(), Some(1.5));
        assert_eq!(md["t.bool"].as_bool(), Some(true));
        assert_eq!(md["t.u64"], GgufValue::U64(1 << 40));
        assert_eq!(md["t.i64"], GgufValue::I64(-(1 << 40)));
        assert_eq!(md["t.f64"], GgufValue::F64(-2.25));
        assert_eq!(md["t.empty_str"].as_str(), Some(""));
        assert_eq!(md["t.utf8"].as_str(), Some("héllo ✓"));
        assert_eq!(md["t.arr_u32"], GgufValue::Array(GgufArray::U32(vec![1, 2, 3])));
        let strs = md["t.arr_str"].as_array().unwrap().as_strings().unwrap();
        assert_eq!(strs, ["a", "", "<|im_start|>"]);
        assert_eq!(md["t.arr_empty"].as_array().unwrap().elem_type(), GgufValueType::F32);
        assert!(md["t.arr_empty"].as_array().unwrap().is_empty());
        assert_eq!(md["t.arr_bool"], GgufValue::Array(GgufArray::Bool(vec![false, true])));
        assert_eq!(
            md["t.nested"],
            GgufValue::Array(GgufArray::Array(vec![
                GgufArray::I32(vec![-1]),
                GgufArray::String(vec!["x".into(), "y".into()])
            ]))
        );

        let infos = f.tensor_infos();
        assert_eq!(infos.len(), 4);
        let a = &infos[0];
        assert_eq!((a.name.as_str(), a.type_name, a.ggml_type), ("a.weight", "F32", 0));
        assert_eq!(a.shape, vec![2, 3], "outermost first");
        assert_eq!((a.offset, a.n_bytes), (marks["data"], 24));
        let b = &infos[1];
        assert_eq!((b.type_name, b.shape.as_slice(), b.n_bytes), ("Q8_0", &[4, 32][..], 4 * 34));
        assert_eq!(b.offset, marks["data"] + 32, "aligned after a");
        let k = &infos[2];
        assert_eq!((k.type_name, k.shape.as_slice(), k.n_bytes), ("IQ4_XS", &[1, 256][..], 136));
        let q6 = f.raw_tensor("q6.weight").unwrap();
        assert_eq!((q6.dtype, q6.shape.as_slice(), q6.data.len()), (DType::Q6_K, &[1, 256][..], 210));

        let t = f.raw_tensor("a.weight").unwrap();
        assert_eq!((t.dtype, t.shape.as_slice()), (DType::F32, &[2, 3][..]));
        assert_eq!(t.data.as_slice(), f32_bytes(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).as_slice());
        let t = f.raw_tensor("b.weight").unwrap();
        assert_eq!(t.dtype, DType::Q8_0);
        assert_eq!(&t.data.as_slice()[2..5], &[0, 1, 2]);
        // Unsupported types are listed but refuse to load, naming tensor and type.
        let e = f.raw_tensor("k.weight").unwrap_err().to_string();
        assert!(e.contains("k.weight") && e.contains("IQ4_XS"), "{e}");
        assert!(f.raw_tensor("nope").is_err());
        assert_eq!(f.names(), vec!["a.weight", "b.weight", "k.weight", "q6.weight"]);
    }
}

#[test]
fn honours_general_alignment() {
    let dir = TempDir::new("align");
    let mut w = sample(3).kv("general.alignment", V::U32(64));
    w.alignment = 64;
    let (bytes, marks) = w.build();
    let f = GgufFile::open(&dir.write("a64.gguf", &bytes)).unwrap();
    assert_eq!(f.alignment(), 64);
    assert_eq!(f.data_offset(), marks["data"]);
    assert_eq!(f.data_offset() % 64, 0);
    assert_eq!(f.tensor_infos()[1].offset, marks["data"] + 64);
    assert_eq!(f.raw_tensor("a.weight").unwrap().data.as_slice(), f32_bytes(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]));

    for (bad, what) in [(V::U32(0), "zero"), (V::U32(48), "not a power of two"), (V::U64(32), "wrong type")] {
        let (bytes, _) = sample(3).kv("general.alignment", bad).build();
        let msg = expect_malformed(&dir.write("bad_align.gguf", &bytes), what);
        assert!(msg.contains("general.alignment"), "{msg}");
    }
}

// ---------------------------------------------------------------- malformed files

#[test]
fn every_truncation_is_an_error() {
    let dir = TempDir::new("trunc");
    let (bytes, _) = sample(3).build();
    // The last tensor ends at the end of the file, so every strict prefix lacks something.
    for len in 0..bytes.len() {
        let path = dir.write("t.gguf", &bytes[..len]);
        let msg = expect_malformed(&path, &format!("truncated to {len}"));
        assert!(!msg.is_empty());
    }
}

/// Block types whose rows are not whole blocks, or whose data is cut short:
/// errors name the file and the tensor.
#[test]
fn partial_blocks_of_every_quantized_type() {
    let dir = TempDir::new("blocks");
    // (ggml id, values per block, bytes per block)
    let types = [
        (2, 32, 18),
        (3, 32, 20),
        (6, 32, 22),
        (7, 32, 24),
        (8, 32, 34),
        (10, 256, 84),
        (11, 256, 110),
        (12, 256, 144),
        (13, 256, 176),
        (14, 256, 210),
    ];
    for (id, block, bytes) in types {
        // Rows of half a block (two rows hold one block's worth of values).
        let (b, _) = Writer::new(3).tensor("w.weight", &[block / 2, 2], id, vec![0u8; bytes]).build();
        let msg = expect_malformed(&dir.write("half.gguf", &b), &format!("type {id}, half-block rows"));
        assert!(msg.contains("w.weight"), "{msg}");
        // Two rows declared, one row of data: the data section ends early.
        let (b, _) = Writer::new(3).tensor("w.weight", &[block, 2], id, vec![0u8; bytes]).build();
        let msg = expect_malformed(&dir.write("short.gguf", &b), &format!("type {id}, short data"));
        assert!(msg.contains("w.weight"), "{msg}");
    }
}

#[test]
fn corrupted_header_fields() {
    let dir = TempDir::new("header");
    let (bytes, m) = sample(3).build();
    let check = |b: Vec<u8>, what: &str, needle: &str| {
        let msg = expect_malformed(&dir.write("c.gguf", &b), what);
        assert!(msg.to_lowercase().contains(&needle.to_lowercase()), "{what}: {msg}");
    };
    check(patch(&bytes, 0, b"GGUG"), "magic", "magic");
    check(patch(&bytes, m["version"], &1u32.to_le_bytes()), "v1", "version 1");
    check(patch(&bytes, m["version"], &4u32.to_le_bytes()), "v4", "version 4");
    check(patch(&bytes, m["version"], &3u32.to_be_bytes()), "big endian", "big-endian");
    check(patch(&bytes, m["n_tensors"], &u64::MAX.to_le_bytes()), "huge tensor count", "tensor count");
    check(patch(&bytes, m["n_kv"], &(1u64 << 40).to_le_bytes()), "huge kv count", "metadata count");
    check(patch(&bytes, m["kv.general.name"], &u64::MAX.to_le_bytes()), "huge key length", "length");
    check(patch(&bytes, m["kv.general.name.value"], &(1u64 << 50).to_le_bytes()), "huge string", "length");
    check(
        patch(&bytes, m["kv.t.u8.type"], &13u32.to_le_bytes()),
        "unknown value type",
        "unknown metadata value type 13",
    );
    check(patch(&bytes, m["kv.t.bool.value"], &[2]), "bool byte", "bool");
    // Array length field sits after the element type.
    check(patch(&bytes, m["kv.t.arr_u32.value"] + 4, &u64::MAX.to_le_bytes()), "huge array", "array length");
    check(patch(&bytes, m["kv.t.arr_str.value"] + 4, &(1u64 << 33).to_le_bytes()), "huge string array", "array length");
    check(
        patch(&bytes, m["kv.t.arr_u32.value"], &99u32.to_le_bytes()),
        "bad array type",
        "unknown metadata value type 99",
    );
    // Duplicate key: rename t.i8 to t.u8 (same length).
    check(patch(&bytes, m["kv.t.i8"] + 8, b"t.u8"), "duplicate key", "duplicate metadata key");
}

#[test]
fn corrupted_tensor_infos() {
    let dir = TempDir::new("tinfo");
    let (bytes, m) = sample(3).build();
    let check = |b: Vec<u8>, what: &str, needle: &str| {
        let msg = expect_malformed(&dir.write("c.gguf", &b), what);
        assert!(msg.contains(needle), "{what}: {msg}");
    };
    check(patch(&bytes, m["t.a.weight.type"], &99u32.to_le_bytes()), "unknown ggml type", "unknown ggml type id 99");
    check(patch(&bytes, m["t.a.weight.type"], &4u32.to_le_bytes()), "removed ggml type", "a.weight");
    check(patch(&bytes, m["t.a.weight.ndims"], &5u32.to_le_bytes()), "too many dims", "5 dimensions");
    check(patch(&bytes, m["t.a.weight.ne"], &u64::MAX.to_le_bytes()), "dims overflow", "overflow");
    check(patch(&bytes, m["t.a.weight.ne"], &(1u64 << 62).to_le_bytes()), "dims past i64", "overflow");
    check(patch(&bytes, m["t.b.weight.ne"], &33u64.to_le_bytes()), "partial block", "multiple of the Q8_0 block");
    check(patch(&bytes, m["t.a.weight.offset"], &8u64.to_le_bytes()), "unaligned offset", "alignment");
    check(patch(&bytes, m["t.a.weight.offset"], &(1u64 << 40).to_le_bytes()), "offset past end", "past the end");
    check(patch(&bytes, m["t.a.weight.offset"], &(u64::MAX - 31).to_le_bytes()), "offset overflow", "past the end");
    check(patch(&bytes, m["t.a.weight.ne"], &(1u64 << 30).to_le_bytes()), "size past end", "past the end");
    // Duplicate tensor: rename b.weight to a.weight.
    check(patch(&bytes, m["t.b.weight"] + 8, b"a.weight"), "duplicate tensor", "duplicate tensor");
}

#[test]
fn deeply_nested_arrays_are_refused() {
    let dir = TempDir::new("nest");
    let mut v = V::Arr(4, vec![V::U32(1)]);
    for _ in 0..20 {
        v = V::Arr(9, vec![v]);
    }
    let (bytes, _) = Writer::new(3).kv("deep", v).build();
    let msg = expect_malformed(&dir.write("deep.gguf", &bytes), "deep nesting");
    assert!(msg.contains("nested"), "{msg}");
}

#[test]
fn byte_flips_never_panic() {
    let dir = TempDir::new("flip");
    let (bytes, m) = sample(3).build();
    let path = dir.0.join("f.gguf");
    // Every byte of the header, metadata and tensor infos, three ways.
    for i in 0..m["data"] {
        for f in [|b: u8| b ^ 0xff, |b: u8| b.wrapping_add(1), |_| 0x80] {
            let mut b = bytes.clone();
            b[i] = f(b[i]);
            std::fs::write(&path, &b).unwrap();
            if let Err(e) = GgufFile::open(&path) {
                assert!(e.to_string().contains(&path.display().to_string()), "{e}");
            }
        }
    }
}

#[test]
fn missing_and_empty_files() {
    let dir = TempDir::new("empty");
    let e = GgufFile::open(&dir.0.join("absent.gguf")).unwrap_err();
    assert!(matches!(e, Error::Io { .. }), "{e}");
    expect_malformed(&dir.write("empty.gguf", b""), "empty");
    expect_malformed(&dir.write("text.gguf", b"this is not a gguf file at all, just text"), "text");
}

// ---------------------------------------------------------------- config and names

fn qwen3_writer() -> Writer {
    let f32s = |n: usize| f32_bytes(&vec![1.0; n]);
    let mut w = Writer::new(3)
        .kv("general.architecture", s("qwen3"))
        .kv("qwen3.block_count", V::U32(2))
        .kv("qwen3.context_length", V::U32(4096))
        .kv("qwen3.embedding_length", V::U32(64))
        .kv("qwen3.feed_forward_length", V::U32(128))
        .kv("qwen3.attention.head_count", V::U32(4))
        .kv("qwen3.attention.head_count_kv", V::U32(2))
        .kv("qwen3.attention.key_length", V::U32(32))
        .kv("qwen3.attention.value_length", V::U32(32))
        .kv("qwen3.rope.freq_base", V::F32(1_000_000.0))
        .kv("qwen3.attention.layer_norm_rms_epsilon", V::F32(1e-6))
        .kv("tokenizer.ggml.bos_token_id", V::U32(3))
        .kv("tokenizer.ggml.eos_token_id", V::U32(5))
        .kv("tokenizer.ggml.eot_token_id", V::U32(6))
        .tensor("token_embd.weight", &[64, 256], 0, f32s(64 * 256))
        .tensor("output_norm.weight", &[64], 0, f32s(64));
    for i in 0..2 {
        w = w.tensor(&format!("blk.{i}.attn_q.weight"), &[64, 128], 1, vec![0; 64 * 128 * 2]).tensor(
            &format!("blk.{i}.attn_q_norm.weight"),
            &[32],
            0,
            f32s(32),
        );
    }
    w
}

#[test]
fn model_config_from_metadata() {
    let dir = TempDir::new("config");
    let (bytes, _) = qwen3_writer().build();
    let f = GgufFile::open(&dir.write("q.gguf", &bytes)).unwrap();
    let c = f.model_config().unwrap();
    assert_eq!(c.arch, Architecture::Qwen3);
    assert_eq!((c.num_layers, c.hidden_size, c.intermediate_size), (2, 64, 128));
    assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim), (4, 2, 32));
    assert_eq!(c.vocab_size, 256, "from token_embd when no vocab_size/tokens");
    assert_eq!(c.rope.theta, 1e6);
    assert_eq!(c.rope.style, RopeStyle::Neox);
    assert_eq!(c.max_position_embeddings, 4096);
    assert!(c.tie_word_embeddings && c.qk_norm && !c.attention_bias && !c.o_bias);
    assert_eq!(c.bos_token_id, Some(3));
    assert_eq!(c.eos_token_ids, vec![5, 6]);
    assert_eq!(c.layer_windows, vec![None, None]);
    assert!(qinfer::tokenizer::gguf::from_file(&f).unwrap().is_none(), "no tokenizer.ggml.model");

    // HF names resolve; shapes are outermost first.
    let q = f.tensor("model.layers.1.self_attn.q_proj.weight").unwrap();
    assert_eq!((q.dtype, q.shape.as_slice()), (DType::F16, &[128, 64][..]));
    assert!(f.contains("model.layers.0.self_attn.q_norm.weight"));
    assert!(f.tensor("model.layers.0.self_attn.q_proj.bias").is_err());
}

#[test]
fn model_config_errors_name_the_key() {
    let dir = TempDir::new("config_err");
    let mut w = qwen3_writer();
    w.kvs.retain(|(k, _)| k != "qwen3.block_count");
    let f = GgufFile::open(&dir.write("a.gguf", &w.build().0)).unwrap();
    let e = f.model_config().unwrap_err().to_string();
    assert!(e.contains("qwen3.block_count"), "{e}");

    let mut w = qwen3_writer();
    w.kvs[0].1 = s("mamba");
    let f = GgufFile::open(&dir.write("b.gguf", &w.build().0)).unwrap();
    assert!(matches!(f.model_config().unwrap_err(), Error::UnknownArchitecture { .. }));

    let w = qwen3_writer().kv("qwen3.rope.scaling.type", s("yarn"));
    let f = GgufFile::open(&dir.write("c.gguf", &w.build().0)).unwrap();
    let e = f.model_config().unwrap_err().to_string();
    assert!(e.contains("yarn"), "{e}");

    let mut w = qwen3_writer();
    w.kvs[5].1 = V::Arr(4, vec![V::U32(4), V::U32(4)]); // per-layer head counts
    let f = GgufFile::open(&dir.write("d.gguf", &w.build().0)).unwrap();
    let e = f.model_config().unwrap_err().to_string();
    assert!(e.contains("qwen3.attention.head_count"), "{e}");

    let w = qwen3_writer().kv("tokenizer.ggml.model", s("llama"));
    let f = GgufFile::open(&dir.write("e.gguf", &w.build().0)).unwrap();
    let e = qinfer::tokenizer::gguf::from_file(&f).unwrap_err().to_string();
    assert!(e.contains("unsupported GGUF tokenizer model llama"), "{e}");
}

/// Llama 3 GGUFs carry RoPE scaling as a `rope_freqs.weight` tensor; the
/// published recipe is recognised and anything else refused.
#[test]
fn llama3_rope_freqs_become_scaling() {
    let dir = TempDir::new("rope");
    let (theta, head_dim) = (500_000.0f64, 64usize);
    let factors: Vec<f32> = (0..head_dim / 2)
        .map(|i| {
            let freq = 1.0 / theta.powf((2 * i) as f64 / head_dim as f64);
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            let (factor, low, high, orig) = (8.0, 1.0, 4.0, 8192.0);
            if wavelen < orig / high {
                1.0
            } else if wavelen > orig / low {
                factor as f32
            } else {
                let smooth = (orig / wavelen - low) / (high - low);
                (1.0 / ((1.0 - smooth) / factor + smooth)) as f32
            }
        })
        .collect();
    let llama = |f: &[f32]| {
        Writer::new(3)
            .kv("general.architecture", s("llama"))
            .kv("llama.block_count", V::U32(1))
            .kv("llama.context_length", V::U32(131072))
            .kv("llama.embedding_length", V::U32(128))
            .kv("llama.feed_forward_length", V::U32(256))
            .kv("llama.attention.head_count", V::U32(2))
            .kv("llama.rope.freq_base", V::F32(theta as f32))
            .kv("llama.attention.layer_norm_rms_epsilon", V::F32(1e-5))
            .kv("llama.vocab_size", V::U32(1000))
            .tensor("rope_freqs.weight", &[32], 0, f32_bytes(f))
            .tensor("output.weight", &[128, 1000], 0, f32_bytes(&vec![0.0; 128 * 1000]))
    };
    let f = GgufFile::open(&dir.write("l3.gguf", &llama(&factors).build().0)).unwrap();
    let c = f.model_config().unwrap();
    assert_eq!(c.rope.style, RopeStyle::Interleaved);
    assert_eq!(c.head_dim, 64);
    assert!(!c.tie_word_embeddings);
    assert_eq!(
        c.rope.scaling,
        Some(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 8192
        })
    );
    let mut odd = factors.clone();
    odd[20] *= 1.5;
    let f = GgufFile::open(&dir.write("odd.gguf", &llama(&odd).build().0)).unwrap();
    assert!(f.model_config().unwrap_err().to_string().contains("rope_freqs"));
    let f = GgufFile::open(&dir.write("ones.gguf", &llama(&[1.0; 32]).build().0)).unwrap();
    assert_eq!(f.model_config().unwrap().rope.scaling, None);
}
