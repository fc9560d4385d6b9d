#pragma once
// A process's first use of ATen's CPU vector math, made on one thread.
//
// ATen hands float and double cos, sin, exp, log, sqrt (and the other
// functions in ATen/cpu/vml.h) to MKL's vector math in chunks of 2048
// elements spread over OpenMP threads. The first such call of a process,
// when its chunks start together, has returned the chunks of threads other
// than the caller's far less accurately (cos 1e-4 relative, exp of doubles
// 3e-9): on a loaded 2-core machine, after a multithreaded matmul, 4-7% of
// processes for cos, sin, log and sqrt of 8192 floats and exp of 8192
// doubles, and one capture in a hundred had its RoPE table wrong for
// positions 16-31. Once one call had run alone, none did in 1,200 processes
// (cos, log and sqrt, 400 each).

namespace kvforge {

// Makes that first call (a few elements, so on this thread alone) once per
// process; later calls return at once. Code that applies those functions
// to CPU tensors calls it first.
void prepare_cpu_vector_math();

}  // namespace kvforge
