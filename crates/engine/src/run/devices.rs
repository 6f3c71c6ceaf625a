//! The devices of the configured accelerator, found honestly: CUDA only where a driver and a
//! device answer, a WGPU adapter only where it is real hardware for `auto`, and one line
//! naming what is missing otherwise — never a panic from a library that is not there.

use burn::prelude::*;
use burn::tensor::DeviceType;

use crate::config::{Accelerator, HardwareConfig};
use crate::error::{Error, Result};

/// The devices a run uses, the accelerator's name (`summary.json`'s `accelerator`) and, for
/// `auto`, why it chose that one (the start-up table says it).
#[derive(Debug, Clone)]
pub struct Chosen {
    /// One device per configured index.
    pub devices: Vec<Device>,
    /// `cpu (flex)`, `wgpu`, `cuda` or `cube-cpu`.
    pub name: String,
    /// Why `auto` chose it; `None` for an accelerator named in the config.
    pub why: Option<String>,
}

/// A CUDA device as the driver describes it.
#[derive(Debug, Clone, PartialEq)]
pub struct CudaCard {
    /// The device's name (`NVIDIA H100 80GB HBM3`).
    pub name: String,
    /// Its memory in bytes.
    pub memory: u64,
}

/// A WGPU adapter: its name, and whether it is hardware (a software rasterizer such as
/// llvmpipe is not, and `auto` never picks it).
#[derive(Debug, Clone, PartialEq)]
pub struct Adapter {
    /// The adapter's name.
    pub name: String,
    /// A card on a bus, not a CPU emulating one.
    pub hardware: bool,
}

/// The devices of the configured accelerator.
pub fn resolve_devices(hw: &HardwareConfig) -> Result<Chosen> {
    let indices = hw.devices.indices();
    if hw.accelerator != Accelerator::Cpu {
        // Before the runtime's first use (`auto` opens an adapter), which fixes CubeCL's
        // configuration for the process: autotune's choices are kept between runs.
        super::kept_tuning::keep_tuning();
    }
    let (accelerator, why) = match hw.accelerator {
        Accelerator::Auto => {
            let (a, why) = auto_choice();
            (a, Some(why))
        }
        a => (a, None),
    };
    let (devices, name) = match accelerator {
        Accelerator::Cpu => (
            indices.iter().map(|_| Device::flex()).collect(),
            "cpu (flex)".to_string(),
        ),
        Accelerator::Wgpu => (wgpu_devices(&indices)?, "wgpu".to_string()),
        Accelerator::Cuda => (cuda_devices(&indices)?, "cuda".to_string()),
        Accelerator::CubeCpu => (cube_cpu_devices(&indices)?, "cube-cpu".to_string()),
        Accelerator::Auto => unreachable!("auto was resolved above"),
    };
    Ok(Chosen { devices, name, why })
}

/// What `--accelerator auto` runs on, and why: CUDA where this build has it and a driver and
/// a device answer, then a hardware WGPU adapter, then the CPU.
pub fn auto_choice() -> (Accelerator, String) {
    let cuda = if cfg!(feature = "cuda") {
        match cuda_cards() {
            Ok(cards) => {
                let name = &cards[0].name;
                return (Accelerator::Cuda, format!("CUDA answers ({name})"));
            }
            Err(e) => e,
        }
    } else {
        "this build has no CUDA (the `cuda` feature)".to_string()
    };
    // Only a hardware adapter is opened: opening one starts the runtime's server thread,
    // which stays for the life of the process and wakes every 150 µs — on a CPU run it took
    // a fifth of the GPT's step from the replicas' threads (BENCHMARKS.md).
    let devices = wgpu_devices_unopened();
    let wgpu = if let Some(device) = devices.iter().find(|d| !is_software(d)) {
        let opened = device.clone();
        match crate::panics::probe(move || opened.identity().map(|id| id.name)) {
            Ok(name) => {
                let name = name.unwrap_or_else(|| format!("{device:?}"));
                return (Accelerator::Wgpu, format!("{cuda}; wgpu adapter {name}"));
            }
            Err(why) => format!("wgpu's adapter {device:?} did not open ({why})"),
        }
    } else if devices.is_empty() {
        "no wgpu adapter".to_string()
    } else {
        "wgpu has only a software adapter (a CPU rasterizer, left unopened; `train devices` \
         names it)"
            .to_string()
    };
    (Accelerator::Cpu, format!("{cuda}; {wgpu}"))
}

