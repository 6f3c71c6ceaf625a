//! The commit `--version` names (`KILN_COMMIT`, from git where the source is a checkout; "no
//! commit" in a package); with the `mpi` feature, `src/comm/in_place.c` compiled against the
//! installed MPI's headers.

fn main() {
    commit();
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

/// `KILN_COMMIT`: the checkout's commit, `+` when tracked files differ from it; asked again
/// when HEAD, the index or kiln's sources change.
fn commit() {
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let commit = git(&["rev-parse", "--short=12", "HEAD"]);
    // An edit to kiln's sources not yet staged changes no git file: the `+` follows it too.
    println!("cargo:rerun-if-changed=src");
    if let Some(dir) = git(&["rev-parse", "--absolute-git-dir"]) {
        println!("cargo:rerun-if-changed={dir}/HEAD");
        println!("cargo:rerun-if-changed={dir}/index");
        if let Some(head) = git(&["symbolic-ref", "-q", "HEAD"]) {
            println!("cargo:rerun-if-changed={dir}/{head}");
        }
    }
    let dirty =
        git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
    let text = match commit {
        Some(c) if dirty => format!("commit {c}+"),
        Some(c) => format!("commit {c}"),
        None => "no commit".to_string(),
    };
    println!("cargo:rustc-env=KILN_COMMIT={text}");
}
