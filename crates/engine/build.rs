//! With the `mpi` feature: `src/comm/in_place.c` compiled against the installed MPI's headers.

fn main() {
    #[cfg(feature = "mpi")]
    {
        println!("cargo:rerun-if-changed=src/comm/in_place.c");
        let lib = build_probe_mpi::probe().unwrap_or_else(|errors| {
            panic!(
                "the `mpi` feature needs an MPI installation (libopenmpi-dev or MPICH): {}",
                errors
                    .iter()
                    .map(|e| e.to_string())
                    .collect::<Vec<_>>()
                    .join("; ")
            )
        });
        let mut build = cc::Build::new();
        for path in &lib.include_paths {
            build.include(path);
        }
        build
            .file("src/comm/in_place.c")
            .compile("kiln_mpi_in_place");
    }
}
