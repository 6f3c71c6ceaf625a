//! The commit `--version` names (`KILN_COMMIT`, from git where the source is a checkout; "no
//! commit" in a package).

fn main() {
    commit();
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
    // An edit to kiln's sources not yet staged changes no git file: the `+` follows it too
    // (the engine's as well, in a checkout).
    println!("cargo:rerun-if-changed=src");
    if std::path::Path::new("../engine/src").is_dir() {
        println!("cargo:rerun-if-changed=../engine/src");
    }
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
