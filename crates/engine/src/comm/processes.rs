//! Where this process stands among the processes a launcher started.

/// Where this process stands among the processes a launcher (`mpirun`, `srun`) started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Processes {
    /// This process's index, `0..count`.
    pub index: usize,
    /// Number of processes.
    pub count: usize,
    /// This process's index among the processes of its machine.
    pub local_index: usize,
}

impl Processes {
    /// One process alone.
    pub const ALONE: Processes = Processes {
        index: 0,
        count: 1,
        local_index: 0,
    };

    /// What the launcher's environment says: OpenMPI's `OMPI_COMM_WORLD_*`, MPICH/PMI's
    /// `PMI_*`, or Slurm's `srun` (`SLURM_PROCID` with `SLURM_STEP_NUM_TASKS`); one process
    /// alone when none is set.
    pub fn from_env() -> Self {
        let var = |k: &str| {
            std::env::var(k)
                .ok()
                .and_then(|v| v.trim().parse::<usize>().ok())
        };
        let found = [
            (
                "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_RANK",
            ),
            ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
            ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID"),
        ]
        .iter()
        .find_map(|(rank, size, local)| {
            Some(Processes {
                index: var(rank)?,
                count: var(size)?,
                local_index: var(local).unwrap_or(0),
            })
        });
        match found {
            Some(p) if p.count > 0 && p.index < p.count => p,
            _ => Processes::ALONE,
        }
    }
}
