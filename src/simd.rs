//! Which vector width the x86-64 CPU kernels use.
//!
//! Every kernel with an AVX-512 form also has an AVX2 one that gives the same
//! bits (each lane runs the same chain of separate multiplies and adds), so the
//! choice changes speed only. Some processors lower their clock while running
//! 512-bit instructions; `SPIKECUBE_CPU_AVX512=0` makes every kernel take its
//! AVX2 form there.

/// Whether the CPU kernels use their AVX-512 forms: the processor reports
/// AVX-512F and the environment variable `SPIKECUBE_CPU_AVX512` is not `0`
/// (read once per process). Always false off x86-64.
pub(crate) fn avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *ON.get_or_init(|| {
            std::arch::is_x86_feature_detected!("avx512f")
                && std::env::var_os("SPIKECUBE_CPU_AVX512").is_none_or(|v| v != "0")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}
