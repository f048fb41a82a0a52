// The horizontal sum of 8 lanes that every int4 and int8 kernel ends its dot products with: lanes 4 apart
// first, then 2 apart, then neighbours (the halving tree a SIMD compiler forms from vector adds), so each
// kernel rounds its sums the same way.

#ifndef PERFX_SUM8_H
#define PERFX_SUM8_H

#define SUM8(v) ((((v).s0 + (v).s4) + ((v).s2 + (v).s6)) + (((v).s1 + (v).s5) + ((v).s3 + (v).s7)))

// The even and odd lanes of an int16, components named: the integer kernels sum adjacent products as
// EVEN16(p) + ODD16(p), the pattern x86 compilers turn into vpmaddwd. Oclgrind (21.10) takes .even / .odd of
// a 16-wide vector for uninitialized values; the compilers emit the same code for either.
#define EVEN16(v) ((int8)((v).s0, (v).s2, (v).s4, (v).s6, (v).s8, (v).sa, (v).sc, (v).se))
#define ODD16(v) ((int8)((v).s1, (v).s3, (v).s5, (v).s7, (v).s9, (v).sb, (v).sd, (v).sf))

#endif  // PERFX_SUM8_H
