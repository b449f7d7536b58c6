/* Preloaded into a process (LD_PRELOAD), this library makes Intel's MKL take the code path it
 * takes on Intel's processors: MKL asks mkl_serv_intel_cpu_true() whether it runs on one, and
 * otherwise (an AMD processor) runs kernels of 256-bit registers at most, even where the
 * processor has AVX-512. On the Intel path MKL still chooses its kernels by the processor's
 * features. Build: cc -shared -fPIC -O2 -o libmkl_intel_path.so mkl_intel_path.c
 * (benchmarks/blas_path.py builds it for the benchmarks' --blas avx512). */
int mkl_serv_intel_cpu_true(void) { return 1; }
