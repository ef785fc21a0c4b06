//! `.prb` parser (read as data): never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let _ = spikecube::Probe::parse_prb(&text, Path::new("fuzz.prb"));
});
