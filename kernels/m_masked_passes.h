// The lanes GEMMs' passes over the M rows of X (gemm_q4_lanes.cl, gemm_q8_lanes.cl): included inside the
// kernel body, after the kernel file defines M_PASS (MB, at least 4) and PASS(R, LEFT) (one pass over K for
// R rows of X from m0, R a compile-time constant, of which LEFT exist: it opens with PASS_ROWS(R, LEFT),
// reads row xrow[mm] of X as its row mm and stores its row mm to Y's row m0 + xrow[mm], then advances m0 by
// R) and sets `int m0 = 0`.
//
// Full passes of M_PASS rows, then the remainder (M mod M_PASS rows) in passes of 4, each masked to the rows
// that exist: a row past M is computed as the pass's last row again and stored onto it, the same value (in
// bounds, and neither a select in the loop over K nor a branch around the stores). A full pass is the plain
// body (LEFT = R folds every row index to a constant). So a kernel holds two copies of its unrolled pass
// body (M_PASS and 4; one where M_PASS is 4), where a pass for each remainder size (8, 4, 2, 1) made up to
// five, the large ones where M_PASS is large: each copy adds to a program's build and first launch, and the
// lanes GEMMs' are the costliest to build of the GEMMs.
//
// What it costs: a remainder of r rows takes ⌈r/4⌉ passes, each reading the work-item's weight rows once,
// where a pass for each set bit of r took popcount(r) (no more for r < 8, at most one more above), and
// wastes up to three rows of multiply-adds (M = 2 runs a pass of 4 for 2 rows; M = 3 one pass where 2 + 1
// ran). A row costs the lanes GEMMs one multiply-add a weight beside its decoding, so a body of 2 would cost
// their compile more than M = 2's two wasted rows cost at run time; the plan weighs that against the other
// kinds at each M the bucket serves (perfx.plan.one_run_costs). The float8 and integer GEMMs, whose row of X
// costs much beside a weight's decoding, keep a pass for each remainder size (kernels/m_passes.h).

// Opens a pass of R rows from m0 of which LEFT exist: the row of X each reads and stores (xrow[mm], from m0).
#define PASS_ROWS(R, LEFT)                                             \
    const int rows = min(R, LEFT);                                     \
    int xrow[R];                                                       \
    _Pragma("unroll") for (int mm = 0; mm < R; mm++) xrow[mm] = min(mm, rows - 1);

#if M_PASS > 4
    while (m_rows - m0 >= M_PASS) PASS(M_PASS, M_PASS)
#endif
    while (m0 < m_rows) PASS(4, m_rows - m0)
