//! `cargo xtask bench mpi`: the GPT's time per global batch in one process with two devices
//! against two processes of one device each under `mpirun`, and the bandwidth of kiln's MPI
//! all-reduce next to a plain `MPI_Allreduce` (the `allreduce` example). Needs OpenMPI
//! (`openmpi-bin`, `libopenmpi-dev`) and `libclang-dev`; builds kiln with the `mpi` feature.

use std::path::Path;
use std::process::Command;

use crate::common::{Result, TempDir, build_release, json_number, median, run_quietly};

/// What to measure.
pub struct Options {
    steps: usize,
    rounds: usize,
    config: String,
}

pub fn parse(rest: &[&str]) -> Result<Options> {
    let mut o = Options {
        steps: 30,
        rounds: 3,
        config: "configs/gpt-text.toml".into(),
    };
    let mut it = rest.iter();
    while let Some(flag) = it.next() {
        let value = it
            .next()
            .ok_or_else(|| format!("bench mpi: {flag} needs a value"))?;
        let count = || {
            value
                .parse::<usize>()
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| format!("bench mpi: {flag} {value:?}: expected a count >= 1"))
        };
        match *flag {
            "--steps" => o.steps = count()?,
            "--rounds" => o.rounds = count()?,
            "--config" => o.config = value.to_string(),
            _ => return Err(format!("bench mpi: unknown flag {flag:?}")),
        }
    }
    Ok(o)
}

/// Builds `train` (and, with `example`, the `allreduce` example) with the `mpi` feature and
/// returns the binary's path.
pub fn built_mpi_train(root: &Path, example: bool) -> Result<std::path::PathBuf> {
    let mut args = vec!["-p", "kiln", "--features", "kiln/mpi", "--bin", "train"];
    if example {
        // The example is the engine's, beside its collectives.
        args.extend(["-p", "kiln-engine", "--features", "kiln-engine/mpi"]);
        args.extend(["--example", "allreduce"]);
    }
    let release = build_release(root, &args, "kiln with the mpi feature")
        .map_err(|e| format!("{e}; it needs libopenmpi-dev and libclang-dev"))?;
    Ok(release.join("train"))
}

pub fn run(root: &Path, o: &Options) -> Result<()> {
    let train = built_mpi_train(root, true)?;
    let example = train
        .parent()
        .expect("the binary's folder")
        .join("examples")
        .join("allreduce");
    let mpirun = |np: usize| {
        let mut c = Command::new("mpirun");
        c.args([
            "--allow-run-as-root",
            "--oversubscribe",
            "-np",
            &np.to_string(),
        ]);
        c
    };
    let temp = TempDir::new("bench-mpi")?;
    println!(
        "bench mpi: {} for {} steps, {} rounds",
        o.config, o.steps, o.rounds
    );
    let mut times = [Vec::new(), Vec::new()];
    for round in 0..o.rounds {
        for (i, label) in ["1 process × 2 devices", "2 processes × 1 device"]
            .iter()
            .enumerate()
        {
            let dir = temp.path().join(format!("v{i}-r{round}"));
            let mut command = if i == 0 {
                let mut c = Command::new(&train);
                c.args(["--devices", "2"]);
                c
            } else {
                let mut c = mpirun(2);
                c.arg(&train).args(["--devices", "1"]);
                c
            };
            run_quietly(
                command
                    .args(["--config", &o.config])
                    .args(["--max-steps", &o.steps.to_string()])
                    .arg("--run-dir")
                    .arg(&dir)
                    .args([
                        "--set",
                        "train.log_every=5",
                        "--set",
                        "monitor.interval_s=0",
                    ])
                    .current_dir(root),
                label,
            )?;
            let summary = std::fs::read_to_string(dir.join("summary.json"))
                .map_err(|e| format!("{label}: no summary: {e}"))?;
            let step = json_number(&summary, "step_seconds")
                .ok_or_else(|| format!("{label}: no step_seconds"))?;
            println!("  round {round} {label:<24} {:>8.1} ms/step", step * 1e3);
            times[i].push(step);
        }
    }
    let (one, two) = (median(&times[0]), median(&times[1]));
    println!();
    println!("| layout | ms per global batch (median) | ÷ in-process |");
    println!("|---|---|---|");
    println!("| 1 process × 2 devices | {:.1} | 1.000 |", one * 1e3);
    println!(
        "| 2 processes × 1 device (mpirun) | {:.1} | {:.3} |",
        two * 1e3,
        two / one
    );
    println!();
    println!("goal: multi-process ≤ 1.15 × in-process: {:.3}", two / one);
    println!();
    let out = mpirun(2)
        .arg(&example)
        .current_dir(root)
        .output()
        .map_err(|e| format!("cannot run the allreduce example: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "the allreduce example failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    print!("{}", String::from_utf8_lossy(&out.stdout));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_rejects_arguments() {
        let o = parse(&["--steps", "5"]).unwrap();
        assert_eq!((o.steps, o.rounds), (5, 3));
        assert!(parse(&["--rounds", "0"]).is_err());
        assert!(parse(&["--what", "1"]).is_err());
    }
}
