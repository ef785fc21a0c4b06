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
/// holds at least `len`) on the device, in one launch queued in stream
/// order: its cubes of 256 units are laid out on two axes of at most 65 535
/// (every back end's limit), and `ABSOLUTE_POS` numbers the units across
/// both. Bits are copied as they are.
pub(crate) fn copy_on_device<R: Runtime>(
    client: &ComputeClient<R>,
    src: &cubecl::server::Handle,
    dst: &cubecl::server::Handle,
    len: usize,
) {
    if len == 0 {
        return;
    }
    let cubes = len.div_ceil(256);
    let x = cubes.min(MAX_CUBES_PER_AXIS);
    let y = cubes.div_ceil(x);
    // SAFETY: the kernel writes dst[j] = src[j] for j < len only (units past
    // len do nothing), and both buffers hold len words.
    unsafe {
        copy_words_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(x as u32, y as u32, 1),
            CubeDim::new_1d(256),
            ArrayArg::from_raw_parts(src.clone(), len),
            ArrayArg::from_raw_parts(dst.clone(), len),
            0,
            len as u32,
        );
    }
}

/// Most cubes along one axis of a launch on every back end (wgpu's limit).
const MAX_CUBES_PER_AXIS: usize = 65_535;

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use super::*;
    use cubecl::wgpu::{WgpuDevice, WgpuRuntime};

    /// A copy longer than one axis of cubes holds (65 535 × 256 words, as a
    /// 384-site window of 60 122 samples is) comes out whole, bit for bit, in
    /// its one launch; so does a short one. On wgpu (Mesa's lavapipe in CI).
    #[test]
    fn one_launch_copies_every_word() {
        assert!(
            !crate::backend::probe_wgpu().is_empty(),
            "no Vulkan adapter: install a Vulkan driver (CI: apt-get install mesa-vulkan-drivers libvulkan1)"
        );
        let client = WgpuRuntime::client(&WgpuDevice::DefaultDevice);
        for len in [MAX_CUBES_PER_AXIS * 256 + 1000, 1000] {
            let words: Vec<u32> = (0..len as u32)
                .map(|i| i.wrapping_mul(2_654_435_761))
                .collect();
            let src = client.create_from_slice(bytemuck_bytes(&words));
            let dst = client.empty(len * 4);
            copy_on_device(&client, &src, &dst, len);
            let out = client.read(vec![dst]);
            let got: Vec<u32> = out[0]
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            assert_eq!(got.len(), len);
            let first_wrong = got.iter().zip(&words).position(|(a, b)| a != b);
            assert_eq!(first_wrong, None, "{len} words");
        }
    }

    fn bytemuck_bytes(v: &[u32]) -> &[u8] {
        // SAFETY: u32 has no padding and any byte pattern is a valid u8.
        unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), v.len() * 4) }
    }
}
