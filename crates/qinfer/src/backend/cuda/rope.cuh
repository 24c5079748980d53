// RoPE's rotation of one pair of a head, shared by the rope kernel
// (norm_rope.cu) and the q|k|v prologues (attention.cu).
#pragma once

// The rotation of pair i at position pos (angle in f32 as the reference
// computes it, cos/sin in double so large positions keep their precision).
__device__ __forceinline__ float2 rope_angle(int pos, float inv_freq) {
    float angle = (float)pos * inv_freq;
    return make_float2((float)cos((double)angle), (float)sin((double)angle));
}

// Pair i rotated by the angle's (cos, sin).
__device__ __forceinline__ void rotate_pair(float* head, int i, float2 cs, int half, int style) {
    int ia = style == 0 ? i : 2 * i, ib = style == 0 ? i + half : 2 * i + 1;
    float a = head[ia], b = head[ib];
    head[ia] = a * cs.x - b * cs.y;
    head[ib] = b * cs.x + a * cs.y;
}

__device__ __forceinline__ void rope_pair(float* head, int i, int pos, float inv_freq, int half, int style) {
    rotate_pair(head, i, rope_angle(pos, inv_freq), half, style);
}
