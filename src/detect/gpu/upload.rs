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

/// Copies the first `len` 32-bit words of device buffer `src` into `dst` (which
/// holds at least `len`) on the device, in [`CHUNK`]-word launches (a launch's
/// cube count stays within every back end's limit), queued in stream order.
/// Bits are copied as they are.
pub(crate) fn copy_on_device<R: Runtime>(
    client: &ComputeClient<R>,
    src: &cubecl::server::Handle,
    dst: &cubecl::server::Handle,
    len: usize,
) {
    for start in (0..len).step_by(CHUNK) {
        let part = CHUNK.min(len - start);
        let piece = src.clone().offset_start((start * 4) as u64);
        // SAFETY: the kernel reads piece[j] (= src[start + j]) and writes
        // dst[start + j] for j < part, and start + part ≤ len, which both
        // buffers hold.
        unsafe {
            copy_words_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static(part.div_ceil(256) as u32, 1, 1),
                CubeDim::new_1d(256),
                ArrayArg::from_raw_parts(piece, part),
                ArrayArg::from_raw_parts(dst.clone(), len),
                start as u32,
                part as u32,
            );
        }
    }
}
