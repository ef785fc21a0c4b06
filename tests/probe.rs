//! Probe loaders: Kilosort JSON and probeinterface JSON, and the built-in templates.

mod common;

use spikecube::{DetectionSettings, Geometry, Probe, UniversalTemplates, npy};

#[test]
fn probeinterface_library_probes_load() {
    let dir = common::data("data/probes/probeinterface_library");
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
        let p = Probe::load(&common::data(&format!(
            "fixtures/detection/{case}/probe.json"
        )))
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
    let dir = common::data("fixtures/universal_templates");
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

/// `.prb` files as people write them: channel lists from `range(...)`,
/// `list(range(...))`, comprehensions over `range`, names assigned earlier and
/// arithmetic give the same probe as the literal file.
#[test]
fn prb_range_and_comprehensions_read_as_the_literal_file() {
    let dir = tempfile::tempdir().unwrap();
    let load = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        Probe::load(&p).unwrap_or_else(|e| panic!("{name}: {e:#}"))
    };
    let literal = load(
        "literal.prb",
        "channel_groups = {\n  0: {'channels': [0, 1, 2, 3, 4, 5, 6, 7],\n      'geometry': {0: (0, 0), 1: (0, 20), 2: (0, 40), 3: (0, 60),\n                   4: (0, 80), 5: (0, 100), 6: (0, 120), 7: (0, 140)}},\n}\n",
    );
    let forms = [
        (
            "range.prb",
            "channel_groups = {0: {'channels': range(8),\n  'geometry': {0: (0, 0), 1: (0, 20), 2: (0, 40), 3: (0, 60), 4: (0, 80), 5: (0, 100), 6: (0, 120), 7: (0, 140)}}}\n",
        ),
        (
            "list_range.prb",
            "channel_groups = {0: {'channels': list(range(0, 8, 1)),\n  'geometry': {i: (0, 20 * i) for i in range(8)}}}\n",
        ),
        (
            "comprehension.prb",
            "# geometry from a list comprehension\nchannels = [i for i in range(8)]\ngeometry = {c: (0, c*20) for c in channels}\nchannel_groups = {0: {'channels': channels, 'geometry': geometry}}\n",
        ),
        (
            "pairs.prb",
            "pos = [[0, 20*i] for i in range(8)]\nchannel_groups = {0: {'channels': list(range(8)), 'geometry': {i: pos[0] for i in range(1)}}}\n",
        ),
    ];
    for (name, text) in &forms[..3] {
        let p = load(name, text);
        assert_eq!(p.xc, literal.xc, "{name}");
        assert_eq!(p.yc, literal.yc, "{name}");
        assert_eq!(p.chan_map, literal.chan_map, "{name}");
        assert_eq!(p.kcoords, literal.kcoords, "{name}");
        assert_eq!(p.n_chan, literal.n_chan, "{name}");
    }
    // Indexing (`pos[0]`) is not supported: the error names it.
    let p = dir.path().join(forms[3].0);
    std::fs::write(&p, forms[3].1).unwrap();
    let e = format!("{:#}", Probe::load(&p).unwrap_err());
    assert!(e.contains("line 2") && e.contains("literal"), "{e}");
}

/// Anything else is refused, never run, with a message naming the construct and
/// how to rewrite it.
#[test]
fn prb_constructs_that_are_not_data_name_themselves() {
    let dir = tempfile::tempdir().unwrap();
    for (text, needle) in [
        ("import os\nchannel_groups = {}\n", "import"),
        (
            "channel_groups = {0: {'channels': sorted(range(4)), 'geometry': {}}}\n",
            "sorted(...)",
        ),
        (
            "channel_groups = {0: {'channels': [i for i in range(8) if i % 2], 'geometry': {}}}\n",
            "`if` in a comprehension",
        ),
        (
            "channel_groups = {0: {'channels': [i for i in range(2) for j in range(2)], 'geometry': {}}}\n",
            "two `for` clauses",
        ),
        (
            "channel_groups = {0: {'channels': [x for x in range(4)], 'geometry': {c: (0, y) for c in range(4)}}}\n",
            "`y`",
        ),
        ("channel_groups = {0: {'channels': range(10**9)}}\n", "`**`"),
        (
            "channel_groups = {0: {'channels': range(10000000)}}\n",
            "more than",
        ),
        ("for i in range(4): pass\n", "`for` statements"),
    ] {
        let p = dir.path().join("bad.prb");
        std::fs::write(&p, text).unwrap();
        let e = format!("{:#}", Probe::load(&p).unwrap_err());
        assert!(e.contains(needle), "`{needle}` not in: {e}");
        assert!(e.contains("bad.prb"), "{e}");
        if needle != "more than" {
            assert!(e.contains("literal"), "{e}");
        }
    }
}
