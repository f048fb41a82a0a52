// The int4 GEMV of kernels/gemv_q4_rows.cl (included whole: the same product, parameters and shape contract)
// followed by a tail that the last of its row sets to finish runs over the whole output, so a decode step needs no
// launch between this GEMV and the next one:
//
//   TAIL 1 (the residual add and the next RMSNorm, for the o and down projections, N = hidden):
//       p = W·x (+ bias), the launch's output y;
//       POST 0:  h = r + p                                      written back into r (the residual stream)
//       POST 1:  h = r + p / sqrt(mean(p²) + eps) · γ_post      (Gemma's sandwich norms)
//       n = h / sqrt(mean(h²) + eps) · γ                        into xn, the next GEMV's input
//       Q8X 1 or 2: n also as Q8_1 blocks (kernels/q8_1.h, in that order) for a next GEMV reading int8 x
//   TAIL 2 (the quantizing of the down projection's input, for gate-up): y itself as Q8_1 blocks in the order
//       Q8X (1: the rows GEMV's texel order), so down launches no quantizing of its own.
//
// The hand-off: every row set stores its outputs and counts itself on a counter in global memory; the row set that
// takes it to the launch's last resets the counter for the next launch, reads y back and runs the tail on one
// work-item (rows.cl lets only the first lane of a row set reach its store where LANES > 1; with one lane, a norm
// shared over the work-group costs its reductions' barriers, more than the 2N plain loads it would spread, on
// both CPU runtimes: benchmarks/NOTES.md).
// HANDOFF says how the outputs cross work-groups: 0, OpenCL C 1.2's way (kernels/attention_decode.cl's), each
// output an atomic store and an atomic load (1.2 orders nothing but the atomics, all locked); 1, relaxed atomic
// stores and loads (no lock) ordered by the counter's acquire-release increment at device scope (OpenCL C 2.0, or 3.0 with the features
// __opencl_c_atomic_order_acq_rel and __opencl_c_atomic_scope_device). The caller asks for 1 where the device's
// compiler takes OpenCL C 2.0 or later (and builds with that -cl-std); a compiler that lacks the features builds 0.
// ARRIVAL (tuned) says who counts: 0, every row set (LANES > 1: the lane that stores; LANES 1: every work-item,
// no barrier); 1, with one lane a row set, each work-group once, after a barrier (one atomic a group, for a runtime
// whose barrier is cheap, such as Intel's CPU runtime running a work-group as one SIMD thread; where barriers cost
// more than atomics, 0). With ARRIVAL 1 the last group's work-items share TAIL 2's quantizing.
// TAIL 2 needs no hand-off where a work-group's outputs are whole blocks (LANES 1, ROWS·WGR a multiple of 32):
// each group quantizes its own after a barrier, and the counter is left alone.
//
// Shape contract: rows.cl's, one launch per product (not READ 1's image2d row blocks, which the wrapper splits
// into several launches); TAIL 1: N = the hidden size, no gate-up epilogue; Q8X: the output's length a multiple
// of 32. counter: one int, zero before the first launch (zeroed at allocation), left zero by each launch.
//
// How the product is reused unchanged: this file includes gemv_q4.h before rows.cl does (the header's guard
// then skips rows.cl's include), adds the tail's arguments to the kernel's (GEMV_Q4_ARGS) and turns the final
// store_outputs call into tail_store. The product's parameters have rows.cl's defaults, set here where the
// header reads them at its inclusion.

#ifndef TAIL
#define TAIL 1        // 1: residual add and RMSNorm of the output row; 2: the output as Q8_1 blocks (the caller's)
#endif
#ifndef POST
#define POST 0        // TAIL 1: the output through its own RMSNorm before the residual add (the caller's)
#endif
#ifndef Q8X
#define Q8X 0         // the Q8_1 blocks' order (kernels/q8_1.h), 0 for none (the caller's, not tuned)
#endif
#ifndef HANDOFF
#define HANDOFF 0     // outputs across work-groups: 0 atomics, 1 ordered by the counter (the caller's, not tuned)
#endif
#ifndef ARRIVAL
#define ARRIVAL 0     // who counts on the counter: 0 every row set, 1 (LANES 1) every work-group once
#endif

