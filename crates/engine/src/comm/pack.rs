//! Values that are not floats, carried exactly through the `f32` collectives: every rank's
//! vector of any length, every rank's text, every rank's counts.

use super::collective::Collective;
use crate::error::Result;

/// Every rank's `mine`, whatever its length, in rank order.
pub fn gather_ragged(comm: &dyn Collective, mine: &[f32]) -> Result<Vec<Vec<f32>>> {
    // Lengths travel as f32, exact up to 2^24 elements.
    let lengths = comm.all_gather(&[mine.len() as f32])?;
    let all = comm.all_gather(mine)?;
    let mut at = 0;
    Ok(lengths
        .iter()
        .map(|len| {
            let part = all[at..at + *len as usize].to_vec();
            at += *len as usize;
            part
        })
        .collect())
}

/// Every rank's `text`, in rank order (each byte one element).
pub fn gather_text(comm: &dyn Collective, text: &str) -> Result<Vec<String>> {
    if comm.world_size() == 1 {
        return Ok(vec![text.to_string()]);
    }
    let mine: Vec<f32> = text.bytes().map(f32::from).collect();
    Ok(gather_ragged(comm, &mine)?
        .into_iter()
        .map(|bytes| {
            let bytes: Vec<u8> = bytes.into_iter().map(|b| b as u8).collect();
            String::from_utf8_lossy(&bytes).into_owned()
        })
        .collect())
}

/// Every rank's `counts` (the same number on every rank), in rank order, each carried exactly
/// in three 20-bit parts.
pub fn gather_counts(comm: &dyn Collective, counts: &[u64]) -> Result<Vec<Vec<u64>>> {
    let mine: Vec<f32> = counts
        .iter()
        .flat_map(|&c| {
            [
                (c >> 40) as f32,
                ((c >> 20) & 0xf_ffff) as f32,
                (c & 0xf_ffff) as f32,
            ]
        })
        .collect();
    let all = comm.all_gather(&mine)?;
    Ok(all
        .chunks(mine.len().max(1))
        .map(|rank| {
            rank.chunks(3)
                .map(|v| ((v[0] as u64) << 40) | ((v[1] as u64) << 20) | v[2] as u64)
                .collect()
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::local_group;

    #[test]
    fn text_counts_and_ragged_vectors_arrive_whole() {
        let group = local_group(3);
        let results: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = group
                .iter()
                .map(|comm| {
                    s.spawn(move || {
                        let r = comm.rank();
                        let text = gather_text(comm, &"é".repeat(r)).unwrap();
                        let counts =
                            gather_counts(comm, &[u64::MAX, r as u64 + (1 << 50)]).unwrap();
                        let ragged = gather_ragged(comm, &vec![r as f32; r]).unwrap();
                        (text, counts, ragged)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (text, counts, ragged) in results {
            assert_eq!(text, vec!["", "é", "éé"]);
            assert_eq!(counts[2], vec![u64::MAX, 2 + (1 << 50)]);
            assert_eq!(ragged, vec![vec![], vec![1.0], vec![2.0, 2.0]]);
        }
    }
}
