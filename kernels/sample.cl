// Sampling the next token on the device: the distribution of perfx.reference.sampling_probs (the host
// sampler's) over the repetition-penalised logits, drawn by inverse CDF with a counter-based uniform.
//
// Maths (float64 in perfx/reference.py, fp32 here):
//   l'_i = l_i / r if l_i > 0 else l_i · r for each distinct id i among the history's h ids, else l_i (r: the
//          repetition penalty; CTRL / Hugging Face);
//   y_i  = l'_i / T, p_i = exp(y_i − max y) / Σ_j exp(y_j − max y) over all V tokens (T: the temperature);
//   order: p descending, ties to the lower index; keep the first min(top_k, V) of the order, the first
//          c = (the first rank whose cumulative p reaches top_p) + 1, and those with p_i ≥ min_p · max p;
//   u    = the top 24 bits of word 0 of Philox-4x32-10(key = (seed_lo, seed_hi), counter = (counter_lo,
//          counter_hi, positions[pos_index], 0)) times 2⁻²⁴, in [0, 1), exact in fp32 and float64;
//   the token: the first kept token in the order whose cumulative kept weight exceeds u · (the kept total).
//   T = 0: the first token of the order (numpy.argmax of the penalised logits).
//   Logits of −∞ (tokens a grammar forbids, kernels/logit_mask.cl) have p = 0 and are never kept.
//
// Shape contract: logits (V floats), history (h ≤ 256 int32 ids, in any order, duplicates counted once, ids
// outside [0, V) ignored), 1 ≤ top_k ≤ TOPK, or top_k ≥ V where V ≤ TOPK (no top-k cut). out: 1 int32.
//
// sample_partial: GROUPS work-groups of TOPK work-items; group g scans the contiguous chunk
//   [g·C, min((g + 1)·C, V)), C = ceil(V / GROUPS), each work-item every TOPK-th logit. Each logit is
//   penalised when its id is in the history (a hash set of the history's ids in local memory, built by each
//   group: each distinct id once), then kept as a 64-bit key that orders like the host's order (the value's
//   bits made monotonic above, the index inverted below, so the lower index wins a tie). A first scan keeps
//   each work-item's 4 best keys, whose TOPK-th best (tau) bounds the group's TOPK-th best from below; a
//   second gathers the keys ≥ tau into local memory and one bitonic sort of 4·TOPK ranks them. Where more
//   than 4·TOPK keys reach tau (a few work-items' shares holding most of the best), a third scan offers tiles of
//   TOPK keys to the TOPK kept (``offer``: a sort each TOPK keys that beat the kept ones), exact whatever the
//   logits. A chunk of at most 4·TOPK logits (a small V) is sorted whole; a group past the end of V keeps none.
//   The scans share one sort, called in a loop (``sort_first`` says why).
//   Each work-item also keeps an online softmax (max, Σ exp) of its y, reduced over the group.
//   Writes the group's TOPK keys (sorted) and its (max, sum).
// sample_final: one work-group of TOPK work-items merges the groups' keys, offering each group's sorted TOPK
//   whose best beats the kept TOPK-th, and the GROUPS (max, sum) pairs, then one work-item applies top-k,
//   top-p, min-p to the TOPK best and draws.
// Launch: global = GROUPS · TOPK then TOPK, local = TOPK.

#ifndef TOPK
#define TOPK 64  // candidates kept per work-group (the largest top_k the device serves), a power of two
#endif
#ifndef GROUPS
#define GROUPS 64  // work-groups of the first pass
#endif

#define HISTORY_MAX 256   // the host sampler's window (history[-256:])
#define HASH_SLOTS 512    // the history's hash set: at most half full
#define FILTER_BITS 8192  // a bit per hash of 13 bits ahead of the set: a logit not in the history (all but
                          // at most 256) is told by one bit, wrongly sent on to the set at most 1/32 of the time
#define EMPTY_KEY 0UL     // below every real key (an index of 2³² − 1 never occurs)

// sample_partial's scans, each ending in the sort
#define SCAN_WHOLE 0      // a chunk of at most 4·TOPK logits: all of them
#define SCAN_BOUND 1      // each work-item's four best: tau
#define SCAN_GATHER 2     // every key at or above tau
#define SCAN_TILES 3      // tiles offered to the kept TOPK, a sort each TOPK keys that beat them

