//! The input checks of one row as a scan fed its samples in column order, in
//! any number of pieces. `check_rows` feeds each row of a window in one
//! piece. (Feeding each block to the scans inside the int16 reader, while
//! the block is in cache, was measured 2.7 times slower on the 16-core
//! machine than reading and then checking, so the reader does not.)
//!
//! What a scan finds, whatever the pieces ([`super::stuck_runs`] is a scan of
//! the real columns): the maximal runs of at
//! least `min_run` identical values at the row's extremes over the real
//! columns; over the own columns whether any value is non-zero, whether all
//! have the first one's bits, and the row's hash key.
//!
//! **The hash key.** The own columns are cut into hash pieces of
//! [`HASH_PIECE`] columns from the first own column. Within a piece, each
//! value has a 16-bit code (its int16 value; 0x8000 for a value that is not
//! an int16 one, which also goes with its place into a separate float lane);
//! the codes of samples 4q .. 4q + 3 (from the piece's start) make one 64-bit
//! word, word q goes into lane q mod 4, each lane an FNV-style chain (xor,
//! then multiply) from the basis. A closed piece adds a mix of its lanes, its
//! float lane, its index and its length to the window's key (a sum over the
//! pieces). Equal rows have equal keys; int16 and
//! f32 rows of the same values too. An int16 row costs one multiply per four
//! samples.

use super::{ROW_HASH_BASIS, ROW_HASH_PRIME, RawSample};

/// Own columns per hash piece.
pub const HASH_PIECE: usize = 1024;

/// The columns a [`RowScan`] works on (window columns).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScanColumns {
    /// First real column (stuck runs are looked for in `lo..hi`).
    pub lo: usize,
    /// End of the real columns.
    pub hi: usize,
    /// The own columns (channel facts and the hash key); empty for none.
    pub own: (usize, usize),
    /// Shortest stuck run, samples ([`super::stuck_min_run`]).
    pub min_run: usize,
}

impl ScanColumns {
    /// The column where a scan of a whole row starts.
    pub fn first(&self) -> usize {
        if self.own.1 > self.own.0 {
            self.lo.min(self.own.0)
        } else {
            self.lo
        }
    }

    /// The column where a scan of a whole row ends.
    pub fn end(&self) -> usize {
        if self.own.1 > self.own.0 {
            self.hi.max(self.own.1)
        } else {
            self.hi
        }
    }
}

/// The checks' running state of one row over the columns fed so far (module
/// docs). Made with [`RowScan::new`], fed with [`RowScan::feed`], read with
/// [`RowScan::finish`].
#[derive(Debug, Clone)]
pub struct RowScan<T> {
    cols: ScanColumns,
    /// Next column to feed.
    col: usize,
    /// First and end real column fed.
    real: Option<(usize, usize)>,
    /// The run of real values that reaches the last column fed (start
    /// column, value).
    open: Option<(usize, T)>,
    /// Ended runs of at least `min_run` (start, end, value).
    runs: Vec<(usize, usize, T)>,
    /// The first own value, and whether every own value has its bits.
    own_first: Option<T>,
    all_first: bool,
    any_nonzero: bool,
    /// Lanes of the hash piece being fed, and its columns so far.
    lanes: [u64; 4],
    piece_len: usize,
    /// The codes of the piece's last quad so far (`piece_len % 4` of them).
    pending: u64,
    /// The chain of the piece's values that are not int16 (f32 rows only).
    float_lane: u64,
    /// Sum of the closed pieces' mixes.
    key: [u64; 4],
}

/// What a finished scan found (the runs are given separately).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowFacts {
    /// Whether any own value is non-zero (−0.0 counts as zero).
    pub any_nonzero: bool,
    /// Whether every own value has the first one's bits.
    pub all_first: bool,
    /// The row's hash key over the own columns.
    pub key: [u64; 4],
}

