// The shared constants the included kernel sources need: the values of
// backend/cuda/constants.rs (GEMV_MAX_ROWS, FP8_MMA_WARPS, FP8_MMA_PAD).
#define GEMV_MAX_ROWS 8
#define FP8_MMA_WARPS 8
#define FP8_MMA_PAD 8
