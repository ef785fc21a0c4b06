//! `spikecube info`: the back ends this build has and the devices they find.

use std::process::ExitCode;

use anyhow::Result;
use spikecube::backend::{Backend, choose, probe_cuda, probe_wgpu};

pub fn run() -> Result<ExitCode> {
    say!("spikecube {}", env!("CARGO_PKG_VERSION"));
    say!(
        "back ends in this build: {}",
        Backend::compiled().join(", ")
    );
    say!(
        "cpu: {}",
        spikecube::error::count(rayon::current_num_threads() as u64, "thread")
    );
    if cfg!(feature = "cuda") {
        match probe_cuda() {
            Ok(name) => say!("cuda: {name}"),
            Err(why) => say!("cuda: unavailable ({why})"),
        }
    }
    if cfg!(feature = "wgpu") {
        let adapters = probe_wgpu();
        if adapters.is_empty() {
            say!("wgpu: no Vulkan/Metal adapter");
        }
        for a in adapters {
            say!(
                "wgpu: {} ({}{})",
                a.name,
                a.api,
                if a.is_gpu {
                    ""
                } else {
                    ", software: slower than the CPU back end"
                }
            );
        }
    }
    let auto = choose(Backend::Auto)?;
    say!(
        "--backend auto picks: {} ({}): {}",
        auto.backend,
        auto.device,
        auto.reason
    );
    Ok(ExitCode::SUCCESS)
}
