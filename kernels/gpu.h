// What perfx's GPU-class variants share: the required-subgroup-size attribute, subgroup and fp16 enables.
// Included by kernel files (the build passes -I kernels/); every macro here is inert at its defaults, so a
// file that includes it still builds on a device with neither subgroups nor fp16 (PoCL, Oclgrind).
//
//   SUBGROUP  the subgroup size a kernel requires, in work-items (0: the driver's choice). The wrapper sets
//             it only to a size the device offers (perfx.ops.params.required_subgroup_sizes):
//             Adreno (cl_qcom_reqd_sub_group_size): 64 = "half" wave, 128 = "full" wave;
//             Intel (cl_intel_required_subgroup_size): the SIMD width, e.g. 8 or 16 on a CPU.
//   REQD_SUBGROUP  the attribute to put before a kernel that uses subgroup operations.
//   USES_SUBGROUPS (defined by a kernel file before the include, 0/1): enables cl_khr_subgroups where the
//             compiler wants the pragma (OpenCL C 1.2 compilers that list the extension).

#ifndef PERFX_GPU_H
#define PERFX_GPU_H

#ifndef SUBGROUP
#define SUBGROUP 0
#endif

#if SUBGROUP > 0
#if defined(cl_qcom_reqd_sub_group_size)
#pragma OPENCL EXTENSION cl_qcom_reqd_sub_group_size : enable
#if SUBGROUP == 64
#define REQD_SUBGROUP __attribute__((qcom_reqd_sub_group_size("half")))
#elif SUBGROUP == 128
#define REQD_SUBGROUP __attribute__((qcom_reqd_sub_group_size("full")))
#else
#error "Adreno requires subgroups of 64 (half) or 128 (full) work-items"
#endif
#elif defined(cl_intel_required_subgroup_size)
#define REQD_SUBGROUP __attribute__((intel_reqd_sub_group_size(SUBGROUP)))
#else
#error "SUBGROUP > 0 needs cl_qcom_reqd_sub_group_size or cl_intel_required_subgroup_size"
#endif
#else
#define REQD_SUBGROUP
#endif

#if defined(USES_SUBGROUPS) && USES_SUBGROUPS && defined(cl_khr_subgroups)
#pragma OPENCL EXTENSION cl_khr_subgroups : enable
#endif

#endif  // PERFX_GPU_H