/// WGPU's devices as enumerated, none of them opened; none where the runtime fails to start.
fn wgpu_devices_unopened() -> Vec<Device> {
    crate::panics::probe(|| Device::enumerate(DeviceType::Wgpu).into_iter().collect())
        .unwrap_or_default()
}

/// Whether an enumerated WGPU device is the software adapter (llvmpipe, lavapipe, WARP),
/// told without opening it: WGPU enumerates a software adapter as its `Cpu` kind, and every
/// other kind is a card ([`Adapter::hardware`] says the same of an opened one).
fn is_software(device: &Device) -> bool {
    *device == Device::wgpu(burn::tensor::DeviceKind::Cpu)
}

/// WGPU's adapters, in the order `train devices` lists them; none where the runtime fails to
/// start (no graphics stack), which must read as none found, not as a crash.
pub fn wgpu_adapters() -> Vec<Adapter> {
    let devices = wgpu_devices_unopened();
    crate::panics::probe(move || {
        devices
            .into_iter()
            .map(|d| match d.identity() {
                Some(id) => Adapter {
                    name: id.name,
                    hardware: id.physical.is_some(),
                },
                None => Adapter {
                    name: format!("{d:?}"),
                    hardware: false,
                },
            })
            .collect()
    })
    .unwrap_or_default()
}

fn wgpu_devices(indices: &[usize]) -> Result<Vec<Device>> {
    let adapters = wgpu_devices_unopened();
    indices
        .iter()
        .map(|&i| {
            adapters.get(i).cloned().ok_or_else(|| {
                Error::Device(format!(
                    "hardware.devices asks for wgpu adapter {i}, but {} found (see `train \
                     devices`)",
                    match adapters.len() {
                        0 => "none was".to_string(),
                        1 => "only 1 was".to_string(),
                        n => format!("only {n} were"),
                    }
                ))
            })
        })
        .collect()
}

/// The CUDA devices at `indices`, after the driver said they exist: Burn's CUDA runtime loads
/// the driver library at its first use and panics where it is missing, so it is asked only
/// once the driver has answered.
#[cfg(feature = "cuda")]
fn cuda_devices(indices: &[usize]) -> Result<Vec<Device>> {
    let cards = cuda_cards().map_err(|why| {
        Error::Device(format!(
            "hardware.accelerator = \"cuda\": {why} (see `train devices`)"
        ))
    })?;
    indices
        .iter()
        .map(|&i| {
            if i < cards.len() {
                Ok(Device::cuda(i))
            } else {
                Err(Error::Device(format!(
                    "hardware.devices asks for CUDA device {i}, but the driver sees {} (see \
                     `train devices`)",
                    cards.len()
                )))
            }
        })
        .collect()
}

#[cfg(not(feature = "cuda"))]
fn cuda_devices(_indices: &[usize]) -> Result<Vec<Device>> {
    Err(Error::Device(
        "hardware.accelerator = \"cuda\" needs kiln built with the `cuda` feature \
         (cargo xtask setup-cuda, then cargo build --release --features cuda --bin train)"
            .into(),
    ))
}

/// CubeCL's CPU device once per index (its runtime has one device, as Flex).
#[cfg(feature = "cube-cpu")]
fn cube_cpu_devices(indices: &[usize]) -> Result<Vec<Device>> {
    let device = crate::panics::probe(|| Device::enumerate(DeviceType::Cpu).into_iter().next())
        .ok()
        .flatten()
        .ok_or_else(|| {
            Error::Device(
                "hardware.accelerator = \"cube-cpu\": CubeCL's CPU runtime gave no device".into(),
            )
        })?;
    Ok(indices.iter().map(|_| device.clone()).collect())
}

#[cfg(not(feature = "cube-cpu"))]
fn cube_cpu_devices(_indices: &[usize]) -> Result<Vec<Device>> {
    Err(Error::Device(
        "hardware.accelerator = \"cube-cpu\" needs kiln built with the `cube-cpu` feature \
         (cargo xtask setup-cuda for its LLVM, then cargo build --release --features cube-cpu \
         --bin train)"
            .into(),
    ))
}

/// Asks each device the first question its runtime answers (whether it computes in f32):
/// where a runtime cannot start, Burn's panics in a thread of its own, which becomes a one-line
/// refusal naming the device and what the runtime said.
pub fn start(devices: &[Device], accelerator: &str) -> Result<()> {
    for d in devices {
        let device = d.clone();
        match crate::panics::probe(move || device.supports_dtype(burn::tensor::DType::F32)) {
            Ok(true) => {}
            Ok(false) => return Err(Error::Device(format!("{d:?} cannot compute in f32"))),
            Err(why) => {
                return Err(Error::Device(format!(
                    "{accelerator} device {d:?} did not start: {why} (see `train devices`)"
                )));
            }
        }
    }
    Ok(())
}

