//! How the attention kernels cover a cache: the keys one decode block
//! holds on a device, the split of longer caches in chunks, their shared
//! memory, where the q|k|v prologue folds into the decode attention, and the
//! prefill's tensor-core tiles. Host arithmetic only, checked on any machine.

use crate::backend::QkvShape;
use crate::kv::KvPrecision;

/// Keys per block of the split-K decode attention (`ATTN_CHUNK`).
pub(super) const ATTENTION_CHUNK: usize = 128;

/// Keys times head dim of one `attention_decode{head_dim}` block that holds
/// the whole cache (`DECODE_ONE_BLOCK`): its key rows, and as many values.
pub(super) const DECODE_ONE_BLOCK: usize = 16384;

/// Static shared memory of `attention_decode` (q, scores, sums: at most
/// 8.3 KB) and the 1 KB the driver reserves per block, rounded up.
pub(super) const DECODE_STATIC_SHARED: usize = 10 * 1024;

/// Keys whose key and value rows an `attention_decode{head_dim}` block holds
/// when one block takes the whole cache: DECODE_ONE_BLOCK / head_dim (128 KB
/// of f32 rows, 64 KB of f16 ones), or the largest power of two that fits a
/// device giving a block less shared memory (`max_shared`, opt-in). None
/// below 32 keys: the plain split kernel then.
pub(super) fn decode_whole_keys(head_dim: usize, max_shared: usize, kv: KvPrecision) -> Option<usize> {
    let room = max_shared.saturating_sub(DECODE_STATIC_SHARED);
    let mut keys = DECODE_ONE_BLOCK / head_dim;
    while keys >= 32 && decode_shared(keys, head_dim, kv) > room {
        keys /= 2;
    }
    (keys >= 32).then_some(keys)
}

/// How `attention_decode` covers `n_keys` keys of a `kv` cache when one
/// block holds `whole` keys: (keys per block, blocks). A cache that fits one
/// block is one block's (no combine); a longer one is split in chunks of 64
/// KB of rows where the whole block's f32 rows are 128 KB (half the keys in
/// f32, all of them in f16; at least 32), so three blocks share an SM, their
/// number a power of two so one recorded step serves every cache length up
/// to it. (f16 chunks of half a block, 32 KB, made decode after 8192 tokens
/// 8-9% slower than 64 KB ones, and of a quarter 18-24%.)
pub(super) fn decode_plan(n_keys: usize, whole: usize, kv: KvPrecision) -> (usize, usize) {
    if n_keys <= whole {
        return (whole, 1);
    }
    let chunk = (whole * 2 / kv.bytes()).max(32);
    (chunk, n_keys.div_ceil(chunk).next_power_of_two())
}

/// [`decode_plan`] for a batch's steps, which are not recorded: as many
/// chunks as the longest cache needs, not a power of two of them (the
/// blocks past it would only write empty partial sums for the combine).
pub(super) fn batch_decode_plan(n_keys: usize, whole: usize, kv: KvPrecision) -> (usize, usize) {
    let (chunk, splits) = decode_plan(n_keys, whole, kv);
    (chunk, splits.min(n_keys.div_ceil(chunk)).max(1))
}

/// Whether a one-row decode step over `n_keys` keys (one block holding
/// `whole`) folds the q|k|v prologue into the decode attention: where a
/// cache one block holds, and with `fold_splits` where the split kernel's
/// blocks fit one wave (every (KV head, chunk, pair of query heads) block has
/// an SM). Longer caches do not: each of their blocks norms and rotates its
/// query heads again, which waves of blocks cannot hide (the fold everywhere
/// measured tg32 after 8192 tokens 2-11% slower; at 512 keys the fold made an
/// 8B q4g64 layer 3.0% faster).
pub(super) fn folds_prologue(
    n_keys: usize,
    whole: usize,
    kv: KvPrecision,
    shape: &QkvShape,
    sm_count: usize,
    fold_splits: bool,
) -> bool {
    let (_, splits) = decode_plan(n_keys, whole, kv);
    let pairs = (shape.num_heads / shape.num_kv_heads).div_ceil(DECODE_FUSED_HEADS);
    splits == 1 || (fold_splits && splits * shape.num_kv_heads * pairs <= sm_count)
}

