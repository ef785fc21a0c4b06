//! Step 3 on the device: `neighbour_max`, GPU twin of
//! [`crate::detect::cpu::neighbour_max`]: Amax\[j, t\] = max over the iC2
//! neighbours m of As\[m, t\].
//!
//! The host groups consecutive centres into blocks ([`NeighbourBlocks`]) and lists
//! each block's union of neighbour rows once; a cube loads that union for its
//! samples into shared memory, and each unit takes its centre's maximum there,
//! through the centre's indices into the union. A maximum does not depend on the
//! order, so the result equals the CPU's bit for bit.

use cubecl::prelude::*;

/// Consecutive template centres grouped for [`neighbour_max_kernel`].
#[derive(Debug, Clone)]
pub struct NeighbourBlocks {
    /// Centres per block.
    pub per_block: usize,
    /// Samples per cube.
    pub tile: usize,
    /// Longest union of neighbour rows over all blocks (shared memory rows).
    pub max_union: usize,
    /// Offsets into `rows`, n_blocks + 1.
    pub offsets: Vec<u32>,
    /// Each block's union of neighbour rows (centre indices), concatenated.
    pub rows: Vec<u32>,
    /// Per centre, its nC2 neighbours as indices into its block's union (Nf × nC2).
    pub local: Vec<u32>,
}

impl NeighbourBlocks {
    /// Groups the Nf centres (`neighbours`: Nf × nC2, centre-major iC2) into blocks
    /// whose union fits `max_shared_bytes` of shared memory for `tile` samples;
    /// the block size is halved until it does (down to one centre).
    pub fn new(neighbours: &[u32], nc2: usize, max_shared_bytes: usize, max_units: usize) -> Self {
        let nf = neighbours.len() / nc2;
        let mut per_block = 16usize;
        loop {
            let tile = (max_units / per_block).clamp(1, 64);
            let b = Self::build(neighbours, nc2, nf, per_block, tile);
            if b.max_union * tile * 4 <= max_shared_bytes || per_block == 1 {
                if b.max_union * tile * 4 <= max_shared_bytes {
                    return b;
                }
                // One centre per block: fall back to fewer samples per cube.
                let mut tile = tile;
                while tile > 1 && b.max_union * tile * 4 > max_shared_bytes {
                    tile /= 2;
                }
                return Self::build(neighbours, nc2, nf, 1, tile);
            }
            per_block /= 2;
        }
    }

    fn build(neighbours: &[u32], nc2: usize, nf: usize, per_block: usize, tile: usize) -> Self {
        let mut offsets = vec![0u32];
        let mut rows = Vec::new();
        let mut local = vec![0u32; nf * nc2];
        let mut max_union = 0;
        for start in (0..nf).step_by(per_block) {
            let end = (start + per_block).min(nf);
            let mut union: Vec<u32> = neighbours[start * nc2..end * nc2].to_vec();
            union.sort_unstable();
            union.dedup();
            for j in start..end {
                for m in 0..nc2 {
                    let n = neighbours[j * nc2 + m];
                    local[j * nc2 + m] = union.binary_search(&n).expect("in the union") as u32;
                }
            }
            max_union = max_union.max(union.len());
            rows.extend_from_slice(&union);
            offsets.push(rows.len() as u32);
        }
        NeighbourBlocks {
            per_block,
            tile,
            max_union,
            offsets,
            rows,
            local,
        }
    }

    /// Number of blocks.
    pub fn n_blocks(&self) -> usize {
        self.offsets.len() - 1
    }
}

#[cube(launch)]
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