/// The CUDA devices the driver reports, or why there are none: the driver library not found,
/// the driver not starting, no device. Asks the driver itself, through the library Burn's
/// runtime will load (`libcuda.so`, else `libcuda.so.1`): `cuInit`, `cuDeviceGetCount`, the
/// name and memory of each, so that a machine without CUDA is told so in one line, whatever
/// the build.
#[cfg(unix)]
pub fn cuda_cards() -> std::result::Result<Vec<CudaCard>, String> {
    use std::ffi::{CStr, c_char, c_int, c_void};
    type Init = unsafe extern "C" fn(u32) -> c_int;
    type Count = unsafe extern "C" fn(*mut c_int) -> c_int;
    type Get = unsafe extern "C" fn(*mut c_int, c_int) -> c_int;
    type Name = unsafe extern "C" fn(*mut c_char, c_int, c_int) -> c_int;
    type Mem = unsafe extern "C" fn(*mut usize, c_int) -> c_int;
    // SAFETY: dlopen/dlsym with NUL-terminated names; each symbol is the CUDA driver API's
    // function of that name, called with the signature the driver API documents. The library
    // stays loaded (Burn's runtime loads the same one).
    unsafe {
        // The names in the order Burn's CUDA runtime (cudarc) tries them, the first that
        // loads taken: so what is asked here is the library the run will use. `libcuda.so`
        // first, which on a machine with the toolkit may be its stub.
        let lib = [c"libcuda.so", c"libcuda.so.1"]
            .iter()
            .map(|name| libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL))
            .find(|lib| !lib.is_null());
        let Some(lib) = lib else {
            return Err("no CUDA driver (libcuda.so.1 not found)".into());
        };
        let sym = |name: &CStr| -> std::result::Result<*mut c_void, String> {
            let p = libc::dlsym(lib, name.as_ptr());
            if p.is_null() {
                Err(format!("the CUDA driver lacks {}", name.to_string_lossy()))
            } else {
                Ok(p)
            }
        };
        let init: Init = std::mem::transmute(sym(c"cuInit")?);
        let count: Count = std::mem::transmute(sym(c"cuDeviceGetCount")?);
        let get: Get = std::mem::transmute(sym(c"cuDeviceGet")?);
        let name: Name = std::mem::transmute(sym(c"cuDeviceGetName")?);
        let mem: Mem = std::mem::transmute(sym(c"cuDeviceTotalMem_v2")?);
        match init(0) {
            0 => {}
            100 => return Err("the CUDA driver sees no device (CUDA_ERROR_NO_DEVICE)".into()),
            code => {
                let mut info: libc::Dl_info = std::mem::zeroed();
                let path = if libc::dladdr(init as *const c_void, &mut info) != 0
                    && !info.dli_fname.is_null()
                {
                    CStr::from_ptr(info.dli_fname)
                        .to_string_lossy()
                        .into_owned()
                } else {
                    "libcuda.so".to_string()
                };
                return Err(cuda_init_failure(code, &path));
            }
        }
        let mut n: c_int = 0;
        if count(&mut n) != 0 || n <= 0 {
            return Err("the CUDA driver sees no device".into());
        }
        let mut cards = Vec::with_capacity(n as usize);
        for i in 0..n {
            let mut dev: c_int = 0;
            if get(&mut dev, i) != 0 {
                return Err(format!("the CUDA driver cannot open device {i}"));
            }
            let mut buf = [0 as c_char; 256];
            let label = if name(buf.as_mut_ptr(), buf.len() as c_int, dev) == 0 {
                CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned()
            } else {
                format!("CUDA device {i}")
            };
            let mut bytes: usize = 0;
            let memory = if mem(&mut bytes, dev) == 0 {
                bytes as u64
            } else {
                0
            };
            cards.push(CudaCard {
                name: label,
                memory,
            });
        }
        Ok(cards)
    }
}

