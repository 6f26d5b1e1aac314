// Shared macros for code compiled both by nvcc (kernels) and g++ (host twins).
// Headers under csrc/include are torch-free: plain pointers and sizes only.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#define SI_HD __host__ __device__ __forceinline__
#else
#define SI_HD inline
#endif

// Status codes returned by every extern "C" entry point in csrc/.
enum si_status : int32_t {
  SI_OK = 0,
  SI_ERR_ARG = 1,    // a size or pointer argument is invalid
  SI_ERR_CUDA = 2,   // a CUDA launch or API call failed
  SI_ERR_RANGE = 3,  // an index points outside its buffer
};