inline uint monotonic(float v)
{
    const uint bits = as_uint(v);
    return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

inline float from_monotonic(uint m)
{
    return as_float((m & 0x80000000u) ? (m & 0x7fffffffu) : ~m);
}

inline ulong make_key(float v, int i)
{
    return ((ulong)monotonic(v) << 32) | (ulong)(~(uint)i);
}

inline int key_index(ulong key)
{
    return (int)(~(uint)key);
}

inline float key_value(ulong key)
{
    return from_monotonic((uint)(key >> 32));
}

inline uint hash_slot(int id)
{
    return ((uint)id * 2654435761u) >> 23;   // 9 bits: HASH_SLOTS = 512
}

inline uint filter_bit(int id)
{
    return ((uint)id * 2246822519u) >> 19;   // 13 bits: FILTER_BITS = 8192
}

// The history's distinct ids in [0, V) into a local hash set (open addressing, linear probing), and a bit
// filter (set[HASH_SLOTS ..], FILTER_BITS / 32 words) ahead of it. With h = 0 only its two barriers: every
// work-group reaches them, penalised or not (a barrier under a condition makes PoCL compile the rest of the
// kernel once for each side).
inline void build_history(__local int* set, __global const int* restrict history, const int h, const int v)
{
    const int lid = get_local_id(0);
    for (int s = lid; h > 0 && s < HASH_SLOTS + FILTER_BITS / 32; s += TOPK) {
        set[s] = s < HASH_SLOTS ? -1 : 0;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int j = lid; j < h; j += TOPK) {
        const int id = history[j];
        if (id < 0 || id >= v) {
            continue;
        }
        const uint bit = filter_bit(id);
        atomic_or((volatile __local int*)&set[HASH_SLOTS + (bit >> 5)], (int)(1u << (bit & 31)));
        uint slot = hash_slot(id);
        for (;;) {
            const int old = atomic_cmpxchg((volatile __local int*)&set[slot], -1, id);
            if (old == -1 || old == id) {
                break;
            }
            slot = (slot + 1) & (HASH_SLOTS - 1);
        }
    }
    barrier(CLK_LOCAL_MEM_FENCE);
}

inline bool in_history(__local const int* set, const int id)
{
    const uint bit = filter_bit(id);
    if (!(((uint)set[HASH_SLOTS + (bit >> 5)] >> (bit & 31)) & 1u)) {
        return false;
    }
    uint slot = hash_slot(id);
    for (;;) {
        const int held = set[slot];
        if (held == id) {
            return true;
        }
        if (held == -1) {
            return false;
        }
        slot = (slot + 1) & (HASH_SLOTS - 1);
    }
}

// Logit i, penalised when i is in the history's set.
inline float penalised_logit(__global const float* restrict logits, __local const int* set, const bool penalised,
                             const float penalty, const int i)
{
    const float x = logits[i];
    if (penalised && in_history(set, i)) {
        return x > 0.0f ? x / penalty : x * penalty;
    }
    return x;
}

// Sort keys[0 .. n) descending, n a power of two up to 4·TOPK (1: nothing to sort, only the closing barrier): a
// bitonic network, TOPK work-items each doing up to two compare-exchanges a stage. Each kernel calls it at one
// place, after a barrier every work-item reaches, and nothing but its own barriers lies between: PoCL cuts a
// kernel into regions at its barriers and copies the code after a barrier wherever paths from elsewhere join it,
// so a sort inlined at several places, or reached by paths through other barriers, is compiled again for each
// (benchmarks/NOTES.md).
inline void sort_first(__local ulong* keys, const uint n)
{
    const uint lid = get_local_id(0);
    for (uint size = 2; size <= n; size <<= 1) {
        for (uint stride = size >> 1; stride > 0; stride >>= 1) {
            barrier(CLK_LOCAL_MEM_FENCE);
            for (uint pair = lid; pair < n / 2; pair += TOPK) {
                const uint lo = 2 * pair - (pair & (stride - 1));
                const uint hi = lo + stride;
                const ulong a = keys[lo], b = keys[hi];
                if ((lo & size) == 0 ? a < b : a > b) {
                    keys[lo] = b;
                    keys[hi] = a;
                }
            }
        }
    }
    barrier(CLK_LOCAL_MEM_FENCE);
}

// Offers. keys[0 .. TOPK): the kept keys, sorted descending; keys[TOPK ..): the keys offered since the last
// sort, at TOPK + (*fill, the count of offers, − its value at that sort). A key at or below the kept TOPK-th can
// never be among the best, and is not offered; the others wait, sorted in (a sort of all 4·TOPK) once TOPK or
// more wait. A pass offers up to two tiles (or groups) of TOPK before it reads the count: fewer than TOPK waited
// before it, so they stay within keys[TOPK .. 4·TOPK). The slots are not emptied after a sort: what a sort leaves
// past the kept TOPK lies below them, and as every later sort keeps TOPK keys at or above those, never comes
// back. A pass after which fewer than TOPK wait sorts 1 key: nothing.
inline void offer(__local ulong* keys, volatile __local int* fill, const int at_sort, const ulong key)
{
    if (key > keys[TOPK - 1]) {
        keys[TOPK + atomic_inc(fill) - at_sort] = key;
    }
}

inline uint offers_sort_width(const int waiting, const bool last)
{
    return waiting >= TOPK || (last && waiting > 0) ? 4 * TOPK : 1;
}

inline void softmax_add(float* m, float* s, const float y)
{
    if (y == -INFINITY) {
        return;
    }
    if (y > *m) {
        *s = *s * exp(*m - y) + 1.0f;
        *m = y;
    } else {
        *s += exp(y - *m);
    }
}

inline void softmax_merge(float* m, float* s, const float m2, const float s2)
{
    if (s2 == 0.0f) {
        return;
    }
    if (*s == 0.0f) {
        *m = m2;
        *s = s2;
        return;
    }
    const float top = fmax(*m, m2);
    *s = *s * exp(*m - top) + s2 * exp(m2 - top);
    *m = top;
}

// The group's (max, sum) from each work-item's, by a local-memory tree (TOPK a power of two).
inline void softmax_reduce(__local float* ms, __local float* ss, float* m, float* s)
{
    const int lid = get_local_id(0);
    ms[lid] = *m;
    ss[lid] = *s;
    for (int width = TOPK / 2; width > 0; width >>= 1) {
        barrier(CLK_LOCAL_MEM_FENCE);
        if (lid < width) {
            float a = ms[lid], b = ss[lid];
            softmax_merge(&a, &b, ms[lid + width], ss[lid + width]);
            ms[lid] = a;
            ss[lid] = b;
        }
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    *m = ms[0];
    *s = ss[0];
}

__kernel __attribute__((reqd_work_group_size(TOPK, 1, 1)))
void sample_partial(const int v, __global const float* restrict logits, __global const int* restrict history,
                    const int h, const float penalty, const float inv_t, __global ulong* restrict partial_keys,
                    __global float* restrict partial_max, __global float* restrict partial_sum)
{
    __local ulong keys[4 * TOPK];
    __local int set[HASH_SLOTS + FILTER_BITS / 32];
    __local int fill;
    __local float ms[TOPK], ss[TOPK];
    const int lid = get_local_id(0), g = get_group_id(0);
    const bool penalised = h > 0 && penalty != 1.0f;
    build_history(set, history, penalised ? min(h, HISTORY_MAX) : 0, v);
    const int chunk = (v + GROUPS - 1) / GROUPS;
    const int start = min(g * chunk, v), end = min(start + chunk, v);
    // Each scan below fills keys[] for the group's one sort, called in one loop: a pass sorts, picks the next scan
    // (the same for every work-item, so each reaches every barrier) and fills for the next sort.
    // The first scan also keeps each work-item's online softmax (max, Σ exp) of its y.
    float m = -INFINITY, s = 0.0f;
    int scan;
    uint width = 4 * TOPK;
    if (end - start <= 4 * TOPK) {
        // A chunk that fits local memory: every key in (keys[end − start ..] empty), one sort. A group past the
        // vocabulary's end (a small V) keeps none, and its (max, sum) is (−∞, 0): it goes this way too, not
        // returning early (a compiler lost the other groups' (max, sum) stores then: benchmarks/NOTES.md).
        scan = SCAN_WHOLE;
        for (int j = 0; j < 4; ++j) {
            const int i = start + lid + j * TOPK;
            ulong key = EMPTY_KEY;
            if (i < end) {
                const float x = penalised_logit(logits, set, penalised, penalty, i);
                key = make_key(x, i);
                softmax_add(&m, &s, x * inv_t);
            }
            keys[lid + j * TOPK] = key;
        }
        width = 1;
        while (width < (uint)(end - start)) {
            width <<= 1;
        }
    } else {
        // 1. Each work-item's four best keys (and its online softmax) over its share, strided by TOPK; the TOPK-th
        //    best of those 4·TOPK keys, tau, is at or below the group's TOPK-th best: TOPK keys reach it.
        scan = SCAN_BOUND;
        ulong k0 = EMPTY_KEY, k1 = EMPTY_KEY, k2 = EMPTY_KEY, k3 = EMPTY_KEY;
        for (int i = start + lid; i < end; i += TOPK) {
            const float x = penalised_logit(logits, set, penalised, penalty, i);
            const ulong key = make_key(x, i);
            softmax_add(&m, &s, x * inv_t);
            if (key > k3) {
                k3 = key;
                if (k3 > k2) { const ulong t = k2; k2 = k3; k3 = t; }
                if (k2 > k1) { const ulong t = k1; k1 = k2; k2 = t; }
                if (k1 > k0) { const ulong t = k0; k0 = k1; k1 = t; }
            }
        }
        keys[4 * lid] = k0;
        keys[4 * lid + 1] = k1;
        keys[4 * lid + 2] = k2;
        keys[4 * lid + 3] = k3;
    }
    if (lid == 0) {
        fill = 0;
    }
    ulong tau = EMPTY_KEY;
    int tile = start;    // the third scan's next tile
    int at_sort = 0;     // the count of offers at the last sort
    for (;;) {
        sort_first(keys, width);
        if (scan == SCAN_BOUND) {
            tau = keys[TOPK - 1];
            scan = SCAN_GATHER;
        } else if (scan == SCAN_GATHER && fill > 4 * TOPK) {
            // 3. More than 4·TOPK reached tau (a few work-items' shares holding most of the best): tiles of TOPK
            //    keys offered to the TOPK kept (``offer``), exact whatever the logits. (That pass sorted nothing.)
            scan = SCAN_TILES;
            at_sort = fill;
        } else if (scan == SCAN_TILES && tile < end) {
            at_sort = width > 1 ? fill : at_sort;
        } else {
            break;
        }
        barrier(CLK_LOCAL_MEM_FENCE);   // every work-item has read tau and fill
        if (scan == SCAN_GATHER) {
            // 2. Every key at or above tau into local memory (about TOPK of them, more where a few work-items'
            //    shares hold most of the best).
            for (int i = start + lid; i < end; i += TOPK) {
                const ulong key = make_key(penalised_logit(logits, set, penalised, penalty, i), i);
                if (key >= tau) {
                    const int slot = atomic_inc(&fill);
                    if (slot < 4 * TOPK) {
                        keys[slot] = key;
                    }
                }
            }
        } else {
            for (int k = 0; k < 2 && tile < end; ++k) {
                const int i = tile + lid;
                const ulong key = i < end ? make_key(penalised_logit(logits, set, penalised, penalty, i), i)
                                          : EMPTY_KEY;
                if (key >= tau) {
                    offer(keys, &fill, at_sort, key);
                }
                tile += TOPK;
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        const int count = fill;
        if (scan == SCAN_GATHER) {
            for (int j = 0; j < 4; ++j) {   // the rest empty; all of them where the tiles follow
                if (lid + j * TOPK >= count || count > 4 * TOPK) {
                    keys[lid + j * TOPK] = EMPTY_KEY;
                }
            }
            width = count > 4 * TOPK ? 1 : 4 * TOPK;
        } else {
            width = offers_sort_width(count - at_sort, tile >= end);
        }
    }
    partial_keys[(size_t)g * TOPK + lid] = keys[lid];
    softmax_reduce(ms, ss, &m, &s);
    if (lid == 0) {
        partial_max[g] = m;
        partial_sum[g] = s;
    }
}

// Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011; Random123's
// constants): word 0 of the output block.
inline uint philox_word0(uint c0, uint c1, uint c2, uint c3, uint k0, uint k1)
{
    for (int round = 0; round < 10; ++round) {
        const uint hi0 = mul_hi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        const uint hi1 = mul_hi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        const uint n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
        c0 = n0;
        c1 = n1;
        c2 = n2;
        c3 = n3;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    return c0;
}

__kernel __attribute__((reqd_work_group_size(TOPK, 1, 1)))
void sample_final(const int v, __global const ulong* restrict partial_keys,
                  __global const float* restrict partial_max, __global const float* restrict partial_sum,
                  const float inv_t, const int greedy, const int top_k, const float top_p, const float min_p,
                  const uint seed_lo, const uint seed_hi, const uint counter_lo, const uint counter_hi,
                  __global const int* restrict positions, const int pos_index, __global int* restrict out)
{
    __local ulong keys[4 * TOPK];
    __local int fill;
    __local float ms[TOPK], ss[TOPK];
    const int lid = get_local_id(0);
    keys[lid] = keys[TOPK + lid] = keys[2 * TOPK + lid] = keys[3 * TOPK + lid] = EMPTY_KEY;
    if (lid == 0) {
        fill = 0;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    // Each pass offers the next two groups whose best beats the kept TOPK-th (a group that does not, or that kept
    // none, offers nothing: the same test for every work-item, as the kept keys change only in the sort), then
    // sorts where TOPK keys wait, or where any wait once no group is left.
    int group = 0, at_sort = 0;
    for (;;) {
        for (int k = 0; k < 2; ++k) {
            while (group < GROUPS && partial_keys[(size_t)group * TOPK] <= keys[TOPK - 1]) {
                ++group;
            }
            if (group < GROUPS) {
                offer(keys, &fill, at_sort, partial_keys[(size_t)group * TOPK + lid]);
                ++group;
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        const int count = fill;
        const uint width = offers_sort_width(count - at_sort, group == GROUPS);
        sort_first(keys, width);
        if (group == GROUPS) {
            break;
        }
        at_sort = width > 1 ? count : at_sort;
    }
    float m = -INFINITY, s = 0.0f;
    for (int g = lid; g < GROUPS; g += TOPK) {
        softmax_merge(&m, &s, partial_max[g], partial_sum[g]);
    }
    softmax_reduce(ms, ss, &m, &s);
    if (lid != 0) {
        return;
    }
    if (greedy) {
        out[0] = key_index(keys[0]);
        return;
    }
    // The kept prefix of the order: top-k, then top-p over the whole vocabulary's probabilities (Σ = s at m).
    const int k = min(top_k, min(v, TOPK));
    const float y0 = key_value(keys[0]) * inv_t;
    const float floor_y = min_p > 0.0f ? y0 + log(min_p) : -INFINITY;   // p ≥ min_p · p_max in y's terms
    float cumulative = 0.0f, kept = 0.0f;
    int count = 0;
    for (int r = 0; r < k; ++r) {
        const float y = key_value(keys[r]) * inv_t;
        if (y < floor_y || y == -INFINITY) {
            break;   // min-p, or a token masked out (kernels/logit_mask.cl): the order descends, so nothing
        }            // after it passes either
        kept += exp(y - m);
        count = r + 1;
        cumulative += exp(y - m) / s;
        if (top_p < 1.0f && cumulative >= top_p) {
            break;   // the token crossing top_p is kept, none after it
        }
    }
    const uint word = philox_word0(counter_lo, counter_hi, (uint)positions[pos_index], 0u, seed_lo, seed_hi);
    const float target = (float)(word >> 8) * 0x1.0p-24f * kept;
    float running = 0.0f;
    int chosen = key_index(keys[count - 1]);
    for (int r = 0; r < count; ++r) {
        running += exp(key_value(keys[r]) * inv_t - m);
        if (target < running) {
            chosen = key_index(keys[r]);
            break;
        }
    }
    out[0] = chosen;
}

// The decode loop's history for the penalty: the chosen token into the ring of HISTORY_MAX ids at the next
// position (step[1] + 1) modulo HISTORY_MAX, before next_step (kernels/decode_loop.cl) moves the position on.
// The ring holds the ids of the last HISTORY_MAX positions, unused slots −1 (ignored). One work-item.
__kernel __attribute__((reqd_work_group_size(1, 1, 1)))
void sample_history_append(__global const int* restrict chosen, __global const int* restrict step,
                           __global int* restrict history)
{
    history[(step[1] + 1) % HISTORY_MAX] = chosen[0];
}
