//! Step 3 on the device: `neighbour_max`, GPU twin of
//! [`crate::detect::cpu::neighbour_max`]: Amax\[j, t\] = max over the iC2
//! neighbours m of As\[m, t\].
//!
//! The host groups consecutive centres into blocks ([`super::blocks::RowBlocks`]) and lists
//! each block's union of neighbour rows once; a cube loads that union for its
//! samples into shared memory, and each unit takes its centre's maximum there,
//! through the centre's indices into the union. A maximum does not depend on the
//! order, so the result equals the CPU's bit for bit.

use cubecl::prelude::*;

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn neighbour_max_kernel(
    as_in: &Array<f32>,
    offsets: &Array<u32>,
    rows: &Array<u32>,
    local: &Array<u32>,
    amax: &mut Array<f32>,
    n_t: u32,
    nf: u32,
    nc2: u32,
    #[comptime] max_union: usize,
    #[comptime] tile: usize,
    #[comptime] per_block: usize,
) {
    let mut sh = SharedMemory::<f32>::new(comptime!(max_union * tile));
    let blk = CUBE_POS_X as usize;
    let t0 = CUBE_POS_Y as usize * tile;
    let n_t = n_t as usize;
    let off = offsets[blk] as usize;
    let len = offsets[blk + 1] as usize - off;
    let units = comptime!(tile * per_block);
    let mut i = UNIT_POS as usize;
    while i < len * tile {
        let row = rows[off + i / tile] as usize;
        let t = t0 + i % tile;
        let mut v = 0.0f32;
        if t < n_t {
            v = as_in[row * n_t + t];
        }
        sh[i] = v;
        i += units;
    }
    sync_cube();
    let x = UNIT_POS_X as usize;
    let j = blk * per_block + UNIT_POS_Y as usize;
    let t = t0 + x;
    let nc2 = nc2 as usize;
    if j < nf as usize && t < n_t {
        let mut m = sh[local[j * nc2] as usize * tile + x];
        for n in 1..nc2 {
            m = max(m, sh[local[j * nc2 + n] as usize * tile + x]);
        }
        amax[j * n_t + t] = m;
    }
}
