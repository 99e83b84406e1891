// Portable vectorisation helpers for the CPU kernels.
#pragma once

// Compile the marked function for AVX-512 and AVX2 as well as the baseline ISA and
// pick one at load time (GCC/Clang function multi-versioning on x86-64 ELF), so
// wide vectors are used where the CPU has them without being required.
#if defined(__x86_64__) && defined(__ELF__) && (defined(__GNUC__) || defined(__clang__))
#define FASTDP_MULTIVERSION __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FASTDP_MULTIVERSION
#endif
