// Loads and stores of KV cache values, shared by the contiguous cache's
// kernels (attention.cu) and the paged pool's (batch.cu).
#pragma once

#include <cuda_fp16.h>

// The KV cache holds f32 or f16 values (kv/ `KvPrecision`): f16 halves
// the bytes every decode step reads (and the prefill's tensor cores take f16
// keys and values as they lie). A value is rounded once, where it is written;
// the arithmetic on it stays in f32.
__device__ __forceinline__ float kv_load(const float* p) { return *p; }
__device__ __forceinline__ float kv_load(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ void kv_store(float* p, float v) { *p = v; }
__device__ __forceinline__ void kv_store(__half* p, float v) { *p = __float2half_rn(v); }
// Four consecutive values (16- or 8-byte aligned) as a float4.
__device__ __forceinline__ float4 kv_load4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 kv_load4(const __half* p) {
    uint2 u = *reinterpret_cast<const uint2*>(p);
    float2 a = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
    float2 b = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
    return make_float4(a.x, a.y, b.x, b.y);
}
