//! The CPU pass's outputs, byte for byte, against those of the code before the
//! CPU pass's speed work (hashes in `tests/data/cpu_pass/expected.json`,
//! made by `tests/data/cpu_pass/gen.sh` with that build; see SOURCE.md there).

mod common;

use common::{s, spikecube};

use std::collections::BTreeMap;
use std::path::Path;

/// FNV-1a, 64 bits (the hash `gen.sh` writes).
fn fnv1a(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:016x}")
}

fn run(args: &[&str]) {
    let o = spikecube(args);
    assert!(
        o.status.success(),
        "spikecube {args:?}: exit {:?}: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stderr)
    );
}

fn hashes(dir: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().to_string();
        if name.ends_with(".npy") {
            out.insert(name, fnv1a(&std::fs::read(&p).unwrap()));
        }
    }
    out
}

#[test]
fn cpu_pass_outputs_equal_the_previous_code_byte_for_byte() {
    let expected: BTreeMap<String, BTreeMap<String, String>> = serde_json::from_str(
        &std::fs::read_to_string(common::data("cpu_pass/expected.json")).unwrap(),
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let w = dir.path();
    // The probe gen.sh writes: 32 sites, x ∈ {0, 32} µm, rows every 20 µm.
    let xc: Vec<f64> = (0..32).map(|i| 32.0 * (i % 2) as f64).collect();
    let yc: Vec<f64> = (0..32).map(|i| 20.0 * (i / 2) as f64).collect();
    let probe = w.join("probe32.json");
    let j = serde_json::json!({"chanMap": (0..32).collect::<Vec<_>>(), "xc": xc, "yc": yc,
        "kcoords": vec![0; 32], "n_chan": 32});
    std::fs::write(&probe, j.to_string()).unwrap();
    let (sim32, sim384) = (w.join("sim32"), w.join("sim384"));
    run(&[
        "simulate",
        "-q",
        "--probe",
        s(&probe),
        "--seconds",
        "6",
        "--n-units",
        "16",
        "--rate",
        "40",
        "--seed",
        "5",
        "--out",
        s(&sim32),
    ]);
    run(&[
        "simulate",
        "-q",
        "--seconds",
        "4.2",
        "--n-units",
        "12",
        "--rate",
        "8",
        "--seed",
        "6",
        "--out",
        s(&sim384),
    ]);
    let bin32 = sim32.join("sim_g0_t0.imec0.ap.bin");
    let bin384 = sim384.join("sim_g0_t0.imec0.ap.bin");
    let builtin = ["--nblocks", "0", "--templates-from-data", "false"];
    let runs: [(&str, &Path, &[&str]); 3] = [
        ("a", &bin32, &builtin),
        ("b", &bin32, &["--nblocks", "0", "--min-learn-clips", "100"]),
        ("c", &bin384, &builtin),
    ];
    for (name, bin, extra) in runs {
        let out = w.join(name);
        let mut args = vec!["detect", "-q", s(bin), "--out", s(&out), "--threads", "2"];
        args.extend_from_slice(extra);
        run(&args);
        let got = hashes(&out);
        let want = &expected[name];
        assert_eq!(
            got.keys().collect::<Vec<_>>(),
            want.keys().collect::<Vec<_>>(),
            "run {name}: the output files"
        );
        for (f, h) in want {
            assert_eq!(
                &got[f], h,
                "run {name}: {f} differs from the previous code's"
            );
        }
    }
}
