//! Moving a window to the device.
//!
//! CubeCL 0.10 has no write into an existing buffer: each upload creates a new
//! one through a host staging copy. For a whole 92 MB window that path was
//! measured at about 0.4 GB/s on the H200 machine (docs/benchmarks-history.md), so the window
//! is sent in chunks of a few MB, whose staging memory CubeCL's pools reuse, and
//! a kernel copies each chunk into the window's persistent device buffer.

use cubecl::prelude::*;

/// Floats per chunk (4 MiB).
pub const CHUNK: usize = 1 << 20;

#[cube(launch_unchecked)]
pub(crate) fn copy_chunk_kernel(src: &Array<f32>, dst: &mut Array<f32>, offset: u32, len: u32) {
    let i = ABSOLUTE_POS;
    if i < len as usize {
        dst[offset as usize + i] = src[i];
    }
}

/// [`copy_chunk_kernel`] for 32-bit words of any meaning (int16 pairs, float
/// bits): copied as integers, so no bit pattern is changed.
#[cube(launch_unchecked)]
pub(crate) fn copy_words_kernel(src: &Array<u32>, dst: &mut Array<u32>, offset: u32, len: u32) {
    let i = ABSOLUTE_POS;
    if i < len as usize {
        dst[offset as usize + i] = src[i];
    }
}
