//! The world of a run: MPI started when several processes run, the world group of this
//! process's device threads, and what the processes agree on.

use super::collective::Collective;
use super::local::local_group;
#[cfg(feature = "mpi")]
use super::mpi;
use super::processes::Processes;
use super::watch;
use crate::error::Result;

/// Starts what several processes need (MPI, with the `mpi` feature) and returns a guard to
/// keep until the run is over. Without the feature, several processes are refused with the
/// way to build kiln for them.
pub fn start(processes: Processes) -> Result<Option<Box<dyn std::any::Any>>> {
    if processes.count <= 1 {
        return Ok(None);
    }
    #[cfg(feature = "mpi")]
    {
        Ok(mpi::init(processes)?.map(|g| Box::new(g) as Box<dyn std::any::Any>))
    }
    #[cfg(not(feature = "mpi"))]
    {
        Err(crate::error::Error::Device(format!(
            "this train runs as process {} of {} under a launcher (mpirun/srun), but it was \
             built without the `mpi` feature; build it with `cargo build --release --features \
             kiln/mpi` (needs libopenmpi-dev and libclang-dev), or run one process",
            processes.index, processes.count
        )))
    }
}

/// One group of the world for each of this process's `devices` device threads: in-process
/// threads, or, once MPI runs ([`start`]), the processes' threads together.
pub fn world_group(devices: usize) -> Result<Vec<Box<dyn Collective>>> {
    #[cfg(feature = "mpi")]
    if mpi::active() {
        return mpi::world_group(devices);
    }
    Ok(local_group(devices)
        .into_iter()
        .map(|c| Box::new(c) as Box<dyn Collective>)
        .collect())
}

/// The other processes' watchdogs, once MPI runs ([`watch::Remote`]).
pub fn remote() -> Option<Box<dyn watch::Remote>> {
    #[cfg(feature = "mpi")]
    if mpi::active() {
        return mpi::control();
    }
    None
}

/// What process 0 decided, on every process: `decide` runs on process 0 alone and its outcome
/// (a value or an error message) is broadcast to the others. With one process, `decide` runs.
pub fn agree(decide: impl FnOnce() -> Result<String>) -> Result<String> {
    let mine = if processes().index == 0 {
        Some(decide())
    } else {
        None
    };
    #[cfg(feature = "mpi")]
    if mpi::active() {
        let mut bytes = match &mine {
            Some(Ok(v)) => [&[0u8][..], v.as_bytes()].concat(),
            Some(Err(e)) => [&[1u8][..], e.to_string().as_bytes()].concat(),
            None => Vec::new(),
        };
        mpi::agree(&mut bytes);
        let text = String::from_utf8_lossy(&bytes[1..]).into_owned();
        return match (bytes[0], mine) {
            (_, Some(own)) => own,
            (0, None) => Ok(text),
            (_, None) => Err(crate::error::Error::Worker(format!("process 0: {text}"))),
        };
    }
    mine.expect("one process is process 0")
}

/// `decide` on process 0, its answer (through JSON) on every process: process 0 parses the
/// same text the others do, so every process holds the same bits.
pub(crate) fn agreed<T: serde::Serialize + serde::de::DeserializeOwned>(
    decide: impl FnOnce() -> Result<T>,
) -> Result<T> {
    let text =
        agree(|| decide().map(|v| serde_json::to_string(&v).expect("an agreed value serialises")))?;
    serde_json::from_str(&text)
        .map_err(|e| crate::error::Error::Worker(format!("process 0's answer: {e}")))
}

/// Waits until every process arrives (nothing with one process).
pub fn process_barrier() {
    #[cfg(feature = "mpi")]
    mpi::barrier();
}

/// The processes of the run: those MPI joined, or this one alone.
pub fn processes() -> Processes {
    #[cfg(feature = "mpi")]
    if let Some(p) = mpi::processes() {
        return p;
    }
    Processes::ALONE
}