/// Bytes of dynamic shared memory of an `attention_decode{head_dim}` block
/// of `chunk` keys: its key rows, at least as many as the warps' value sums
/// fill (`decode_red_keys`: 8 warps' f32 sums of `DECODE_HEADS` heads), then
/// its value rows.
pub(super) fn decode_shared(chunk: usize, head_dim: usize, kv: KvPrecision) -> usize {
    let red_keys = 8 * DECODE_HEADS * 4 / kv.bytes();
    (chunk.max(red_keys) + chunk) * head_dim * kv.bytes()
}

/// Dynamic shared memory of an `attention_decode{head_dim}` block that holds
/// the whole cache (`whole` keys): an f16 cache's block asks for what an f32
/// cache's takes (where the device allows), twice its rows. At short
/// contexts the decode attention is the step's critical path, and the
/// smaller blocks share their SMs with more of the GEMV blocks launched
/// behind them: Qwen3-0.6B bf16 decoded at 1382 tok/s with 64 KB blocks and
/// 1466 with 128 KB, the other models within 0.2% either way; the whole
/// SM's shared memory cost 0.6B q4g64 5%.
pub(super) fn decode_whole_shared(whole: usize, head_dim: usize, kv: KvPrecision, max_shared: usize) -> usize {
    let room = max_shared.saturating_sub(DECODE_STATIC_SHARED);
    decode_shared(whole, head_dim, kv).max(decode_shared(whole, head_dim, KvPrecision::F32).min(room))
}

/// The name suffix of the kernels that read or write a cache of `kv`.
pub(super) fn kv_suffix(kv: KvPrecision) -> &'static str {
    match kv {
        KvPrecision::F16 => "_f16",
        KvPrecision::F32 => "",
    }
}

/// Index of a precision in per-precision tables.
pub(super) fn kv_slot(kv: KvPrecision) -> usize {
    match kv {
        KvPrecision::F16 => 0,
        KvPrecision::F32 => 1,
    }
}

/// Threads of an `attention_combine` block.
pub(super) const COMBINE_THREADS: usize = 256;

/// Output values of a head per `attention_combine` block (`COMBINE_DIMS`).
pub(super) const COMBINE_DIMS: usize = 32;

/// Bytes of dynamic shared memory of `attention_combine` merging `splits`
/// parts: a weight per split, and each warp's partial sums.
pub(super) fn combine_shared(splits: usize) -> usize {
    (splits + COMBINE_THREADS / 32 * COMBINE_DIMS) * 4
}

/// The tiling of `flash_prefill{head_dim}` (`FLASH_PREFILL` in flash.cu):
/// query rows and threads per block, keys per tile, and its shared memory in
/// bytes (f16 q rows and two stages of k and v tiles, rows padded by 8).
pub(super) struct FlashTile {
    pub(super) rows: usize,
    pub(super) threads: usize,
    pub(super) shared: usize,
}

pub(super) fn flash_tile(head_dim: usize) -> FlashTile {
    let (keys, warps) = if head_dim > 128 { (32, 4) } else { (64, 8) };
    let rows = 16 * warps;
    FlashTile { rows, threads: 32 * warps, shared: 2 * (rows + 2 * 2 * keys) * (head_dim + 8) }
}

/// The tiling of `flash_bidir{head_dim}` (`FLASH_BIDIR` in flash.cu), as
/// [`flash_tile`]'s: head dim 80 takes four warps, so that a tile's loads
/// split evenly over the threads.
pub(super) fn flash_bidir_tile(head_dim: usize) -> FlashTile {
    let (keys, warps) = if head_dim == 80 { (64, 4) } else { (64, 8) };
    let rows = 16 * warps;
    FlashTile { rows, threads: 32 * warps, shared: 2 * (rows + 2 * 2 * keys) * (head_dim + 8) }
}

