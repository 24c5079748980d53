//! TurboQuant (Zandieh et al., arXiv 2504.19874) for KV caches: a vector is
//! rotated by a seeded randomized Walsh–Hadamard transform, after which every
//! coordinate follows one known distribution, and each coordinate is
//! quantized with a Lloyd–Max codebook for that distribution; keys may
//! instead spend one bit on a QJL sketch of the residual for unbiased
//! scores. The rotation, codebooks and sketches are derived from seeds and
//! shared by every backend, so CPU and GPU decode the same numbers.

pub mod bits;
pub mod codebook;
pub mod codec;
pub mod qjl;
pub mod rotation;

pub use codec::VectorCodec;
