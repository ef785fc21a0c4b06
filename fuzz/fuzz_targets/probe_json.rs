//! Probe JSON loader (Kilosort and probeinterface formats): never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let _ = spikecube::Probe::parse(&text, Path::new("fuzz.json"));
});
