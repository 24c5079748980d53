// Device times of FP8 decode GEMV forms against the bf16 GEMV at Qwen3-8B's
// decode shapes (q|k|v, o, gate|up, down), 36 layers' worth of distinct
// weights so every pass reads HBM, not L2. The production kernels come from
// the backend's sources (fp8.cu, gemv.cuh); fp8_block and fp8_warp are the
// CUDA-core shapes compared while fixing the production GEMV. Not part of
// the build: bench/fp8_gemv_micro/run.sh compiles it with nvcc on the GPU
// machine. Checks each kernel against an f64 reference first.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdio>
#include <vector>
#include <cstdlib>
#include <cmath>
#include "gemv.cuh"
#include "fp8.cu"

GEMV_FP8_KERNEL(gemv_fp8_r8a1, 8, 1)
GEMV_FP8_KERNEL(gemv_fp8_r16a1, 16, 1)
extern "C" __global__ void __launch_bounds__(256) gemv_bf16_r4(const __nv_bfloat16* w, const float* x, float* y, int o, int i) {
    gemv<__nv_bfloat16, 8, 4, 1>(w, x, nullptr, y, o, i, 1);
}

// Four E4M3 bytes as floats through the conversion instruction (fp8.cu's pair form).
__device__ __forceinline__ void e4m3x4_hw(unsigned v, float (&out)[4]) {
    unsigned lo = e4m3x2_to_f16x2(v), hi = e4m3x2_to_f16x2(v >> 16);
    float2 e = __half22float2(*reinterpret_cast<const __half2*>(&lo));
    float2 o = __half22float2(*reinterpret_cast<const __half2*>(&hi));
    out[0] = e.x; out[1] = e.y; out[2] = o.x; out[3] = o.y;
}

// x[16·i .. 16·i + 16).
__device__ __forceinline__ void load_x16(const float* __restrict__ x, int i, float (&xv)[16]) {
    const float4* xr = reinterpret_cast<const float4*>(x + i * 16);
#pragma unroll
    for (int j = 0; j < 4; j++) { float4 v = xr[j]; xv[4*j]=v.x; xv[4*j+1]=v.y; xv[4*j+2]=v.z; xv[4*j+3]=v.w; }
}

// Σ of 16 E4M3 weights times xv, by the conversion instruction (HW) or the
// f16-field trick (whose 2^-8 is undone here).
template <bool HW>
__device__ __forceinline__ float chunk_sum(uint4 q, const float (&xv)[16]) {
    unsigned words[4] = {q.x, q.y, q.z, q.w};
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        float f[4];
        if (HW) e4m3x4_hw(words[k], f); else e4m3x4_scaled(words[k], f);
#pragma unroll
        for (int m = 0; m < 4; m++) s += f[m] * xv[4*k+m];
    }
    return s * (HW ? 1.f : 256.f);
}

// Block-strided variant: ROWS rows per block, THREADS threads, HW cvt or bit trick, group uniform (128).
template <int ROWS, int THREADS, bool HW>
__global__ void __launch_bounds__(THREADS) fp8_block(const unsigned char* __restrict__ w, const float* __restrict__ scales,
                                                     const float* __restrict__ x, float* y, int out_dim, int in_dim) {
    int row0 = blockIdx.x * ROWS;
    int groups = in_dim / 128;
    const uint4* rows[ROWS];
    const float* srows[ROWS];
    for (int r = 0; r < ROWS; r++) { size_t o = min(row0 + r, out_dim - 1); rows[r] = (const uint4*)(w + o * in_dim); srows[r] = scales + o * groups; }
    float acc[ROWS];
    for (int r = 0; r < ROWS; r++) acc[r] = 0.f;
    int chunks = in_dim / 16;
    for (int i = threadIdx.x; i < chunks; i += THREADS) {
        uint4 q[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; r++) q[r] = __ldcs(rows[r] + i);
        float xv[16];
        load_x16(x, i, xv);
#pragma unroll
        for (int r = 0; r < ROWS; r++) acc[r] += chunk_sum<HW>(q[r], xv) * srows[r][i * 16 / 128];
    }
    __shared__ float part[THREADS / 32][ROWS];
    int lane = threadIdx.x & 31, wp = threadIdx.x >> 5;
    for (int r = 0; r < ROWS; r++) { float v = warp_sum(acc[r]); if (lane == 0) part[wp][r] = v; }
    __syncthreads();
    if (threadIdx.x < ROWS && row0 + threadIdx.x < out_dim) {
        float s = 0; for (int k = 0; k < THREADS / 32; k++) s += part[k][threadIdx.x];
        y[row0 + threadIdx.x] = s;
    }
}

