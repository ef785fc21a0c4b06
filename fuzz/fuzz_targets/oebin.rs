//! Open Ephys `structure.oebin` parser: never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use spikecube::recording::openephys;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let _ = openephys::parse_oebin_text(&text, Path::new("fuzz.oebin"));
});