/// Query heads per block of the GQA decode attention (`DECODE_HEADS`).
pub(super) const DECODE_HEADS: usize = 4;

/// Threads of an `attention_decode` block (`DECODE_THREADS`).
pub(super) const DECODE_THREADS: usize = 256;

/// Query heads per block of the decode attention that folds the q|k|v
/// prologue (`DECODE_FUSED_HEADS`).
pub(super) const DECODE_FUSED_HEADS: usize = 2;

/// Key chunks of `attention_split`'s split-K attention over `n_keys` keys: a
/// power of two, so one recorded step serves every cache length up to it.
pub(super) fn split_count(n_keys: usize) -> usize {
    n_keys.div_ceil(ATTENTION_CHUNK).next_power_of_two()
}

/// The recorded decode step that serves `n_keys` keys: every layer's
/// attention plan (`decode_plan`, `split_count`) changes only where
/// n_keys / 32 crosses a power of two.
pub(super) fn decode_step_key(n_keys: usize) -> usize {
    n_keys.div_ceil(DECODE_ONE_BLOCK / 512).next_power_of_two()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_steps_split_caches_in_as_many_chunks_as_they_need() {
        let f16 = KvPrecision::F16;
        // 1,088 keys in chunks of 128: 9 chunks, where a recorded step takes 16.
        assert_eq!(decode_plan(1088, 128, f16), (128, 16));
        assert_eq!(batch_decode_plan(1088, 128, f16), (128, 9));
        // A cache one block holds, and exact multiples, are as before.
        assert_eq!(batch_decode_plan(100, 128, f16), (128, 1));
        assert_eq!(batch_decode_plan(1024, 128, f16), decode_plan(1024, 128, f16));
        // f32 rows: chunks of half the block's keys.
        assert_eq!(batch_decode_plan(300, 128, KvPrecision::F32), (64, 5));
    }

    #[test]
    fn decode_attention_holds_what_the_device_gives_a_block() {
        // H100/H200 (227 KB a block): 128 KB of rows whatever the head dim.
        let hopper = 227 * 1024;
        let f32_keys = |hd, max| decode_whole_keys(hd, max, KvPrecision::F32);
        assert_eq!([64, 128, 256].map(|hd| f32_keys(hd, hopper)), [Some(256), Some(128), Some(64)]);
        // Ada and consumer Ampere (99 KB): the largest power of two that fits.
        let ada = 99 * 1024;
        assert_eq!([64, 128, 256].map(|hd| f32_keys(hd, ada)), [Some(128), Some(64), Some(32)]);
        // Turing (64 KB): too few keys of 256 values for the kernel's sums.
        assert_eq!(f32_keys(256, 64 * 1024), None);
        assert_eq!(f32_keys(128, 64 * 1024), Some(32));
        // f16 rows: as many keys in half the bytes, so the same keys where
        // f32 rows fit, and whole caches on smaller devices.
        let f16_keys = |hd, max| decode_whole_keys(hd, max, KvPrecision::F16);
        assert_eq!([64, 128, 256].map(|hd| f16_keys(hd, hopper)), [Some(256), Some(128), Some(64)]);
        assert_eq!([64, 128, 256].map(|hd| f16_keys(hd, ada)), [Some(256), Some(128), Some(64)]);
        assert_eq!(f16_keys(256, 64 * 1024), Some(32));
        // Every chosen block fits with the kernel's static shared memory, and
        // its key space holds the warps' value sums (8 warps, 4 heads, f32).
        for kv in [KvPrecision::F16, KvPrecision::F32] {
            for max in [hopper, ada, 64 * 1024, 48 * 1024] {
                for hd in [64, 128, 256] {
                    if let Some(w) = decode_whole_keys(hd, max, kv) {
                        // A whole-cache block asks for at least its rows, at
                        // most what the device gives it.
                        let padded = decode_whole_shared(w, hd, kv, max);
                        assert!(padded >= decode_shared(w, hd, kv) && padded + DECODE_STATIC_SHARED <= max);
                        for chunk in [w, decode_plan(w + 1, w, kv).0] {
                            let shared = decode_shared(chunk, hd, kv);
                            assert!(shared + DECODE_STATIC_SHARED <= max, "{hd} at {max}");
                            assert!(shared - chunk * hd * kv.bytes() >= 8 * DECODE_HEADS * hd * 4, "{hd} {kv:?}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn split_caches_fold_the_prologue_while_one_wave_holds_them() {
        let h200 = 132;
        let heads = |num_heads, num_kv_heads| QkvShape { num_heads, num_kv_heads, head_dim: 128, output_gate: false };
        // Qwen3-8B (32 query heads, 8 KV heads, head dim 128, f16 cache): 128
        // keys a chunk, 16 blocks a chunk: up to 8 chunks (1024 keys).
        let whole = decode_whole_keys(128, 227 * 1024, KvPrecision::F16).unwrap();
        let folds = |n_keys, shape: &QkvShape| folds_prologue(n_keys, whole, KvPrecision::F16, shape, h200, true);
        assert!(folds(1024, &heads(32, 8)) && !folds(1025, &heads(32, 8)));
        assert!(!folds(8192, &heads(32, 8)));
        // 2 KV heads of 8 query heads (4 pairs): 8 blocks a chunk, so 16
        // chunks; 8 KV heads of one query head each: 8 blocks a chunk too.
        assert!(folds(2048, &heads(16, 2)) && !folds(2049, &heads(16, 2)));
        assert!(folds(2048, &heads(8, 8)) && !folds(2049, &heads(8, 8)));
        // 64 KV heads of 2: 64 blocks a chunk, 2 chunks.
        assert!(folds(256, &heads(128, 64)) && !folds(257, &heads(128, 64)));
        // A cache one block holds folds whatever the heads.
        assert!(folds(128, &heads(256, 256)) && !folds(129, &heads(256, 256)));
        // Without folding split caches, only a cache one block holds folds.
        let folds_whole = |n_keys| folds_prologue(n_keys, whole, KvPrecision::F16, &heads(32, 8), h200, false);
        assert!(folds_whole(128) && !folds_whole(129));
    }

    #[test]
    fn whole_cache_decode_blocks_ask_for_an_f32_blocks_shared_memory() {
        // Hopper, head dim 128: 128 keys, 64 KB of f16 rows, 128 KB asked.
        let hopper = 227 * 1024;
        assert_eq!(decode_shared(128, 128, KvPrecision::F16), 64 * 1024);
        assert_eq!(decode_whole_shared(128, 128, KvPrecision::F16, hopper), 128 * 1024);
        assert_eq!(decode_whole_shared(128, 128, KvPrecision::F32, hopper), 128 * 1024);
        // Ada (99 KB): f16 holds 128 keys of 128 (64 KB), f32 rows of as many
        // keys would not fit, so the block asks for what the device gives.
        let ada = 99 * 1024;
        assert_eq!(decode_whole_keys(128, ada, KvPrecision::F16), Some(128));
        assert_eq!(decode_whole_shared(128, 128, KvPrecision::F16, ada), ada - DECODE_STATIC_SHARED);
    }

    #[test]
    fn decode_plans_change_only_where_the_recorded_step_does() {
        for (kv, half) in [(KvPrecision::F32, true), (KvPrecision::F16, false)] {
            for whole in [32, 64, 128, 256] {
                assert_eq!(decode_plan(whole, whole, kv), (whole, 1));
                let (chunk, splits) = decode_plan(whole + 1, whole, kv);
                assert_eq!(chunk, if half { (whole / 2).max(32) } else { whole });
                assert!(splits * chunk > whole && splits.is_power_of_two());
                // Between consecutive keys of a recorded step, the plan is fixed.
                for n in 1..5000 {
                    if decode_step_key(n) == decode_step_key(n + 1) {
                        let (a, b) = (decode_plan(n, whole, kv), decode_plan(n + 1, whole, kv));
                        assert_eq!(a, b, "{n} keys, {whole} a block, {kv:?}");
                        assert_eq!(split_count(n), split_count(n + 1));
                    }
                }
            }
        }
    }
}
