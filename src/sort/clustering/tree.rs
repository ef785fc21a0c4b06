//! The merge tree of one group (Kilosort4 4.1.7 `hierarchical.py`: `prepare`,
//! `merge_reduce`, `find_merges`, `get_my_clus`).
//!
//! cc[a][b] counts the graph's edges from spikes of cluster a to landmarks of
//! cluster b; cneg[a][b] = 0.001 + (Σ_{i∈a} k_i)(Σ_{j∈b} k_j)/m is the expected
//! count. Both are symmetrised, and nc − 1 greedy merges join the pair with
//! the largest ratio cc/cneg (the first in row-major order on ties), summing
//! rows and columns. All in float64 as numpy computes it: the counts are exact
//! integers, so the tree is the same as Kilosort4's for the same labels.

use super::labels::Graph;

/// One merge: children `x` and `y` (node ids; leaves are 0‥nc, merge t makes
/// node nc + t) and the ratio cc/cneg at the merge (float32, as Kilosort4's
/// `tstat` keeps it).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Merge {
    /// The merged-away child (Kilosort4's `xtree[t, 0]`).
    pub x: usize,
    /// The child merged into (Kilosort4's `xtree[t, 1]`).
    pub y: usize,
    /// Ratio cc/cneg of the pair when merged.
    pub ratio: f32,
}

/// The cluster-level edge counts cc (nc × nc, row-major) and expected counts
/// cneg of spike labels `iclust` and landmark labels `isub`.
pub fn prepare(g: &Graph, iclust: &[u32], isub: &[u32], nc: usize) -> (Vec<f64>, Vec<f64>) {
    let mut cc = vec![0f64; nc * nc];
    let mut qk = vec![0f64; nc];
    let mut kr = vec![0f64; nc];
    for i in 0..g.n {
        let a = iclust[i] as usize;
        qk[a] += g.ki[i];
        for t in 0..g.k {
            if !g.is_self[i * g.k + t] {
                let b = isub[g.kn[i * g.k + t] as usize] as usize;
                cc[a * nc + b] += 1.0;
            }
        }
    }
    for (j, &b) in isub.iter().enumerate() {
        kr[b as usize] += g.kj[j];
    }
    let mut cneg = vec![0f64; nc * nc];
    for a in 0..nc {
        for b in 0..nc {
            cneg[a * nc + b] = 0.001 + (qk[a] * kr[b]) / g.m;
        }
    }
    (cc, cneg)
}

/// The nc − 1 greedy merges (Kilosort4's `merge_reduce` + `find_merges`).
pub fn find_merges(mut cc: Vec<f64>, mut cneg: Vec<f64>, nc: usize) -> Vec<Merge> {
    let at = |a: usize, b: usize| a * nc + b;
    // Symmetrise.
    for a in 0..nc {
        for b in a..nc {
            let s = cc[at(a, b)] + cc[at(b, a)];
            cc[at(a, b)] = s;
            cc[at(b, a)] = s;
            let s = cneg[at(a, b)] + cneg[at(b, a)];
            cneg[at(a, b)] = s;
            cneg[at(b, a)] = s;
        }
    }
    let mut crat: Vec<f64> = cc.iter().zip(&cneg).map(|(c, n)| c / n).collect();
    for a in 0..nc {
        crat[at(a, a)] = -1.0;
    }
    let mut xnow: Vec<usize> = (0..nc).collect();
    let mut merges = Vec::with_capacity(nc.saturating_sub(1));
    for t in 0..nc.saturating_sub(1) {
        let mut best = 0;
        for (p, &v) in crat.iter().enumerate() {
            if v > crat[best] {
                best = p;
            }
        }
        let (y, x) = (best / nc, best % nc);
        let ratio = crat[best] as f32;
        for b in 0..nc {
            cc[at(y, b)] += cc[at(x, b)];
        }
        for a in 0..nc {
            cc[at(a, y)] += cc[at(a, x)];
        }
        for b in 0..nc {
            cc[at(x, b)] = -1.0;
            cc[at(b, x)] = -1.0;
        }
        for b in 0..nc {
            cneg[at(y, b)] += cneg[at(x, b)];
        }
        for a in 0..nc {
            cneg[at(a, y)] += cneg[at(a, x)];
        }
        for b in 0..nc {
            let r = cc[at(y, b)] / cneg[at(y, b)];
            crat[at(y, b)] = r;
            crat[at(b, y)] = r;
        }
        crat[at(y, y)] = -1.0;
        for b in 0..nc {
            crat[at(x, b)] = -1.0;
            crat[at(b, x)] = -1.0;
        }
        merges.push(Merge {
            x: xnow[x],
            y: xnow[y],
            ratio,
        });
        xnow[y] = nc + t;
    }
    merges
}

/// For every node (leaves 0‥nc, then merge t as node nc + t), which leaf
/// clusters it holds, as a mask over the nc leaves (Kilosort4's `my_clus`).
pub fn leaf_sets(merges: &[Merge], nc: usize) -> Vec<Vec<bool>> {
    let mut sets: Vec<Vec<bool>> = (0..nc)
        .map(|j| {
            let mut v = vec![false; nc];
            v[j] = true;
            v
        })
        .collect();
    for m in merges {
        let s: Vec<bool> = sets[m.x]
            .iter()
            .zip(&sets[m.y])
            .map(|(a, b)| *a || *b)
            .collect();
        sets.push(s);
    }
    sets
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_follow_the_largest_ratio() {
        // Three clusters: 0 and 2 strongly linked, 1 apart.
        let nc = 3;
        let cc = vec![10.0, 0.0, 8.0, 0.0, 10.0, 1.0, 8.0, 1.0, 10.0];
        let cneg = vec![1.0; 9];
        let m = find_merges(cc, cneg, nc);
        assert_eq!(m.len(), 2);
        // Row-major first maximum is (0, 2): 2 merges into 0, node 3.
        assert_eq!((m[0].x, m[0].y, m[0].ratio), (2, 0, 8.0));
        // Then cluster 1 joins node 3: the summed row's ratio 2/4 at (0, 1).
        assert_eq!((m[1].x, m[1].y), (1, 3));
        assert_eq!(m[1].ratio, 0.5);
        let sets = leaf_sets(&m, nc);
        assert_eq!(sets[3], vec![true, false, true]);
        assert_eq!(sets[4], vec![true, true, true]);
    }
}
