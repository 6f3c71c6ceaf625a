//! A unit's gradients through a group as they travel between ranks: all-reduced in buckets or
//! reduce-scattered, in the reduce dtype on the wire.

use crate::comm::{Collective, ReduceOp};
use crate::config::ReduceDtype;
use crate::error::Result;

/// `host` (a unit's gradients as they travel: f32, or bf16 values widened) reduced over `group`
/// with `op`, bucket by bucket, in `dtype` on the wire.
pub(crate) fn reduce_host(
    group: &dyn Collective,
    mut host: Vec<f32>,
    op: ReduceOp,
    dtype: ReduceDtype,
    bucket: usize,
) -> Result<Vec<f32>> {
    match dtype {
        ReduceDtype::F32 => {
            for chunk in host.chunks_mut(bucket) {
                group.all_reduce(chunk, op)?;
            }
            Ok(host)
        }
        ReduceDtype::Bf16 => {
            let mut half: Vec<burn::tensor::bf16> = host
                .iter()
                .map(|x| burn::tensor::bf16::from_f32(*x))
                .collect();
            drop(host);
            for chunk in half.chunks_mut(bucket) {
                group.all_reduce_bf16(chunk, op)?;
            }
            Ok(half.into_iter().map(|x| x.to_f32()).collect())
        }
    }
}

/// The rank's piece of the mean over `group` of `host` (a unit's gradients as they travel),
/// as the reduce dtype gives it: with bf16, the exact sum rounded once, as an all-reduce in
/// bf16 would.
pub(crate) fn scatter_host(
    group: &dyn Collective,
    host: &[f32],
    dtype: ReduceDtype,
) -> Result<Vec<f32>> {
    match dtype {
        ReduceDtype::F32 => group.reduce_scatter(host, ReduceOp::Mean),
        ReduceDtype::Bf16 => {
            // The values travel as bf16 already: narrowing them is exact.
            let half: Vec<burn::tensor::bf16> = host
                .iter()
                .map(|x| burn::tensor::bf16::from_f32(*x))
                .collect();
            let piece = group.reduce_scatter_bf16(&half, ReduceOp::Mean)?;
            Ok(piece.into_iter().map(|x| x.to_f32()).collect())
        }
    }
}