/// Why `cuInit` failed, in words, for the driver library at `path`.
#[cfg(unix)]
fn cuda_init_failure(code: i32, path: &str) -> String {
    match code {
        34 => format!(
            "the CUDA driver did not start: {path} is the CUDA toolkit's stub library \
             (CUDA_ERROR_STUB_LIBRARY), found before the driver's own; take its folder off \
             LD_LIBRARY_PATH"
        ),
        35 => format!(
            "the CUDA driver did not start: the driver ({path}) is older than this CUDA \
             runtime needs (CUDA_ERROR_INSUFFICIENT_DRIVER)"
        ),
        code => format!("the CUDA driver did not start (cuInit error {code}, {path})"),
    }
}

/// No CUDA driver is looked for off Unix.
#[cfg(not(unix))]
pub fn cuda_cards() -> std::result::Result<Vec<CudaCard>, String> {
    Err("CUDA is looked for on Linux only".into())
}

/// `train devices`: what this machine offers, one line each, and what `auto` chooses.
pub fn devices_report() -> Vec<String> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut lines = vec![format!(
        "cpu    Flex CPU backend, {cores} cores (`--devices N` runs N replicas sharing them); \
         fused kernels with {} instructions",
        kiln_models::fused::vector_level()
    )];
    let adapters = wgpu_adapters();
    if adapters.is_empty() {
        lines.push("wgpu   none found".to_string());
    }
    for (i, a) in adapters.iter().enumerate() {
        let kind = if a.hardware {
            "hardware"
        } else {
            "software (auto never picks it)"
        };
        lines.push(format!("wgpu   [{i}] {}, {kind}", a.name));
    }
    let built = cfg!(feature = "cuda");
    match cuda_cards() {
        Ok(cards) => {
            for (i, c) in cards.iter().enumerate() {
                let gib = c.memory as f64 / (1u64 << 30) as f64;
                let note = if built {
                    ""
                } else {
                    " (this build lacks the `cuda` feature)"
                };
                lines.push(format!("cuda   [{i}] {}, {gib:.1} GiB{note}", c.name));
            }
        }
        Err(why) if built => lines.push(format!("cuda   none: {why}")),
        Err(why) => lines.push(format!(
            "cuda   none: this build lacks the `cuda` feature; and here, {why}"
        )),
    }
    lines.push(if cfg!(feature = "cube-cpu") {
        "cube-cpu  CubeCL's CPU runtime: the GPU path (kiln's kernels, Burn's fusion) on this \
         CPU in every float type; slow, for testing it (auto never picks it)"
            .to_string()
    } else {
        "cube-cpu  none: this build lacks the `cube-cpu` feature (CubeCL's CPU runtime, the GPU \
         path on this CPU for testing)"
            .to_string()
    });
    let p = crate::comm::Processes::from_env();
    if p.count > 1 {
        lines.push(format!(
            "procs  {} processes under a launcher (this is process {}); each runs the devices \
             above: world = {} × devices{}",
            p.count,
            p.index,
            p.count,
            if cfg!(feature = "mpi") {
                ""
            } else {
                " (this build lacks the `mpi` feature)"
            }
        ));
    }
    let (auto, why) = auto_choice();
    lines.push(format!(
        "auto   --accelerator auto chooses {}: {why}",
        crate::config::name_of(&auto)
    ));
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_software_adapter_is_told_apart_without_opening_it_as_opening_it_says() {
        for device in wgpu_devices_unopened() {
            let software = is_software(&device);
            let opened = device.clone();
            let identity = crate::panics::probe(move || opened.identity()).unwrap();
            let physical = identity.and_then(|id| id.physical);
            assert_eq!(software, physical.is_none(), "{device:?}");
        }
    }

    #[test]
    fn the_driver_answers_with_devices_or_says_why_not() {
        match cuda_cards() {
            Ok(cards) => {
                assert!(!cards.is_empty());
                assert!(
                    cards.iter().all(|c| !c.name.is_empty() && c.memory > 0),
                    "{cards:?}"
                );
            }
            Err(why) => assert!(why.contains("CUDA") || why.contains("libcuda"), "{why}"),
        }
        // Auto never picks a software adapter, nor CUDA that does not answer.
        let (auto, why) = auto_choice();
        match auto {
            Accelerator::Cuda => assert!(cuda_cards().is_ok() && cfg!(feature = "cuda")),
            Accelerator::Wgpu => assert!(wgpu_adapters().iter().any(|a| a.hardware), "{why}"),
            Accelerator::Cpu => assert!(!wgpu_adapters().iter().any(|a| a.hardware), "{why}"),
            Accelerator::CubeCpu => panic!("auto never picks CubeCL's CPU runtime"),
            Accelerator::Auto => panic!("auto resolves to a device kind"),
        }
    }
}
