//! Malformed safetensors checkpoints give errors that name the file or tensor, never panics.

use std::path::{Path, PathBuf};

use qinfer::formats::TensorSource;
use qinfer::formats::safetensors::SafetensorsSource;

fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("qinfer-st-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A safetensors file with the given header JSON and data bytes.
fn write_st(path: &Path, header: &str, data: &[u8]) {
    let mut h = header.as_bytes().to_vec();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&h);
    bytes.extend_from_slice(data);
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn valid_file_round_trips() {
    let d = temp_dir("ok");
    write_st(&d.join("model.safetensors"), r#"{"w":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8]}}"#, &[0; 8]);
    let s = SafetensorsSource::open_dir(&d).unwrap();
    let t = s.tensor("w").unwrap();
    assert_eq!(t.shape, vec![2, 2]);
    let e = s.tensor("missing").unwrap_err().to_string();
    assert!(e.contains("missing"), "{e}");
}

#[test]
fn every_truncation_is_an_error() {
    let d = temp_dir("trunc");
    let p = d.join("model.safetensors");
    write_st(&p, r#"{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#, &[0; 16]);
    let full = std::fs::read(&p).unwrap();
    for cut in 0..full.len() {
        std::fs::write(&p, &full[..cut]).unwrap();
        match SafetensorsSource::open_dir(&d) {
            Err(e) => assert!(e.to_string().contains("model.safetensors"), "cut {cut}: {e}"),
            Ok(_) => panic!("truncated at {cut} of {} accepted", full.len()),
        }
    }
}

#[test]
fn corrupt_headers_are_errors() {
    let d = temp_dir("corrupt");
    let p = d.join("model.safetensors");
    for header in [
        "not json",
        r#"{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,32]}}"#,
        r#"{"w":{"dtype":"F32","shape":[4],"data_offsets":[8,0]}}"#,
        r#"{"w":{"dtype":"F32","shape":[5],"data_offsets":[0,16]}}"#,
        r#"{"w":{"dtype":"NOPE","shape":[4],"data_offsets":[0,16]}}"#,
    ] {
        write_st(&p, header, &[0; 16]);
        let e = SafetensorsSource::open_dir(&d).err().unwrap_or_else(|| panic!("accepted {header}"));
        assert!(e.to_string().contains("model.safetensors"), "{header}: {e}");
    }
    // A header length beyond the file.
    let mut bytes = (1u64 << 40).to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    std::fs::write(&p, bytes).unwrap();
    assert!(SafetensorsSource::open_dir(&d).is_err());
}

#[test]
fn unsupported_dtype_is_an_error_naming_the_tensor() {
    let d = temp_dir("dtype");
    write_st(&d.join("model.safetensors"), r#"{"ids":{"dtype":"I64","shape":[2],"data_offsets":[0,16]}}"#, &[0; 16]);
    let s = SafetensorsSource::open_dir(&d).unwrap();
    let e = s.tensor("ids").unwrap_err().to_string();
    assert!(e.contains("ids") && e.contains("I64"), "{e}");
}

#[test]
fn shard_index_problems_are_errors() {
    let d = temp_dir("index");
    std::fs::write(
        d.join("model.safetensors.index.json"),
        r#"{"weight_map":{"w":"model-00001-of-00002.safetensors"}}"#,
    )
    .unwrap();
    let e = SafetensorsSource::open_dir(&d).err().expect("missing shard").to_string();
    assert!(e.contains("model-00001-of-00002.safetensors"), "{e}");
    std::fs::write(d.join("model.safetensors.index.json"), r#"{"weight_map":{"w":"../../etc/passwd"}}"#).unwrap();
    assert!(SafetensorsSource::open_dir(&d).is_err());
    std::fs::write(d.join("model.safetensors.index.json"), "{").unwrap();
    let e = SafetensorsSource::open_dir(&d).err().unwrap().to_string();
    assert!(e.contains("index.json"), "{e}");
}

#[test]
fn sharded_checkpoints_load_from_every_shard() {
    let d = temp_dir("shards");
    write_st(
        &d.join("a.safetensors"),
        r#"{"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#,
        &1f32.to_le_bytes(),
    );
    write_st(
        &d.join("b.safetensors"),
        r#"{"y":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#,
        &2f32.to_le_bytes(),
    );
    std::fs::write(
        d.join("model.safetensors.index.json"),
        r#"{"weight_map":{"x":"a.safetensors","y":"b.safetensors"}}"#,
    )
    .unwrap();
    let s = SafetensorsSource::open_dir(&d).unwrap();
    assert_eq!(s.tensor("x").unwrap().to_f32_vec(), vec![1.0]);
    assert_eq!(s.tensor("y").unwrap().to_f32_vec(), vec![2.0]);
}
