//! Grouping consecutive template centres so that a cube stages the rows its
//! centres share in shared memory once: the neighbour centres (iC2) of the dense
//! `neighbour_max`.

/// Consecutive items (template centres) grouped into blocks, each with the
/// union of the rows (sites or centres) its items read.
#[derive(Debug, Clone)]
pub struct RowBlocks {
    /// Items per block.
    pub per_block: usize,
    /// Samples per cube.
    pub tile: usize,
    /// Longest union over all blocks (rows of shared memory).
    pub max_union: usize,
    /// Offsets into `rows`, n_blocks + 1.
    pub offsets: Vec<u32>,
    /// Each block's union of rows, sorted, concatenated.
    pub rows: Vec<u32>,
    /// Per item, its rows as indices into its block's union (items × per_item).
    pub local: Vec<u32>,
}

impl RowBlocks {
    /// Groups the items of `lists` (items × `per_item` row indices, item-major)
    /// into blocks of at most `max_units` units (items × samples), halving the
    /// block until `max_union · values_per_row · tile · 4` bytes fit `max_shared_bytes`.
    pub fn new(
        lists: &[u32],
        per_item: usize,
        values_per_row: usize,
        max_shared_bytes: usize,
        max_units: usize,
        first_block: usize,
    ) -> Self {
        let n_items = lists.len() / per_item;
        let mut per_block = first_block.max(1);
        loop {
            let tile = (max_units / per_block).clamp(1, 64);
            let b = Self::build(lists, per_item, n_items, per_block, tile);
            let fits = |b: &RowBlocks, tile: usize| {
                b.max_union * values_per_row * tile * 4 <= max_shared_bytes
            };
            if fits(&b, tile) {
                return b;
            }
            if per_block == 1 {
                let mut tile = tile;
                while tile > 1 && !fits(&b, tile) {
                    tile /= 2;
                }
                return Self::build(lists, per_item, n_items, 1, tile);
            }
            per_block /= 2;
        }
    }

    fn build(
        lists: &[u32],
        per_item: usize,
        n_items: usize,
        per_block: usize,
        tile: usize,
    ) -> Self {
        let mut offsets = vec![0u32];
        let mut rows = Vec::new();
        let mut local = vec![0u32; n_items * per_item];
        let mut max_union = 0;
        for start in (0..n_items).step_by(per_block) {
            let end = (start + per_block).min(n_items);
            let mut union: Vec<u32> = lists[start * per_item..end * per_item].to_vec();
            union.sort_unstable();
            union.dedup();
            for (l, &n) in local[start * per_item..end * per_item]
                .iter_mut()
                .zip(&lists[start * per_item..end * per_item])
            {
                *l = union.binary_search(&n).expect("in the union") as u32;
            }
            max_union = max_union.max(union.len());
            rows.extend_from_slice(&union);
            offsets.push(rows.len() as u32);
        }
        RowBlocks {
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
