// The skinny GEMMs' passes over the M rows of X (gemm_q4_skinny.cl, gemm_q8.cl): included inside the kernel
// body, after the kernel file defines PASS(R) (one pass over K for R rows of X from m0, R a compile-time
// constant, advancing m0) and sets `int m0 = 0`. Full passes of MT rows, then the remainder (< MT) in
// passes of 8, 4, 2 and 1 rows, each at most once: every row of X is read from registers by a pass sized
// to it, and only the sizes below MT are built.

    while (m_rows - m0 >= MT) PASS(MT)
#if MT >= 16
    if (m_rows - m0 >= 8) PASS(8)
#endif
#if MT >= 8
    if (m_rows - m0 >= 4) PASS(4)
#endif
#if MT >= 4
    if (m_rows - m0 >= 2) PASS(2)
#endif
#if MT >= 2
    if (m_rows - m0 >= 1) PASS(1)
#endif
