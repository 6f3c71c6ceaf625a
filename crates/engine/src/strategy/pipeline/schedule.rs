//! The order in which a stage runs its micro-batches, and a check of any recorded order.

use crate::config::PipelineSchedule;

/// One unit of a stage's work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// The forward of micro-batch `m`.
    Forward(usize),
    /// The backward of micro-batch `m`.
    Backward(usize),
}

/// Stage `stage`'s order of `micro` micro-batches' forwards and backwards in a pipeline of
/// `stages` stages. GPipe: every forward, then every backward. 1F1B (PipeDream-flush):
/// `stages − 1 − stage` forwards to warm up, then one forward and one backward in turn, then
/// the remaining backwards. Backwards run in micro-batch order in both.
pub fn ops(kind: PipelineSchedule, stages: usize, stage: usize, micro: usize) -> Vec<Op> {
    let mut out = Vec::with_capacity(2 * micro);
    match kind {
        PipelineSchedule::Gpipe => {
            out.extend((0..micro).map(Op::Forward));
            out.extend((0..micro).map(Op::Backward));
        }
        PipelineSchedule::OneFOneB => {
            let warm = (stages - 1 - stage).min(micro);
            out.extend((0..warm).map(Op::Forward));
            for m in 0..micro - warm {
                out.push(Op::Forward(warm + m));
                out.push(Op::Backward(m));
            }
            out.extend((micro - warm..micro).map(Op::Backward));
        }
    }
    out
}

/// Checks that `orders` (one per stage) can run as a pipeline of `micro` micro-batches: every
/// micro-batch's forward and backward once on every stage, a forward on stage s after the
/// same forward on stage s − 1, a backward after its own stage's forward and after the same
/// backward on stage s + 1, and no stage waiting for ever. Returns, per stage, the most
/// micro-batches whose forward had run and whose backward had not (activations held).
pub fn check(orders: &[Vec<Op>], micro: usize) -> Result<Vec<usize>, String> {
    let stages = orders.len();
    for (s, order) in orders.iter().enumerate() {
        for m in 0..micro {
            for op in [Op::Forward(m), Op::Backward(m)] {
                let n = order.iter().filter(|o| **o == op).count();
                if n != 1 {
                    return Err(format!("stage {s} runs {op:?} {n} times"));
                }
            }
        }
        if order.len() != 2 * micro {
            return Err(format!("stage {s} runs {} operations", order.len()));
        }
    }
    let mut forward_done = vec![vec![false; micro]; stages];
    let mut backward_done = vec![vec![false; micro]; stages];
    let mut next = vec![0; stages];
    let mut held = vec![0usize; stages];
    let mut most = vec![0usize; stages];
    loop {
        let mut progressed = false;
        for s in 0..stages {
            let Some(&op) = orders[s].get(next[s]) else {
                continue;
            };
            let ready = match op {
                Op::Forward(m) => s == 0 || forward_done[s - 1][m],
                Op::Backward(m) => {
                    forward_done[s][m] && (s + 1 == stages || backward_done[s + 1][m])
                }
            };
            if !ready {
                continue;
            }
            match op {
                Op::Forward(m) => {
                    forward_done[s][m] = true;
                    held[s] += 1;
                    most[s] = most[s].max(held[s]);
                }
                Op::Backward(m) => {
                    backward_done[s][m] = true;
                    held[s] -= 1;
                }
            }
            next[s] += 1;
            progressed = true;
        }
        if !progressed {
            break;
        }
    }
    if let Some(s) = (0..stages).find(|&s| next[s] < orders[s].len()) {
        return Err(format!(
            "stage {s} waits for ever at {:?}",
            orders[s][next[s]]
        ));
    }
    Ok(most)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_schedules_are_valid_and_1f1b_holds_at_most_k_micro_batches() {
        for stages in 1..=4 {
            for micro in [1, 2, 3, 4, 8] {
                let gpipe: Vec<_> = (0..stages)
                    .map(|s| ops(PipelineSchedule::Gpipe, stages, s, micro))
                    .collect();
                let held = check(&gpipe, micro).unwrap();
                assert!(held.iter().all(|h| *h == micro), "{held:?}");
                let one: Vec<_> = (0..stages)
                    .map(|s| ops(PipelineSchedule::OneFOneB, stages, s, micro))
                    .collect();
                let held = check(&one, micro).unwrap();
                for (s, h) in held.iter().enumerate() {
                    assert!(*h <= stages - s && *h <= micro, "stage {s}: {h}");
                }
            }
        }
    }

    #[test]
    fn invalid_orders_are_caught() {
        let f = Op::Forward;
        let b = Op::Backward;
        // A backward before its forward.
        assert!(check(&[vec![b(0), f(0)]], 1).is_err());
        // Stage 0 backs micro-batch 1 first while stage 1 backs 0 first: stage 0 then waits
        // for stage 1's backward of 1, which waits behind its backward of 0 — fine; but
        // swapped forwards deadlock.
        assert!(
            check(
                &[vec![f(1), f(0), b(0), b(1)], vec![f(0), f(1), b(0), b(1)]],
                2
            )
            .is_ok()
        );
        assert!(
            check(
                &[vec![f(0), b(0), f(1), b(1)], vec![f(1), f(0), b(0), b(1)]],
                2
            )
            .is_err()
        );
        // A micro-batch run twice.
        assert!(check(&[vec![f(0), f(0), b(0), b(1)]], 2).is_err());
    }
}
