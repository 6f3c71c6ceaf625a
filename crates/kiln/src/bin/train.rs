//! `train`: the kiln command line.

use clap::Parser;

fn main() {
    kiln::cli::quiet_worker_panics();
    let args = kiln::cli::Args::parse();
    std::process::exit(kiln::cli::main_with(args));
}
