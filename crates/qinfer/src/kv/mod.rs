//! Key/value cache formats. `contiguous` is the plain f32 cache of the CPU
//! backend; paged and quantized caches implement [`crate::backend::KvCache`] too.

pub mod contiguous;
