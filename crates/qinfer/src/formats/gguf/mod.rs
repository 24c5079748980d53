//! GGUF v2/v3 (llama.cpp's single-file format): metadata, tensor infos and
//! tensors borrowed from an mmap of the file.
//!
//! Layout: magic `GGUF`, u32 version, u64 tensor count, u64 metadata count,
//! the metadata key/values, the tensor infos, padding to `general.alignment`
//! (default 32), then the tensor data; tensor offsets are relative to the data.

mod config;
mod file;
mod gdn_meta;
mod ggml_type;
mod hybrid;
mod meta;
mod moe_meta;
mod names;
mod reader;
mod source;
mod value;

pub use config::architecture_named;
pub use file::GgufFile;
pub use ggml_type::GgmlType;
pub use names::{gguf_to_hf, hf_to_gguf};
pub use reader::GgufTensorInfo;
pub use value::{GgufArray, GgufValue, GgufValueType};
