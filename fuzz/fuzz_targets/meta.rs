//! SpikeGLX `.meta` parser and meta → probe geometry: never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use spikecube::recording::spikeglx;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    if let Ok(meta) = spikeglx::parse_meta_text(&text, Path::new("fuzz.meta")) {
        let _ = meta.probe();
    }
    if let Ok(imro) = spikeglx::parse_imro(&text) {
        let _ = imro.sites(None);
    }
    let _ = spikeglx::parse_geom_map(&text);
    let _ = spikeglx::parse_channel_subset(&text, 16);
});