// Warp-per-rows variant: each warp owns R rows, lanes stride 16-byte chunks, U chunks per row in flight.
template <int R, int U, bool HW>
__global__ void __launch_bounds__(128) fp8_warp(const unsigned char* __restrict__ w, const float* __restrict__ scales,
                                                const float* __restrict__ x, float* y, int out_dim, int in_dim) {
    int lane = threadIdx.x & 31, wp = threadIdx.x >> 5;
    int row0 = (blockIdx.x * 4 + wp) * R;
    if (row0 >= out_dim) return;
    int groups = in_dim / 128;
    const uint4* rows[R]; const float* srows[R];
    for (int r = 0; r < R; r++) { size_t o = min(row0 + r, out_dim - 1); rows[r] = (const uint4*)(w + o * in_dim); srows[r] = scales + o * groups; }
    float acc[R];
    for (int r = 0; r < R; r++) acc[r] = 0.f;
    int chunks = in_dim / 16;
    for (int base = 0; base < chunks; base += 32 * U) {
        uint4 q[U][R];
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int r = 0; r < R; r++) { int i = base + u * 32 + lane; q[u][r] = i < chunks ? __ldcs(rows[r] + i) : make_uint4(0,0,0,0); }
#pragma unroll
        for (int u = 0; u < U; u++) {
            int i = base + u * 32 + lane;
            if (i >= chunks) continue;
            float xv[16];
            load_x16(x, i, xv);
#pragma unroll
            for (int r = 0; r < R; r++) acc[r] += chunk_sum<HW>(q[u][r], xv) * srows[r][i * 16 / 128];
        }
    }
    for (int r = 0; r < R; r++) { float v = warp_sum(acc[r]); if (lane == 0 && row0 + r < out_dim) y[row0 + r] = v; }
}


// f64 reference for checking.
__global__ void fp8_ref(const unsigned char* w, const float* scales, const float* x, float* y, int out_dim, int in_dim) {
    int o = blockIdx.x * blockDim.x + threadIdx.x;
    if (o >= out_dim) return;
    double s = 0;
    for (int c = 0; c < in_dim; c++) {
        unsigned short v = w[(size_t)o * in_dim + c];
        unsigned r = e4m3x2_to_f16x2(v);
        float f = __half2float(*reinterpret_cast<__half*>(&r));
        s += (double)f * scales[(size_t)o * (in_dim / 128) + c / 128] * x[c];
    }
    y[o] = (float)s;
}

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("err %s line %d\n", cudaGetErrorString(e), __LINE__); exit(1); } } while (0)

