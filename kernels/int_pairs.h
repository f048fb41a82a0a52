// The even and odd lanes of an int16, components named: the integer-product GEMVs (gemv_q8 I8, gemv_q4's rows
// kernel with I8) sum adjacent products as EVEN16(p) + ODD16(p), the pattern x86 compilers turn into
// vpmaddwd. Oclgrind has taken .even / .odd of a 16-wide vector for uninitialized values; the compilers
// emit the same code for either.

#ifndef PERFX_INT_PAIRS_H
#define PERFX_INT_PAIRS_H

#define EVEN16(v) ((int8)((v).s0, (v).s2, (v).s4, (v).s6, (v).s8, (v).sa, (v).sc, (v).se))
#define ODD16(v) ((int8)((v).s1, (v).s3, (v).s5, (v).s7, (v).s9, (v).sb, (v).sd, (v).sf))

#endif  // PERFX_INT_PAIRS_H
