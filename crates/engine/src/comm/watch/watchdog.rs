//! The process's watchdog thread, and [`watched`], which wraps the ranks' groups for it.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::recorder::Recorder;
use super::remote::Remote;
use super::shared::{Shared, WatchConfig};
use super::watched::Watched;
use crate::comm::collective::Collective;

/// The process's watchdog thread (stopped when dropped) and what it watches.
pub struct Watchdog {
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watchdog {
    /// The recorder of this process's `local`-th rank.
    pub fn recorder(&self, local: usize) -> Arc<Recorder> {
        self.shared.recorders[local].clone()
    }

    /// When and why the run began to fail, if it did.
    pub fn failed(&self) -> Option<(Duration, String)> {
        self.shared
            .failed
            .get()
            .map(|(t, why)| (t.elapsed(), why.clone()))
    }

    /// Notes that the run fails for `reason` (writing the flight records once).
    pub fn fail(&self, reason: &str) {
        self.shared.fail(reason);
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

/// Wraps each of this process's rank groups `comms` (the world, one per device thread) in a
/// [`Watched`] group, and starts the watchdog. With no deadline, no flight entries and no
/// checks there is nothing to watch: the groups are returned as they are and no thread starts.
pub fn watched(
    comms: Vec<Box<dyn Collective>>,
    config: WatchConfig,
    remote: Option<Box<dyn Remote>>,
) -> (Vec<Box<dyn Collective>>, Watchdog) {
    let recorders: Vec<Arc<Recorder>> = comms
        .iter()
        .map(|c| Arc::new(Recorder::new(c.rank(), config.entries)))
        .collect();
    let off = config.timeout.is_none() && config.entries == 0 && !config.check;
    let (plain, roots): (_, Vec<Arc<dyn Collective>>) = if off {
        (Some(comms), Vec::new())
    } else {
        (None, comms.into_iter().map(Arc::from).collect())
    };
    let shared = Arc::new(Shared::new(config, recorders, roots.clone(), off, remote));
    if let Some(comms) = plain {
        let watchdog = Watchdog {
            shared,
            thread: None,
        };
        return (comms, watchdog);
    }
    let groups = roots
        .into_iter()
        .enumerate()
        .map(|(local, inner)| {
            Box::new(Watched::root(
                inner,
                shared.recorders[local].clone(),
                shared.clone(),
            )) as Box<dyn Collective>
        })
        .collect();
    let watching = shared.clone();
    let thread = std::thread::Builder::new()
        .name("kiln-watchdog".into())
        .spawn(move || {
            while !watching.stop.load(Ordering::SeqCst) {
                watching.look();
                // Woken early when the watchdog is dropped.
                std::thread::park_timeout(Duration::from_millis(100));
            }
        })
        .expect("spawn the watchdog thread");
    (
        groups,
        Watchdog {
            shared,
            thread: Some(thread),
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::ReduceOp;
    use crate::comm::world_group;
    use std::time::Instant;

    /// Runs `body(rank, group)` on a watched in-process group of `n` ranks, one thread each.
    fn on_ranks<T: Send>(
        n: usize,
        config: WatchConfig,
        body: impl Fn(usize, &dyn Collective) -> T + Sync,
    ) -> Vec<T> {
        let (groups, _watchdog) = watched(world_group(n).unwrap(), config, None);
        std::thread::scope(|s| {
            let handles: Vec<_> = groups
                .iter()
                .enumerate()
                .map(|(r, g)| {
                    let body = &body;
                    s.spawn(move || body(r, &**g))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn mismatched_collectives_are_one_line_error_naming_both_ranks() {
        let config = WatchConfig {
            check: true,
            ..WatchConfig::default()
        };
        let outcomes = on_ranks(2, config, |rank, g| {
            g.all_reduce(&mut [1.0; 4], ReduceOp::Sum)?;
            // The second collective differs in size between the ranks.
            let mut data = vec![1.0; 3 + 2 * rank];
            g.all_reduce(&mut data, ReduceOp::Sum)
        });
        for (rank, outcome) in outcomes.into_iter().enumerate() {
            let message = outcome.unwrap_err().to_string();
            assert_eq!(message.lines().count(), 1, "{message}");
            let other = 1 - rank;
            let (mine, theirs) = if rank == 0 { (3, 5) } else { (5, 3) };
            assert!(
                message.contains(&format!("rank {rank} runs all_reduce #1 of {mine} f32")),
                "{message}"
            );
            assert!(
                message.contains(&format!("rank {other} runs #1 of {theirs} elements")),
                "{message}"
            );
            assert!(message.contains("differ in elements"), "{message}");
        }
    }

    #[test]
    fn the_same_collectives_pass_the_check() {
        let config = WatchConfig {
            check: true,
            ..WatchConfig::default()
        };
        let sums = on_ranks(3, config, |rank, g| {
            let mut data = vec![rank as f32; 5];
            g.all_reduce(&mut data, ReduceOp::Sum).unwrap();
            let gathered = g.all_gather(&vec![1.0; rank + 1]).unwrap();
            (data[0], gathered.len())
        });
        assert_eq!(sums, vec![(3.0, 6); 3]);
    }

    #[test]
    fn a_rank_that_never_arrives_ends_the_collective_at_its_deadline_naming_it() {
        let dir = std::env::temp_dir().join(format!("kiln-watch-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let config = WatchConfig {
            timeout: Some(Duration::from_millis(300)),
            entries: 16,
            flight_dir: Some(dir.clone()),
            ..WatchConfig::default()
        };
        let started = Instant::now();
        let outcomes = on_ranks(2, config, |rank, g| {
            g.barrier()?;
            if rank == 1 {
                // Rank 1 stays away from the next collective past the deadline.
                std::thread::sleep(Duration::from_millis(1500));
                return Ok(());
            }
            g.all_reduce(&mut [1.0; 7], ReduceOp::Sum)
        });
        let took = started.elapsed();
        let message = outcomes[0].as_ref().unwrap_err().to_string();
        assert!(took < Duration::from_secs(3), "took {took:?}");
        assert_eq!(message.lines().count(), 1, "{message}");
        assert!(
            message.contains("all_reduce #1 of world (7 f32)"),
            "{message}"
        );
        assert!(message.contains("rank 1 ("), "{message}");
        for rank in 0..2 {
            let text = std::fs::read_to_string(dir.join(format!("rank-{rank}.jsonl"))).unwrap();
            assert!(text.lines().count() >= 2, "{text}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