// The product's parameters (kernels/gemv_q4_rows.cl's, with its defaults)
#ifndef LANES
#define LANES 16     // work-items along K per work-group
#endif
#ifndef ROWS
#define ROWS 4       // outputs per work-item
#endif
#ifndef WGR
#define WGR 1        // row sets per work-group
#endif
#ifndef READ
#define READ 0       // 0: uint4 buffer, 2: image1d_buffer view (not 1: image2d row blocks)
#endif
#ifndef SG
#define SG 0         // lanes reduced in local memory (0) or by sub_group_reduce_add (1)
#endif
#ifndef HALF
#define HALF 0       // fp16 dequantize-and-multiply within a group
#endif
#ifndef I8
#define I8 0         // int8 activations: int16 pairs (1) or byte dot products (2)
#endif
#ifndef SUBGROUP
#define SUBGROUP 0   // required subgroup size (0: the driver's)
#endif
#ifndef GROUP
#define GROUP 128
#endif
#ifndef EPILOGUE
#define EPILOGUE EPI_NONE
#endif

#define LAYOUT 0
#define ROW_STRIDE 1
#define USES_SUBGROUPS (SG == 1)
#include "gpu.h"
#include "gemv_q4.h"
#include "q8_1.h"

#if TAIL == 1 && EPI_GATED
#error "the norm tail (TAIL 1) follows a plain product: no gate-up epilogue"
#endif
#if READ == 1
#error "the tail counts the row sets of one launch: not READ 1 (image2d row blocks, split into launches)"
#endif
#if ARRIVAL == 1 && LANES > 1
#error "a work-group's one arrival (ARRIVAL 1) needs all its work-items alive: one lane a row set (LANES 1)"
#endif
// Where each work-group's outputs are whole Q8_1 blocks, TAIL 2 quantizes them in the group: no hand-off.
#define OWN_BLOCKS (TAIL == 2 && LANES == 1 && (ROWS * WGR) % 32 == 0)

// HANDOFF 1 where this compiler has the acquire-release order and the device scope, else 0.
#if HANDOFF == 1 && !(defined(__OPENCL_C_VERSION__) && __OPENCL_C_VERSION__ >= 200 &&                        \
                      (__OPENCL_C_VERSION__ < 300 || (defined(__opencl_c_atomic_order_acq_rel) &&            \
                                                      defined(__opencl_c_atomic_scope_device))))
#undef HANDOFF
#define HANDOFF 0
#endif

#if HANDOFF == 1
// Each output a relaxed atomic store and load (plain moves on a CPU), ordered by the counter's increment: C11's
// message passing. Not plain or volatile accesses: Intel's CPU compiler miscompiles the one work-item's loop over
// those loads inside its 16-wide kernel with 4-bit zeros (a wrong y with plain ones; with volatile ones a store
// through a corrupted address, a segmentation fault, at Gemma 3's tiny o projection: N = 64, K = 128, G = 32, the
// defaults), where Oclgrind finds every access in bounds; with relaxed atomics each set whose plain product it
// computes right runs right (benchmarks/NOTES.md).
#define SHARED_STORE(p, i, v) atomic_store_explicit((volatile __global atomic_float*)(p) + (i), (v),             \
                                                    memory_order_relaxed, memory_scope_device)
#define SHARED_LOAD(p, i) atomic_load_explicit((volatile __global atomic_float*)(p) + (i), memory_order_relaxed, \
                                               memory_scope_device)
// The arrival: a release of this work-item's stores (and, after a device-scope barrier, its group's) that the
// last arrival's increment acquires, the counter's increments forming one release sequence.
#define ARRIVE(counter) atomic_fetch_add_explicit((volatile __global atomic_int*)(counter), 1,              \
                                                  memory_order_acq_rel, memory_scope_device)
#define RESET(counter) atomic_store_explicit((volatile __global atomic_int*)(counter), 0, memory_order_relaxed, \
                                             memory_scope_device)
