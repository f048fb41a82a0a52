// The skinny GEMMs' passes over the M rows of X (gemm_q4_skinny.cl, gemm_q8.cl, gemm_q4_i8.cl, gemm_q8_i8.cl,
// gemm_q4_lanes.cl, gemm_q8_lanes.cl): included inside the kernel body, after the kernel file defines M_PASS
// (the rows of a full pass: MT, or the lanes kernels' MB), M_TAIL (the smallest pass: 2, or 4) and
// PASS(R, LEFT) (one pass over K for R rows of X from m0, R a compile-time constant, of which LEFT exist: it
// opens with PASS_ROWS(R, LEFT), reads row xrow[mm] of X as its row mm and stores its row mm to Y's row
// m0 + xrow[mm], then advances m0 by R) and sets `int m0 = 0`.
//
// Full passes of M_PASS rows, then the remainder (M mod M_PASS rows) in passes of 4 while more than M_TAIL
// rows are left and the last ones in a pass of M_TAIL, each masked to the rows that exist: a row past M is
// computed as the pass's last row again and stored onto it, the same value (in bounds, and neither a select
// in the loop over K nor a branch around the stores). A full pass of more than 4 rows is the plain body
// (LEFT = R folds every row index to a constant). So a kernel holds at most three copies of its unrolled pass
// body (M_PASS, 4 and 2; two with M_TAIL 4), where a pass for each remainder size (8, 4, 2, 1) made up to
// five, the large ones where M_PASS is large: each copy adds to a program's build and first launch.
//
// What it costs: a remainder of r rows takes ⌈r/4⌉ passes, each reading the work-item's weight rows once,
// where a pass for each set bit of r took popcount(r) (no more for r < 8, at most one more above), and wastes
// at most one row of multiply-adds with M_TAIL 2 (r mod 4 = 1 runs a pass of 2, r mod 4 = 3 one of 4), three
// with M_TAIL 4. One masked pass of M_PASS rows would read the weights once but waste up to M_PASS − 1 rows of
// arithmetic: little to a GPU bound by its weight reads, but a CPU's passes over cache-resident weights are
// bound by their arithmetic, and there M below M_PASS (the batched decode step's few rows) would cost up to
// ~M_PASS/M times the work. M_TAIL 2 keeps M = 2 (two sequences decoded together) a pass of 2: the float8 and
// integer GEMMs, whose row of X costs much beside a weight's decoding, take it. The lanes GEMMs, whose row
// costs one multiply-add a weight, take M_TAIL 4: a body of 2 cost them more compile than M = 2's two wasted
// rows cost at run time (benchmarks/NOTES.md).

// Opens a pass of R rows from m0 of which LEFT exist: the row of X each reads and stores (xrow[mm], from m0).
#define PASS_ROWS(R, LEFT)                                             \
    const int rows = min(R, LEFT);                                     \
    int xrow[R];                                                       \
    _Pragma("unroll") for (int mm = 0; mm < R; mm++) xrow[mm] = min(mm, rows - 1);

#if M_PASS > 4
    while (m_rows - m0 >= M_PASS) PASS(M_PASS, M_PASS)
#endif
#if M_PASS >= 4 && M_TAIL == 2
    while (m_rows - m0 > 2) PASS(4, m_rows - m0)
#endif
    while (m0 < m_rows) PASS(M_TAIL, m_rows - m0)
