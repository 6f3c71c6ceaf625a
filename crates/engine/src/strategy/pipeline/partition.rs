//! Where a pipeline cuts the block stack.

use crate::error::{Error, Result};

/// The block boundaries of `stages` stages over blocks of the given `weights`: `cuts[s]` is
/// the first block of stage `s` and `cuts[stages]` the number of blocks. With `given` (the
/// first block of every stage but the first) those are checked and used; otherwise the
/// contiguous cut whose heaviest stage is lightest.
pub fn cuts(weights: &[usize], stages: usize, given: Option<&[usize]>) -> Result<Vec<usize>> {
    let n = weights.len();
    if stages == 0 || stages > n {
        return Err(Error::config(format!(
            "key `pipeline.stages`: {stages} stages need at least one block each, and the model \
             has {n}"
        )));
    }
    if let Some(given) = given {
        let bad = given.len() + 1 != stages
            || given.first() == Some(&0)
            || given.windows(2).any(|w| w[0] >= w[1])
            || given.last().is_some_and(|&c| c >= n);
        if bad {
            return Err(Error::config(format!(
                "key `pipeline.cuts`: expected {} increasing block indices in 1..{n} (the first \
                 block of every stage but the first), got {given:?}",
                stages - 1
            )));
        }
        let mut out = vec![0];
        out.extend_from_slice(given);
        out.push(n);
        return Ok(out);
    }
    // best[k][i]: the lightest heaviest stage when the first i blocks form k stages.
    let prefix: Vec<usize> = std::iter::once(0)
        .chain(weights.iter().scan(0, |acc, w| {
            *acc += w;
            Some(*acc)
        }))
        .collect();
    let inf = usize::MAX;
    let mut best = vec![vec![inf; n + 1]; stages + 1];
    let mut from = vec![vec![0; n + 1]; stages + 1];
    best[0][0] = 0;
    for k in 1..=stages {
        for i in k..=n {
            for j in (k - 1)..i {
                if best[k - 1][j] == inf {
                    continue;
                }
                let cost = best[k - 1][j].max(prefix[i] - prefix[j]);
                if cost < best[k][i] {
                    best[k][i] = cost;
                    from[k][i] = j;
                }
            }
        }
    }
    let mut out = vec![n];
    let mut i = n;
    for k in (1..=stages).rev() {
        i = from[k][i];
        out.push(i);
    }
    out.reverse();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balanced_cuts_minimise_the_heaviest_stage() {
        assert_eq!(cuts(&[1, 1, 1, 1], 2, None).unwrap(), vec![0, 2, 4]);
        assert_eq!(cuts(&[1, 1, 1, 1], 4, None).unwrap(), vec![0, 1, 2, 3, 4]);
        assert_eq!(cuts(&[5, 1, 1, 1, 1, 1], 2, None).unwrap(), vec![0, 1, 6]);
        assert_eq!(cuts(&[3], 1, None).unwrap(), vec![0, 1]);
        assert_eq!(cuts(&[1, 1, 1], 2, Some(&[1])).unwrap(), vec![0, 1, 3]);
        assert!(cuts(&[1, 1], 3, None).is_err());
        for bad in [&[0][..], &[3], &[2, 1]] {
            let e = cuts(&[1, 1, 1], 2, Some(bad)).unwrap_err().to_string();
            assert!(e.contains("pipeline.cuts"), "{e}");
        }
    }
}
