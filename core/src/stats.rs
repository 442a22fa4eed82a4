//! Summary statistics of timing samples, shared by the CLI, the benchmarks and the examples so
//! that their reported figures agree.

/// Median of a sample; 0 for an empty one. An even count gives the mean of the two middle
/// values (so `[1, 2, 3, 4]` gives 2.5), the usual convention, not the upper or lower middle.
/// Values are ordered by `f64::total_cmp` (a NaN sorts above every number).
pub fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::median;

    #[test]
    fn median_of_odd_even_and_empty_samples() {
        assert_eq!(median(vec![]), 0.0);
        assert_eq!(median(vec![7.0]), 7.0);
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(vec![5.0, 1.0]), 3.0);
    }
}
