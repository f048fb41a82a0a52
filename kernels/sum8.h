// The horizontal sum of 8 lanes that every int4 and int8 kernel ends its dot products with: lanes 4 apart
// first, then 2 apart, then neighbours (the halving tree a SIMD compiler forms from vector adds), so each
// kernel rounds its sums the same way.

#ifndef PERFX_SUM8_H
#define PERFX_SUM8_H

#define SUM8(v) ((((v).s0 + (v).s4) + ((v).s2 + (v).s6)) + (((v).s1 + (v).s5) + ((v).s3 + (v).s7)))

#endif  // PERFX_SUM8_H
