//! Probe loaders: Kilosort JSON and probeinterface JSON, and the built-in templates.

mod common;

use spikecube::{DetectionSettings, Geometry, Probe, UniversalTemplates, npy};

#[test]
fn probeinterface_library_probes_load() {
    let dir = common::shared().join("data/probes/probeinterface_library");
    let expected = [
        ("A1x32-Poly3-10mm-50-177.json", 32, 1),
        ("A4x8-5mm-100-200-177.json", 32, 4),
        ("ASSY-1-E-1.json", 16, 1),
        ("ASSY-116-E-1.json", 32, 2),
        ("ASSY-156-P-1.json", 64, 4),
        ("NP1000.json", 960, 1),
        ("NP1100.json", 384, 1),
        ("NP2000.json", 1280, 1),
    ];
    for (file, sites, shanks) in expected {
        let p = Probe::load(&dir.join(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert_eq!(p.n_sites(), sites, "{file}");
        let mut k = p.kcoords.clone();
        k.sort_unstable();
        k.dedup();
        assert_eq!(k.len(), shanks, "{file}: shanks");
        assert!(
            Geometry::new(&p, &DetectionSettings::default()).is_ok(),
            "{file}: geometry"
        );
    }
    // NP1.0: x cycles 43/11/59/27 µm (after the probe's own offset), rows every 20 µm.
    let np1 = Probe::load(&dir.join("NP1000.json")).unwrap();
    let mut xs = np1.xc.clone();
    xs.sort_by(f32::total_cmp);
    xs.dedup();
    assert_eq!(xs.len(), 4);
}

#[test]
fn kilosort_fixture_probes_load_as_kilosort_does() {
    for case in common::CASES {
        let p = Probe::load(
            &common::shared()
                .join("fixtures/detection")
                .join(case)
                .join("probe.json"),
        )
        .unwrap();
        assert_eq!(p.n_chan as usize, p.n_sites(), "{case}");
        assert!(p.chan_map.iter().enumerate().all(|(i, &c)| c == i as u64));
    }
}

#[test]
fn probe_errors_name_file_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let not_json = write("bad.json", "chanMap = [0, 1]");
    let e = Probe::load(&not_json).unwrap_err().to_string();
    assert!(e.contains("bad.json") && e.contains("JSON"), "{e}");
    let nan = write(
        "nan.json",
        r#"{"chanMap":[0,1],"xc":[0,"a"],"yc":[0,1],"kcoords":[0,0],"n_chan":2}"#,
    );
    let e = Probe::load(&nan).unwrap_err().to_string();
    assert!(e.contains("nan.json") && e.contains("`xc`"), "{e}");
    let missing = write(
        "missing.json",
        r#"{"chanMap":[0,1],"xc":[0,1],"kcoords":[0,0],"n_chan":2}"#,
    );
    let e = Probe::load(&missing).unwrap_err().to_string();
    assert!(e.contains("`yc`") && e.contains("missing"), "{e}");
    let two = write(
        "two.json",
        r#"{"specification":"probeinterface","probes":[{"contact_positions":[[0,0]]},{"contact_positions":[[0,0]]}]}"#,
    );
    let e = Probe::load(&two).unwrap_err().to_string();
    assert!(e.contains("2 probes"), "{e}");
    let e = Probe::load(&dir.path().join("absent.json"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("absent.json"), "{e}");
}

#[test]
fn builtin_templates_equal_kilosorts() {
    let t = UniversalTemplates::builtin();
    let dir = common::shared().join("fixtures/universal_templates");
    let wtemp: ndarray::Array2<f32> = npy::read(&dir.join("wTEMP.npy")).unwrap();
    let wpca: ndarray::Array2<f32> = npy::read(&dir.join("wPCA.npy")).unwrap();
    assert_eq!(t.wtemp, wtemp);
    assert_eq!(
        t.wpca, wpca,
        "wPCA is stored in Fortran order in the fixture"
    );
}

#[test]
fn settings_use_kilosort_names_in_json() {
    let s = DetectionSettings::default();
    let v = serde_json::to_value(&s).unwrap();
    assert_eq!(v["Th_universal"], 9.0);
    assert_eq!(v["nearest_chans"], 10);
    assert_eq!(v["nt0min"], serde_json::Value::Null);
    let back: DetectionSettings = serde_json::from_str(r#"{"Th_universal": 8.5}"#).unwrap();
    assert_eq!(back.th_universal, 8.5);
    assert_eq!(back.nearest_templates, 100);
    assert_eq!(s.nt0min(), 20);
}
