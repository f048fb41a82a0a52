// y (N) = 2·x (N): the toy kernel family of the tuner's tests. MODE picks a planted behaviour:
// 0 correct, 1 wrong by 0.1% (fails verification), 2 does not compile (fails the build).

#ifndef WGS
#define WGS 16  // work-items per work-group
#endif
#ifndef MODE
#define MODE 0  // 0 correct, 1 wrong, 2 broken source
#endif

#if MODE == 2
this is not OpenCL C
#endif

__kernel __attribute__((reqd_work_group_size(WGS, 1, 1)))
void toy_scale(const int n, __global const float* x, __global float* y)
{
    const int i = get_global_id(0);
    if (i < n) {
#if MODE == 1
        y[i] = 2.002f * x[i];
#else
        y[i] = 2.0f * x[i];
#endif
    }
}