#define GROUP_SYNC() work_group_barrier(CLK_GLOBAL_MEM_FENCE | CLK_LOCAL_MEM_FENCE, memory_scope_device)
#else
#define SHARED_STORE(p, i, v) atomic_xchg((volatile __global float*)(p) + (i), (v))
#define SHARED_LOAD(p, i) as_float(atomic_or((volatile __global int*)(p) + (i), 0))
#define ARRIVE(counter) atomic_inc(counter)
#define RESET(counter) atomic_xchg(counter, 0)
#define GROUP_SYNC() barrier(CLK_GLOBAL_MEM_FENCE | CLK_LOCAL_MEM_FENCE)
#endif

// Block `at` of the floats at src (a private copy of block b) into codes and step_sum, in the order
// Q8X.
#if Q8X == Q8_1_NATURAL
#define TAIL_CODES(R, dst) Q8_1_STORE_NATURAL(R, dst)
#else
#define TAIL_CODES(R, dst) Q8_1_STORE(R, dst)
#endif
#define TAIL_STORE_BLOCK(src, at, b, codes, step_sum)                                                        \
    {                                                                                                        \
        Q8_1_BLOCK(src, at, tv_, tstep_, tsum_)                                                              \
        TAIL_CODES(tv_, (codes) + 32 * (b))                                                                  \
        (step_sum)[(b)] = (float2)(tstep_, tsum_);                                                           \
    }

#if TAIL == 1
// The residual add and the norm of the n outputs of y, by one work-item, after every row set has stored.
inline void tail_norm(const int n, __global float* restrict y, __global float* restrict r,
                      __global const float* restrict gamma, __global const float* restrict post_gamma,
                      const float eps, __global float* restrict xn, __global char* restrict xq,
                      __global float2* restrict x_step_sum)
{
    float total = 0.0f;
#if POST
    for (int i = 0; i < n; ++i) {
        const float p = SHARED_LOAD(y, i);
        total += p * p;
    }
    const float inv_p = 1.0f / sqrt(total / (float)n + eps);
    total = 0.0f;
    for (int i = 0; i < n; ++i) {
        const float h = r[i] + SHARED_LOAD(y, i) * inv_p * post_gamma[i];
        r[i] = h;
        total += h * h;
    }
#else
    for (int i = 0; i < n; ++i) {
        const float h = r[i] + SHARED_LOAD(y, i);
        r[i] = h;
        total += h * h;
    }
#endif
    const float inv = 1.0f / sqrt(total / (float)n + eps);
#if Q8X
    // each block of xn also kept in private memory and quantized from there (Intel's CPU compiler has crashed
    // building the quantizing from xn's global copy here)
    for (int b = 0; b < n / 32; ++b) {
        float block[32];
        for (int i = 0; i < 32; ++i) {
            block[i] = r[32 * b + i] * inv * gamma[32 * b + i];
            xn[32 * b + i] = block[i];
        }
        TAIL_STORE_BLOCK(block, 0, b, xq, x_step_sum)
    }
#else
    for (int i = 0; i < n; ++i) xn[i] = r[i] * inv * gamma[i];
#endif
}
#endif

#if TAIL == 2
// y's n outputs as Q8_1 blocks, block `first` and every `step`-th after it: each block read back into private
// memory (Intel's CPU compiler has crashed building the quantizing from y's global copy on one work-item).
inline void tail_quantize(const int n, __global float* restrict y, __global char* restrict xq,
                          __global float2* restrict x_step_sum, const int first, const int step)
{
    for (int b = first; b < n / 32; b += step) {
        float block[32];
        for (int i = 0; i < 32; ++i) block[i] = SHARED_LOAD(y, 32 * b + i);
        TAIL_STORE_BLOCK(block, 0, b, xq, x_step_sum)
    }
}
#endif

// The tail's arguments, after the product's own (the same list for both tails: what a tail does not read, the
// wrapper binds to a placeholder).
#define TAIL_ARGS                                                                                            \
    , __global volatile int* restrict counter, __global float* restrict residual,                          \
    __global const float* restrict gamma, __global const float* restrict post_gamma, const float eps,        \
    __global float* restrict xn,                                                                             \
    __global char* restrict tail_xq, __global float2* restrict tail_steps, __local int* restrict tail_last