struct Shape { int o, i; };
int main() {
    const int L = 36;
    Shape shapes[4] = {{6144, 4096}, {4096, 4096}, {24576, 4096}, {4096, 12288}};
    std::vector<unsigned char*> w8; std::vector<float*> sc; std::vector<__nv_bfloat16*> wb;
    size_t bytes8 = 0, bytesb = 0;
    for (int l = 0; l < L; l++) for (auto s : shapes) {
        size_t n = (size_t)s.o * s.i; unsigned char* p; float* q; __nv_bfloat16* b;
        CK(cudaMalloc(&p, n)); CK(cudaMemset(p, 0x35, n)); w8.push_back(p);
        CK(cudaMalloc(&q, (size_t)s.o * (s.i / 128) * 4)); CK(cudaMemset(q, 0, (size_t)s.o * (s.i / 128) * 4)); sc.push_back(q);
        CK(cudaMalloc(&b, n * 2)); CK(cudaMemset(b, 0x3c, n * 2)); wb.push_back(b);
        bytes8 += n; bytesb += 2 * n;
    }
    float *x, *y; CK(cudaMalloc(&x, 12288 * 4)); CK(cudaMemset(x, 0, 12288 * 4)); CK(cudaMalloc(&y, 24576 * 4));

    {   // correctness of the variants on random data
        int O = 4096, I = 12288; size_t n = (size_t)O * I;
        std::vector<unsigned char> hw(n); std::vector<float> hs(O * (I / 128)), hx(I);
        unsigned s = 1; auto rnd = [&]() { s = s * 1664525u + 1013904223u; return s >> 8; };
        for (auto& b : hw) { b = rnd() & 0xff; if ((b & 0x7f) == 0x7f) b = 0x7e; }
        for (auto& v : hs) v = (rnd() % 1000 + 1) * 1e-5f;
        for (auto& v : hx) v = ((int)(rnd() % 20001) - 10000) * 1e-3f;
        unsigned char* dw; float *ds, *dx, *dy, *dr;
        CK(cudaMalloc(&dw, n)); CK(cudaMalloc(&ds, hs.size() * 4)); CK(cudaMalloc(&dx, I * 4)); CK(cudaMalloc(&dy, O * 4)); CK(cudaMalloc(&dr, O * 4));
        cudaMemcpy(dw, hw.data(), n, cudaMemcpyHostToDevice); cudaMemcpy(ds, hs.data(), hs.size() * 4, cudaMemcpyHostToDevice); cudaMemcpy(dx, hx.data(), I * 4, cudaMemcpyHostToDevice);
        fp8_ref<<<O / 128, 128>>>(dw, ds, dx, dr, O, I);
        std::vector<float> r(O), yv(O);
        cudaMemcpy(r.data(), dr, O * 4, cudaMemcpyDeviceToHost);
        auto cmp = [&](const char* name) { cudaMemcpy(yv.data(), dy, O * 4, cudaMemcpyDeviceToHost); double m = 0, rm = 0; for (int o = 0; o < O; o++) { m = fmax(m, fabs(yv[o] - r[o])); rm = fmax(rm, fabs(r[o])); } printf("check %-20s max|d| %.3e of max|y| %.3e\n", name, m, rm); };
        gemv_fp8_r4a1<<<O / 4, 256>>>(dw, ds, dx, nullptr, dy, O, I, 128, 1); cmp("gemv_fp8_r4a1");
        fp8_block<16, 128, true><<<O / 16, 128>>>(dw, ds, dx, dy, O, I); cmp("block r16");
        cudaFuncSetAttribute(gemv_fp8_mma_a1, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024);
        cudaFuncSetAttribute(gemv_fp8_mma_a4, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024);
        gemv_fp8_mma_a1<<<O / 16, 256, (I + 8) * 4>>>(dw, ds, dx, nullptr, dy, O, I, 128, 1); CK(cudaGetLastError()); cmp("gemv_fp8_mma_a1");
        gemv_fp8_mma_a4<<<O / 16, 256, (I + 8) * 16>>>(dw, ds, dx, nullptr, dy, O, I, 128, 1); CK(cudaGetLastError()); cmp("gemv_fp8_mma_a4, 1 row");
        for (auto& v : hx) v *= 10000.f;
        cudaMemcpy(dx, hx.data(), I * 4, cudaMemcpyHostToDevice);
        fp8_ref<<<O / 128, 128>>>(dw, ds, dx, dr, O, I); cudaMemcpy(r.data(), dr, O * 4, cudaMemcpyDeviceToHost);
        gemv_fp8_mma_a1<<<O / 16, 256, (I + 8) * 4>>>(dw, ds, dx, nullptr, dy, O, I, 128, 1); CK(cudaGetLastError()); cmp("gemv_fp8_mma_a1, |x| to 1e5");
        gemv_fp8_r4a1<<<O / 4, 256>>>(dw, ds, dx, nullptr, dy, O, I, 128, 1); cmp("gemv_fp8_r4a1, |x| to 1e5");
    }
    cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
    auto timeit = [&](const char* name, auto launch, size_t bytes) {
        for (int rep = 0; rep < 2; rep++) for (int l = 0; l < L; l++) for (int s = 0; s < 4; s++) launch(l * 4 + s, shapes[s]);
        CK(cudaDeviceSynchronize());
        float best = 1e9;
        for (int rep = 0; rep < 5; rep++) {
            cudaEventRecord(a);
            for (int l = 0; l < L; l++) for (int s = 0; s < 4; s++) launch(l * 4 + s, shapes[s]);
            cudaEventRecord(b); CK(cudaEventSynchronize(b));
            float ms; cudaEventElapsedTime(&ms, a, b); if (ms < best) best = ms;
        }
        // per-shape times
        float per[4];
        for (int s = 0; s < 4; s++) {
            cudaEventRecord(a);
            for (int l = 0; l < L; l++) launch(l * 4 + s, shapes[s]);
            cudaEventRecord(b); CK(cudaEventSynchronize(b));
            cudaEventElapsedTime(&per[s], a, b);
        }
        double bs[4]; for (int s = 0; s < 4; s++) bs[s] = (double)shapes[s].o * shapes[s].i * L * (bytes == bytesb ? 2 : 1);
        printf("%-28s all %.3f ms %.0f GB/s | qkv %.0f o %.0f gu %.0f down %.0f GB/s\n", name, best, bytes / best / 1e6,
               bs[0] / per[0] / 1e6, bs[1] / per[1] / 1e6, bs[2] / per[2] / 1e6, bs[3] / per[3] / 1e6);
    };
    timeit("bf16 r4 t256", [&](int k, Shape s) { gemv_bf16_r4<<<(s.o + 3) / 4, 256>>>(wb[k], x, y, s.o, s.i); }, bytesb);
    timeit("fp8 gemv_fp8_r4a1 t256", [&](int k, Shape s) { gemv_fp8_r4a1<<<(s.o + 3) / 4, 256>>>(w8[k], sc[k], x, nullptr, y, s.o, s.i, 128, 1); }, bytes8);
    timeit("fp8 gemv_fp8_r4a1 t128", [&](int k, Shape s) { gemv_fp8_r4a1<<<(s.o + 3) / 4, 128>>>(w8[k], sc[k], x, nullptr, y, s.o, s.i, 128, 1); }, bytes8);
    timeit("fp8 gemv_fp8 r8a1 t256", [&](int k, Shape s) { gemv_fp8_r8a1<<<(s.o + 7) / 8, 256>>>(w8[k], sc[k], x, nullptr, y, s.o, s.i, 128, 1); }, bytes8);
    timeit("fp8 gemv_fp8 r16a1 t128", [&](int k, Shape s) { gemv_fp8_r16a1<<<(s.o + 15) / 16, 128>>>(w8[k], sc[k], x, nullptr, y, s.o, s.i, 128, 1); }, bytes8);
#define B(R, T, HW) timeit("fp8 block r" #R " t" #T " hw" #HW, [&](int k, Shape s) { fp8_block<R, T, HW><<<(s.o + R - 1) / R, T>>>(w8[k], sc[k], x, y, s.o, s.i); }, bytes8);
    B(4, 256, false) B(4, 256, true) B(8, 256, true) B(4, 128, true) B(16, 128, true)
#define W(R, U, HW) timeit("fp8 warp r" #R " u" #U " hw" #HW, [&](int k, Shape s) { int rows = 4 * R; fp8_warp<R, U, HW><<<(s.o + rows - 1) / rows, 128>>>(w8[k], sc[k], x, y, s.o, s.i); }, bytes8);
    W(2, 2, true) W(4, 2, true)

    cudaFuncSetAttribute(gemv_fp8_mma_swiglu_a1, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024);
    timeit("fp8 gemv_fp8_mma_a1, gate|up swiglu", [&](int k, Shape s) {
        if (s.o == 24576) gemv_fp8_mma_swiglu_a1<<<s.o / 2 / 8, 256, (s.i + 8) * 4>>>(w8[k], sc[k], x, nullptr, y, s.o / 2, s.i, 128, 1);
        else gemv_fp8_mma_a1<<<(s.o + 15) / 16, 256, (s.i + 8) * 4>>>(w8[k], sc[k], x, nullptr, y, s.o, s.i, 128, 1); }, bytes8);
    timeit("fp8 gemv_fp8_mma_a1", [&](int k, Shape s) { gemv_fp8_mma_a1<<<(s.o + 15) / 16, 256, (s.i + 8) * 4>>>(w8[k], sc[k], x, nullptr, y, s.o, s.i, 128, 1); }, bytes8);
    return 0;
}
