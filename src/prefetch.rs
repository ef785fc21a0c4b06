//! Software prefetch for loops that walk many rows of a window at once (its
//! 384 channels, a block of samples each): more separate streams than the
//! hardware prefetcher follows.

/// Asks for the cache lines of `data` ahead of its use. A hint only: it
/// changes no result; nothing off x86-64.
#[inline(always)]
pub(crate) fn prefetch(data: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    for i in (0..data.len()).step_by(16) {
        // SAFETY: a prefetch only hints, and `i` is inside `data`.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                data.as_ptr().add(i).cast(),
            )
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = data;
}