#define TAIL_NAMES counter, residual, gamma, post_gamma, eps, xn, tail_xq, tail_steps, tail_last

// rows.cl's store (bias, then the epilogue), each output a store the tail can read; then the arrival counted, and
// the last arrival's tail (or, OWN_BLOCKS, each work-group's own blocks).
inline void tail_store(const float* acc, const int* grow, const int first, const int n_out, const int out_base,
                       __global const float* restrict bias, const int has_bias, __global float* restrict y
                       TAIL_ARGS)
{
    #pragma unroll
    for (int r_ = 0; r_ < ROWS; ++r_) {
        const int o = first + r_ * ROW_STRIDE;
        if (o >= n_out) break;
        float v = acc[r_] + (has_bias ? bias[grow[r_]] : 0.0f);
#if EPI_GATED
        const float up = acc[ROWS + r_] + (has_bias ? bias[grow[ROWS + r_]] : 0.0f);
        v = GATE_ACT(v) * up;
#endif
#if OWN_BLOCKS
        y[out_base + o] = v;   // read back by this work-group alone
#else
        SHARED_STORE(y, out_base + o, v);
#endif
    }
#if OWN_BLOCKS
    // The group's ROWS·WGR outputs (whole blocks; the last group's may stop at n_out, a multiple of 32), each block
    // by one of its work-items after Q8_1_QUANTIZE's barrier.
    const int start = get_group_id(0) * (ROWS * WGR);
    Q8_1_QUANTIZE(y, (out_base + start) / 32, min(ROWS * WGR, n_out - start) / 32, get_local_id(0), WGR, tail_xq,
                  tail_steps, Q8X)
#else
#if HANDOFF == 0
    mem_fence(CLK_GLOBAL_MEM_FENCE);   // the stores before the arrival is counted
#endif
#if ARRIVAL == 1
    // The work-group counts its arrival once, after a barrier that orders its work-items' stores before the count.
    // ``last`` is the same for the whole group, so each barrier is met by every work-item of the group or by none.
    GROUP_SYNC();
    if (get_local_id(0) == 0) tail_last[0] = ARRIVE(counter) == (int)get_num_groups(0) - 1;
    GROUP_SYNC();   // HANDOFF 1: the last increment's acquire, passed on to the group
    if (!tail_last[0]) return;
#if TAIL == 1
    if (get_local_id(0) != 0) return;
    RESET(counter);   // no other group touches it again in this launch
    tail_norm(n_out, y, residual, gamma, post_gamma, eps, xn, tail_xq, tail_steps);
#else
    if (get_local_id(0) == 0) RESET(counter);
    tail_quantize(n_out, y, tail_xq, tail_steps, get_local_id(0), get_local_size(0));
#endif
#else
    const int row_sets = get_global_size(0) / LANES;
    if (ARRIVE(counter) != row_sets - 1) return;
    RESET(counter);   // the last arrival: no other row set touches it again in this launch
#if TAIL == 1
    tail_norm(n_out, y, residual, gamma, post_gamma, eps, xn, tail_xq, tail_steps);
#else
    tail_quantize(n_out, y, tail_xq, tail_steps, 0, 1);
#endif
#endif
#endif
}

#undef GEMV_Q4_ARGS
#define GEMV_Q4_ARGS                                                                                        \
    const int n_out, const int k, const int out_base, const int half_rows, const int row_a, const int row_b, \
    const int n_rows, CODES_T wa, CODES_T wb, __global const half* restrict scale_offset,                    \
    __global const float* restrict bias, const int has_bias, __global const float* restrict x,               \
    __global float* restrict y TAIL_ARGS
#define store_outputs(acc, grow, first, n_out, out_base, bias, has_bias, y) \
    tail_store(acc, grow, first, n_out, out_base, bias, has_bias, y, TAIL_NAMES)

#include "gemv_q4_rows.cl"
