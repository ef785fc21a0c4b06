//! Label updates on the bipartite spike–landmark graph (Kilosort4 4.1.7
//! `clustering_qr.py`: `Mstats`, `assign_isub`, `assign_iclust`, the loop of
//! `cluster`).
//!
//! The graph M (n spikes × L landmarks) has a 1 for each of a spike's k
//! nearest landmarks, except that a landmark's own spike has a 0 there ("self
//! connections set to 0"). m = Σ M, k_i its row sums, k_j its column sums.
//! Alternately:
//! - each landmark j takes the cluster c maximising
//!   #{spikes of c listing j among their neighbours} − k_j·N_c/m,
//!   N_c = spikes in c (the self neighbour counts here, as in Kilosort4);
//! - each spike i takes the cluster c maximising
//!   #{its neighbours labelled c} − k_i·L_c/m, L_c = landmarks in c.
//!
//! The maximum is over all clusters, empty ones included (value 0 − k·N/m for
//! a cluster the row never sees), the first on ties, as torch's dense
//! `argmax` does. Counts are integers; the expected-edge term is float64.

use rayon::prelude::*;

/// Rows per rayon task in a label update (fixed, so that nothing depends on
/// the thread count; each row is independent anyway).
const ROW_BLOCK: usize = 1024;

/// The neighbour graph of one group and its degrees.
#[derive(Debug, Clone)]
pub struct Graph {
    /// Spikes (rows of M).
    pub n: usize,
    /// Landmarks (columns of M).
    pub n_sub: usize,
    /// Neighbours per spike.
    pub k: usize,
    /// Each spike's k landmarks (n × k), row-major.
    pub kn: Vec<u32>,
    /// Whether the neighbour slot (n × k) is the spike's own landmark, which
    /// has weight 0 in M.
    pub is_self: Vec<bool>,
    /// Row sums of M (spike degrees).
    pub ki: Vec<f64>,
    /// Column sums of M (landmark degrees).
    pub kj: Vec<f64>,
    /// Σ M.
    pub m: f64,
    /// For each landmark, the spikes listing it (CSR offsets into `inc`).
    inc_off: Vec<usize>,
    inc: Vec<u32>,
}

impl Graph {
    /// The graph from each spike's `k` nearest landmarks `kn` (n × k) and the
    /// landmarks' spike indices `landmarks` (L).
    pub fn new(kn: Vec<u32>, k: usize, landmarks: &[usize]) -> Self {
        let n = kn.len() / k;
        let n_sub = landmarks.len();
        let mut is_self = vec![false; kn.len()];
        for (j, &s) in landmarks.iter().enumerate() {
            for t in 0..k {
                if kn[s * k + t] as usize == j {
                    is_self[s * k + t] = true;
                }
            }
        }
        let mut ki = vec![0f64; n];
        let mut kj = vec![0f64; n_sub];
        let mut deg = vec![0usize; n_sub + 1];
        for i in 0..n {
            for t in 0..k {
                let j = kn[i * k + t] as usize;
                deg[j + 1] += 1;
                if !is_self[i * k + t] {
                    ki[i] += 1.0;
                    kj[j] += 1.0;
                }
            }
        }
        for j in 0..n_sub {
            deg[j + 1] += deg[j];
        }
        let mut fill = deg.clone();
        let mut inc = vec![0u32; kn.len()];
        for i in 0..n {
            for t in 0..k {
                let j = kn[i * k + t] as usize;
                inc[fill[j]] = i as u32;
                fill[j] += 1;
            }
        }
        let m = ki.iter().sum();
        Graph {
            n,
            n_sub,
            k,
            kn,
            is_self,
            ki,
            kj,
            m,
            inc_off: deg,
            inc,
        }
    }

    /// The spikes listing landmark `j` among their neighbours (ascending).
    pub fn incoming(&self, j: usize) -> &[u32] {
        &self.inc[self.inc_off[j]..self.inc_off[j + 1]]
    }
}

/// Clusters in order of (members, index): the first one a row does not see is
/// the best of all the clusters it does not see.
fn by_size(sizes: &[u32]) -> Vec<u32> {
    let mut order: Vec<u32> = (0..sizes.len() as u32).collect();
    order.sort_by_key(|&c| (sizes[c as usize], c));
    order
}

/// Per-thread scratch for one row's counts.
struct Scratch {
    count: Vec<u32>,
    touched: Vec<u32>,
}

/// The argmax over all `nclust` clusters of count_c − w·size_c (first on
/// ties), given the row's non-zero counts in `s.count`/`s.touched`.
fn best_label(s: &mut Scratch, w: f64, sizes: &[u32], order: &[u32]) -> u32 {
    let mut best = u32::MAX;
    let mut bv = f64::NEG_INFINITY;
    for &c in &s.touched {
        let v = f64::from(s.count[c as usize]) - w * f64::from(sizes[c as usize]);
        if v > bv || (v == bv && c < best) {
            bv = v;
            best = c;
        }
    }
    if let Some(&c) = order.iter().find(|&&c| s.count[c as usize] == 0) {
        let v = -w * f64::from(sizes[c as usize]);
        if v > bv || (v == bv && c < best) {
            best = c;
        }
    }
    for &c in &s.touched {
        s.count[c as usize] = 0;
    }
    s.touched.clear();
    best
}

/// Member counts of labels 0‥`nclust`.
fn sizes(labels: &[u32], nclust: usize) -> Vec<u32> {
    let mut n = vec![0u32; nclust];
    for &l in labels {
        n[l as usize] += 1;
    }
    n
}

