//! Log-linear latency histogram in microseconds, HDR-style: exact below 2,048 µs, then 1,024
//! buckets per power of two (relative error under 0.1 %). One fixed allocation at creation;
//! `record` is an index computation and an increment.

const SUB_BITS: u32 = 10;
const SUB: u64 = 1 << SUB_BITS;
/// Values above are clamped (one hour, in µs).
pub const MAX_US: u64 = 3_600_000_000;

#[inline]
fn index(v: u64) -> usize {
    if v < SUB {
        return v as usize;
    }
    let msb = 63 - v.leading_zeros();
    let shift = msb - SUB_BITS;
    ((u64::from(shift) + 1) * SUB + ((v >> shift) - SUB)) as usize
}

/// The smallest and largest values that share bucket `idx`.
fn bounds(idx: usize) -> (u64, u64) {
    let idx = idx as u64;
    if idx < 2 * SUB {
        return (idx, idx);
    }
    let shift = idx / SUB - 1;
    let low = (idx % SUB + SUB) << shift;
    (low, low + (1 << shift) - 1)
}

pub struct Histogram {
    counts: Box<[u64]>,
    total: u64,
    min: u64,
    max: u64,
    sum: u128,
}

impl Default for Histogram {
    fn default() -> Self {
        Self::new()
    }
}

impl Histogram {
    pub fn new() -> Self {
        Histogram {
            counts: vec![0; index(MAX_US) + 1].into_boxed_slice(),
            total: 0,
            min: u64::MAX,
            max: 0,
            sum: 0,
        }
    }

    #[inline]
    pub fn record(&mut self, us: u64) {
        let v = us.min(MAX_US);
        self.counts[index(v)] += 1;
        self.total += 1;
        self.min = self.min.min(v);
        self.max = self.max.max(v);
        self.sum += u128::from(v);
    }

    pub fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(other.counts.iter()) {
            *a += b;
        }
        self.total += other.total;
        self.min = self.min.min(other.min);
        self.max = self.max.max(other.max);
        self.sum += other.sum;
    }

    pub fn count(&self) -> u64 {
        self.total
    }

    pub fn max(&self) -> u64 {
        self.max
    }

    pub fn min(&self) -> u64 {
        if self.total == 0 {
            0
        } else {
            self.min
        }
    }

    pub fn mean(&self) -> f64 {
        if self.total == 0 {
            0.0
        } else {
            self.sum as f64 / self.total as f64
        }
    }

    /// The value at quantile `q` (0..=1): the largest value equivalent to the bucket holding
    /// the ceil(q * count)-th smallest sample, capped at the true maximum. 0 when empty.
    pub fn quantile(&self, q: f64) -> u64 {
        if self.total == 0 {
            return 0;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.total as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (idx, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return bounds(idx).1.min(self.max);
            }
        }
        self.max
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_exact_below_2048_and_contiguous_above() {
        for v in 0..2048 {
            assert_eq!(index(v), v as usize);
            assert_eq!(bounds(v as usize), (v, v));
        }
        let mut prev = index(2047);
        for v in 2048..300_000u64 {
            let i = index(v);
            assert!(i == prev || i == prev + 1, "gap at {v}");
            prev = i;
        }
        for v in (2048..5_000_000u64).step_by(7).chain([MAX_US - 1, MAX_US]) {
            let (lo, hi) = bounds(index(v));
            assert!(lo <= v && v <= hi, "{v} not in {lo}..={hi}");
            assert!((hi - lo) as f64 / v as f64 <= 1.0 / 1024.0);
        }
        assert!(bounds(index(MAX_US)).0 <= MAX_US);
    }

    #[test]
    fn quantiles_of_a_uniform_spread() {
        let mut h = Histogram::new();
        for v in 1..=10_000u64 {
            h.record(v);
        }
        assert_eq!(h.count(), 10_000);
        assert_eq!(h.min(), 1);
        assert_eq!(h.max(), 10_000);
        let close =
            |got: u64, want: u64| (got as f64 - want as f64).abs() <= want as f64 / 1000.0 + 1.0;
        assert!(close(h.quantile(0.5), 5_000), "{}", h.quantile(0.5));
        assert!(close(h.quantile(0.99), 9_900), "{}", h.quantile(0.99));
        assert!(close(h.quantile(0.999), 9_990), "{}", h.quantile(0.999));
        assert_eq!(h.quantile(1.0), 10_000);
        assert_eq!(h.quantile(0.0), 1);
        assert!((h.mean() - 5_000.5).abs() < 1e-9);
    }

    #[test]
    fn exact_small_values_and_outliers() {
        let mut h = Histogram::new();
        for _ in 0..990 {
            h.record(40);
        }
        for _ in 0..9 {
            h.record(900);
        }
        h.record(u64::MAX); // clamped
        assert_eq!(h.quantile(0.5), 40);
        assert_eq!(h.quantile(0.99), 40);
        assert_eq!(h.quantile(0.995), 900);
        assert_eq!(h.quantile(0.999), 900);
        assert_eq!(h.max(), MAX_US);
        assert_eq!(h.quantile(1.0), MAX_US);
    }

    #[test]
    fn empty_and_merge() {
        let mut a = Histogram::new();
        assert_eq!((a.count(), a.min(), a.max(), a.quantile(0.5)), (0, 0, 0, 0));
        let mut b = Histogram::new();
        a.record(10);
        b.record(30);
        b.record(20);
        a.merge(&b);
        assert_eq!((a.count(), a.min(), a.max()), (3, 10, 30));
        assert_eq!(a.quantile(0.5), 20);
    }
}