/// A 64-bit finaliser (xor-shift, multiply; the constants of SplitMix64).
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl<T: RawSample> RowScan<T> {
    /// An empty scan whose first column will be `col`.
    pub fn new(cols: ScanColumns, col: usize) -> Self {
        RowScan {
            cols,
            col,
            real: None,
            open: None,
            runs: Vec::new(),
            own_first: None,
            all_first: true,
            any_nonzero: false,
            lanes: [ROW_HASH_BASIS; 4],
            piece_len: 0,
            pending: 0,
            float_lane: ROW_HASH_BASIS,
            key: [0; 4],
        }
    }

    /// The next column to feed.
    pub fn next_column(&self) -> usize {
        self.col
    }

    /// Feeds the values of columns `next_column() ..` (`values[0]` is that
    /// column's).
    pub fn feed(&mut self, values: &[T]) {
        let c0 = self.col;
        let c1 = c0 + values.len();
        let (lo, hi) = (self.cols.lo.max(c0), self.cols.hi.min(c1));
        if hi > lo {
            self.feed_real(&values[lo - c0..hi - c0], lo);
        }
        let (a, b) = (self.cols.own.0.max(c0), self.cols.own.1.min(c1));
        let mut c = a;
        while c < b {
            // To the end of the hash piece holding column c.
            let piece_end = self.cols.own.0 + ((c - self.cols.own.0) / HASH_PIECE + 1) * HASH_PIECE;
            let e = piece_end.min(b);
            self.feed_own(&values[c - c0..e - c0]);
            if e == piece_end || e == self.cols.own.1 {
                self.close_piece(e);
            }
            c = e;
        }
        self.col = c1;
    }

    /// Ends the run from `start` to `end` of `v`: kept when long enough.
    fn end_run(&mut self, start: usize, end: usize, v: T) {
        if end - start >= self.cols.min_run {
            self.runs.push((start, end, v));
        }
    }

    /// The stuck-run part of [`RowScan::feed`]: real values of columns `c0 ..`.
    fn feed_real(&mut self, s: &[T], c0: usize) {
        let n = s.len();
        let (start, v) = match self.open {
            Some(o) => o,
            None => {
                self.real = Some((c0, c0));
                (c0, s[0])
            }
        };
        self.real = self.real.map(|(a, _)| (a, c0 + n));
        // The first value fed is in the first run (even a NaN).
        let mut i = usize::from(self.open.is_none());
        while i < n && s[i] == v {
            i += 1;
        }
        if i == n {
            self.open = Some((start, v));
            return;
        }
        self.end_run(start, c0 + i, v);
        // s[i] starts a run. Runs of at least min_run ≥ 2h inside hold two
        // equal samples h apart at a multiple of h, so only those places are
        // looked at first (a healthy row costs a strided pass over 1/h of its
        // samples); the run reaching the end stays open.
        let rest = &s[i..];
        let base = c0 + i;
        let h = (self.cols.min_run / 2).max(1);
        let mut tail = None;
        let mut m = 0;
        while m + h < rest.len() {
            let v = rest[m];
            if rest[m + h] != v || !rest[m + 1..m + h].iter().all(|&u| u == v) {
                m += h;
                continue;
            }
            let mut a = m;
            while a > 0 && rest[a - 1] == v {
                a -= 1;
            }
            let mut b = m + h + 1;
            while b < rest.len() && rest[b] == v {
                b += 1;
            }
            if b == rest.len() {
                tail = Some(a);
                break;
            }
            self.end_run(base + a, base + b, v);
            m = b.div_ceil(h) * h;
        }
        let k = tail.unwrap_or_else(|| {
            let t = rest[rest.len() - 1];
            let mut k = rest.len() - 1;
            while k > 0 && rest[k - 1] == t {
                k -= 1;
            }
            k
        });
        self.open = Some((base + k, rest[k]));
    }

    /// The own part of [`RowScan::feed`]: values within one hash piece.
    fn feed_own(&mut self, own: &[T]) {
        if own.is_empty() {
            return;
        }
        let first = *self.own_first.get_or_insert(own[0]);
        let mut any_nonzero = self.any_nonzero;
        let mut all_first = self.all_first;
        for &v in own {
            any_nonzero |= !v.is_zero();
            all_first &= v.same_bits(first);
        }
        self.any_nonzero = any_nonzero;
        self.all_first = all_first;
        // One value at a time up to the start of a lane cycle (16 values: a
        // quad per lane), then whole cycles, then the rest.
        let mut i = 0;
        while i < own.len() && !self.piece_len.is_multiple_of(16) {
            self.push_code(own[i]);
            i += 1;
        }
        let mut cycles = own[i..].chunks_exact(16);
        for c in &mut cycles {
            let mut codes = [0u16; 16];
            let mut whole = true;
            for (code, &v) in codes.iter_mut().zip(c) {
                let (k, exact) = v.code16_exact();
                *code = k;
                whole &= exact;
            }
            let mut words = [0u64; 4];
            for (w, q) in words.iter_mut().zip(codes.chunks_exact(4)) {
                *w = q
                    .iter()
                    .enumerate()
                    .fold(0, |w, (k, &code)| w | u64::from(code) << (16 * k));
            }
            if !whole {
                for &v in c {
                    self.push_code(v);
                }
                continue;
            }
            for (lane, w) in self.lanes.iter_mut().zip(words) {
                *lane = (*lane ^ w).wrapping_mul(ROW_HASH_PRIME);
            }
            self.piece_len += 16;
        }
        for &v in cycles.remainder() {
            self.push_code(v);
        }
    }

    /// Adds one own value to the piece: its 16-bit code into the pending
    /// quad ([`RawSample::code16`]; a value that is not int16 gets code
    /// 0x8000 and goes into the float lane with its place), the quad into
    /// its lane once whole.
    fn push_code(&mut self, v: T) {
        let j = self.piece_len;
        let code = v.code16().unwrap_or_else(|| {
            let bits = u64::from(v.to_f32().to_bits()) | ((j as u64) << 32);
            self.float_lane = (self.float_lane ^ bits).wrapping_mul(ROW_HASH_PRIME);
            0x8000
        });
        self.pending |= u64::from(code) << (16 * (j % 4));
        self.piece_len += 1;
        if j % 4 == 3 {
            let lane = (j / 4) % 4;
            self.lanes[lane] = (self.lanes[lane] ^ self.pending).wrapping_mul(ROW_HASH_PRIME);
            self.pending = 0;
        }
    }

    /// Adds the piece ending at column `end` to the key.
    fn close_piece(&mut self, end: usize) {
        if self.piece_len == 0 {
            return;
        }
        if !self.piece_len.is_multiple_of(4) {
            let lane = (self.piece_len / 4) % 4;
            self.lanes[lane] = (self.lanes[lane] ^ self.pending).wrapping_mul(ROW_HASH_PRIME);
        }
        let index = ((end - self.piece_len - self.cols.own.0) / HASH_PIECE) as u64;
        let tag = mix64((index << 20) ^ self.piece_len as u64);
        for k in 0..4 {
            let m = mix64(self.lanes[k] ^ tag.rotate_left(16 * k as u32));
            self.key[k] = self.key[k].wrapping_add(m);
        }
        self.key[0] = self.key[0].wrapping_add(mix64(self.float_lane ^ !tag));
        self.lanes = [ROW_HASH_BASIS; 4];
        self.piece_len = 0;
        self.pending = 0;
        self.float_lane = ROW_HASH_BASIS;
    }

    /// The stuck runs (half-open column ranges, in order) and the own
    /// columns' facts, once every column has been fed; `row` holds the
    /// row's values from column 0 (the extremes are looked up there only
    /// when a run is long enough).
    pub fn finish(mut self, row: &[T]) -> (Vec<(usize, usize)>, RowFacts) {
        let end = self.cols.own.1;
        if self.col >= end {
            self.close_piece(end);
        }
        let facts = RowFacts {
            any_nonzero: self.any_nonzero,
            all_first: self.all_first,
            key: self.key,
        };
        let Some((s0, s1)) = self.real else {
            return (Vec::new(), facts);
        };
        let mut all = self.runs;
        if let Some((st, v)) = self.open
            && s1 - st >= self.cols.min_run
        {
            all.push((st, s1, v));
        }
        if all.is_empty() {
            return (Vec::new(), facts);
        }
        let seg = &row[s0..s1];
        let (mut mn, mut mx) = (seg[0], seg[0]);
        for &v in seg {
            mn = mn.min_of(v);
            mx = mx.max_of(v);
        }
        if mn == mx {
            return (Vec::new(), facts);
        }
        let runs = all
            .into_iter()
            .filter(|&(_, _, v)| v == mn || v == mx)
            .map(|(a, b, _)| (a, b))
            .collect();
        (runs, facts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rng(seed: u64) -> impl FnMut() -> u64 {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        }
    }

    /// A row of few levels with planted constant stretches (at extremes and
    /// not), some across any cut.
    fn row(next: &mut impl FnMut() -> u64, n: usize) -> Vec<i16> {
        let levels = 2 + next() % 6;
        let mut row: Vec<i16> = (0..n).map(|_| (next() % levels) as i16).collect();
        for _ in 0..(next() % 5) {
            let a = (next() % n as u64) as usize;
            let len = (next() % 3000) as usize;
            let v = [-5, 99, 1, 0][(next() % 4) as usize];
            for x in row.iter_mut().skip(a).take(len) {
                *x = v;
            }
        }
        row
    }

    /// Feeds `row[first..end]` to one scan in pieces cut at `cuts` (columns).
    fn scan_in_pieces<T: RawSample>(row: &[T], cols: ScanColumns, cuts: &[usize]) -> RowScan<T> {
        let (first, end) = (cols.first(), cols.end());
        let mut bounds: Vec<usize> = cuts
            .iter()
            .copied()
            .filter(|&c| c > first && c < end)
            .collect();
        bounds.sort_unstable();
        bounds.dedup();
        bounds.insert(0, first);
        bounds.push(end);
        let mut all = RowScan::new(cols, first);
        for w in bounds.windows(2) {
            all.feed(&row[w[0]..w[1]]);
        }
        all
    }

    /// The runs and the facts are those of their definitions, whatever the pieces fed, for int16 and f32 rows; the key
    /// is the same for the same values, and differs when one own value
    /// differs.
    #[test]
    fn scans_in_pieces_equal_one_scan_and_the_definitions() {
        let mut next = rng(11);
        for case in 0..300 {
            let n = 40 + (next() % 9000) as usize;
            let x = row(&mut next, n);
            let xf: Vec<f32> = x.iter().map(|&v| f32::from(v)).collect();
            let lo = (next() % 70) as usize % n;
            let hi = (lo + (next() % n as u64) as usize).min(n);
            let o0 = (next() % 100) as usize % n;
            let o1 = (o0 + (next() % n as u64) as usize).min(n);
            for min_run in [8, 9, 30, 31] {
                let cols = ScanColumns {
                    lo,
                    hi,
                    own: (o0, o1),
                    min_run,
                };
                let want_runs: Vec<(usize, usize)> =
                    super::super::tests::naive(&x[lo..hi], min_run)
                        .into_iter()
                        .map(|(a, b)| (lo + a, lo + b))
                        .collect();
                let own = &x[o0..o1];
                let want_nonzero = own.iter().any(|&v| v != 0);
                let want_all = own.iter().all(|&v| v == own.first().copied().unwrap_or(0));
                let one = scan_in_pieces(&x, cols, &[]);
                let (runs, facts) = one.finish(&x);
                assert_eq!(runs, want_runs, "case {case}, min_run {min_run}");
                assert_eq!(facts.any_nonzero, want_nonzero, "case {case}");
                assert_eq!(facts.all_first, want_all, "case {case}");
                // Fed in random pieces, and cut at every hash piece start.
                let mut cuts: Vec<usize> = (0..(next() % 12))
                    .map(|_| (next() % n as u64) as usize)
                    .collect();
                let fed = scan_in_pieces(&x, cols, &cuts).finish(&x);
                assert_eq!(fed, (runs.clone(), facts), "case {case}: fed in pieces");
                let fed32 = scan_in_pieces(&xf, cols, &cuts).finish(&xf);
                assert_eq!(fed32, (runs.clone(), facts), "case {case}: f32");
                // Values that are not int16 (the float lane), fed in pieces.
                let xg: Vec<f32> = xf
                    .iter()
                    .enumerate()
                    .map(|(j, &v)| if j % 29 == 3 { v + 0.25 } else { v })
                    .collect();
                let g1 = scan_in_pieces(&xg, cols, &[]).finish(&xg);
                let g2 = scan_in_pieces(&xg, cols, &cuts).finish(&xg);
                assert_eq!(g1, g2, "case {case}: f32 not int16, fed in pieces");
                cuts.extend((o0..o1).step_by(HASH_PIECE));
                let at_pieces = scan_in_pieces(&x, cols, &cuts).finish(&x);
                assert_eq!(at_pieces, (runs.clone(), facts), "case {case}: at pieces");
                if o1 > o0 {
                    let mut y = x.clone();
                    let j = o0 + (next() % (o1 - o0) as u64) as usize;
                    y[j] = y[j].wrapping_add(1 + (next() % 100) as i16);
                    let (_, other) = scan_in_pieces(&y, cols, &cuts).finish(&y);
                    assert_ne!(other.key, facts.key, "case {case}: one value changed");
                }
            }
        }
    }

    /// Rows that differ only in the order of two hash pieces, or by a
    /// value moved between lanes, get other keys.
    #[test]
    fn keys_see_order() {
        let n = 3 * HASH_PIECE;
        let cols = ScanColumns {
            lo: 0,
            hi: n,
            own: (0, n),
            min_run: 8,
        };
        let a: Vec<i16> = (0..n).map(|j| (j % 97) as i16).collect();
        let mut b = a[HASH_PIECE..2 * HASH_PIECE].to_vec();
        b.extend_from_slice(&a[..HASH_PIECE]);
        b.extend_from_slice(&a[2 * HASH_PIECE..]);
        let mut c = a.clone();
        c.swap(5, 6);
        let key = |x: &[i16]| scan_in_pieces(x, cols, &[]).finish(x).1.key;
        assert_ne!(key(&a), key(&b));
        assert_ne!(key(&a), key(&c));
    }
}