/// Landmark labels given the spike labels `iclust` (Kilosort4's `assign_isub`).
pub fn assign_isub(g: &Graph, iclust: &[u32], nclust: usize) -> Vec<u32> {
    let nsz = sizes(iclust, nclust);
    let order = by_size(&nsz);
    let mut isub = vec![0u32; g.n_sub];
    isub.par_chunks_mut(ROW_BLOCK)
        .enumerate()
        .for_each(|(b, out)| {
            let mut s = Scratch {
                count: vec![0; nclust],
                touched: Vec::new(),
            };
            for (r, o) in out.iter_mut().enumerate() {
                let j = b * ROW_BLOCK + r;
                for &i in g.incoming(j) {
                    let c = iclust[i as usize];
                    if s.count[c as usize] == 0 {
                        s.touched.push(c);
                    }
                    s.count[c as usize] += 1;
                }
                *o = best_label(&mut s, g.kj[j] / g.m, &nsz, &order);
            }
        });
    isub
}

/// Spike labels given the landmark labels `isub` (Kilosort4's `assign_iclust`).
pub fn assign_iclust(g: &Graph, isub: &[u32], nclust: usize) -> Vec<u32> {
    let lsz = sizes(isub, nclust);
    let order = by_size(&lsz);
    let mut iclust = vec![0u32; g.n];
    iclust
        .par_chunks_mut(ROW_BLOCK)
        .enumerate()
        .for_each(|(b, out)| {
            let mut s = Scratch {
                count: vec![0; nclust],
                touched: Vec::new(),
            };
            for (r, o) in out.iter_mut().enumerate() {
                let i = b * ROW_BLOCK + r;
                for &j in &g.kn[i * g.k..(i + 1) * g.k] {
                    let c = isub[j as usize];
                    if s.count[c as usize] == 0 {
                        s.touched.push(c);
                    }
                    s.count[c as usize] += 1;
                }
                *o = best_label(&mut s, g.ki[i] / g.m, &lsz, &order);
            }
        });
    iclust
}

/// The result of the label updates of one group.
#[derive(Debug, Clone)]
pub struct Labels {
    /// Spike labels 0‥`nclust`, renumbered in order of the old labels.
    pub iclust: Vec<u32>,
    /// Landmark labels under the renumbered spike labels.
    pub isub: Vec<u32>,
    /// Clusters left.
    pub nclust: usize,
    /// Rounds run before the labels stopped changing (≤ `rounds`).
    pub rounds_run: usize,
}

/// `rounds` label-update rounds from the initial spike labels `init`
/// (0‥`nclust`), then the relabelling to 0‥nc and the landmark labels under it
/// (Kilosort4's `cluster` after the seeding).
///
/// A round whose spike labels equal the previous round's is a fixed point (the
/// next rounds repeat it), so the loop stops there with the same result.
pub fn propagate(g: &Graph, init: &[u32], nclust: usize, rounds: usize) -> Labels {
    let mut iclust = init.to_vec();
    let mut rounds_run = 0;
    for _ in 0..rounds {
        let isub = assign_isub(g, &iclust, nclust);
        let next = assign_iclust(g, &isub, nclust);
        rounds_run += 1;
        let same = next == iclust;
        iclust = next;
        if same {
            break;
        }
    }
    let mut map = vec![u32::MAX; nclust];
    for &l in &iclust {
        map[l as usize] = 0;
    }
    let mut nc = 0u32;
    for v in map.iter_mut() {
        if *v == 0 {
            *v = nc;
            nc += 1;
        }
    }
    let iclust: Vec<u32> = iclust.iter().map(|&l| map[l as usize]).collect();
    let isub = assign_isub(g, &iclust, nc as usize);
    Labels {
        iclust,
        isub,
        nclust: nc as usize,
        rounds_run,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A dense, literal version of one half-step, for comparison.
    fn dense_iclust(g: &Graph, isub: &[u32], nclust: usize) -> Vec<u32> {
        let lsz = sizes(isub, nclust);
        (0..g.n)
            .map(|i| {
                let mut v = vec![0f64; nclust];
                for &j in &g.kn[i * g.k..(i + 1) * g.k] {
                    v[isub[j as usize] as usize] += 1.0;
                }
                let mut best = 0;
                for c in 0..nclust {
                    v[c] -= g.ki[i] / g.m * f64::from(lsz[c]);
                    if v[c] > v[best] {
                        best = c;
                    }
                }
                best as u32
            })
            .collect()
    }

    #[test]
    fn sparse_argmax_equals_dense_argmax() {
        // A small pseudo-random graph.
        let (n, k) = (300usize, 4usize);
        let lm: Vec<usize> = (0..n).step_by(5).collect();
        let mut x = 12345u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut kn = Vec::new();
        for _ in 0..n {
            let mut row: Vec<u32> = Vec::new();
            while row.len() < k {
                let j = (next() % lm.len() as u64) as u32;
                if !row.contains(&j) {
                    row.push(j);
                }
            }
            kn.extend(row);
        }
        let g = Graph::new(kn, k, &lm);
        let nclust = 7;
        let isub: Vec<u32> = (0..g.n_sub).map(|_| (next() % 5) as u32).collect();
        assert_eq!(
            assign_iclust(&g, &isub, nclust),
            dense_iclust(&g, &isub, nclust)
        );
        assert_eq!(g.m, g.kj.iter().sum::<f64>());
    }
}
