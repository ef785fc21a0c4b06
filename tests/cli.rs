//! The command line, run as a user would: `spikecube detect-window`.

mod common;

use common::{s, spikecube};

use std::path::Path;

use ndarray::{Array1, Array2};
use spikecube::npy;

#[test]
fn detect_window_reproduces_a_fixture_with_its_neighbourhoods() {
    let case = common::data("fixtures/detection/np2_4shank");
    let out = tempfile::tempdir().unwrap();
    let o = spikecube(&[
        "detect-window",
        "--window",
        s(&case.join("X.npy")),
        "--probe",
        s(&case.join("probe.json")),
        "--neighbourhoods",
        s(&case),
        "--out",
        s(out.path()),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let xy: Array2<i64> = npy::read(&out.path().join("xy.npy")).unwrap();
    let expected: Array2<i64> = npy::read(&case.join("xy.npy")).unwrap();
    assert_eq!(xy, expected);
    for f in [
        "amp.npy",
        "imax.npy",
        "sign.npy",
        "adist.npy",
        "yct.npy",
        "tF.npy",
        "xcup.npy",
        "ycup.npy",
        "iC.npy",
        "iC2.npy",
        "weigh.npy",
    ] {
        assert!(out.path().join(f).is_file(), "{f} missing");
    }
    // Without --neighbourhoods, our own geometry: same centres.
    let o = spikecube(&[
        "detect-window",
        "--window",
        s(&case.join("X.npy")),
        "--probe",
        s(&case.join("probe.json")),
        "--out",
        s(out.path()),
    ]);
    assert!(o.status.success());
    let xcup: Array1<f64> = npy::read(&out.path().join("xcup.npy")).unwrap();
    let expected: Array1<f64> = npy::read(&case.join("xcup.npy")).unwrap();
    assert_eq!(xcup, expected);
}

#[test]
fn detect_window_bad_inputs_are_one_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let probe = common::data("fixtures/detection/tetrode_like/probe.json");
    let write = |name: &str, f: &dyn Fn(&Path)| {
        let p = dir.path().join(name);
        f(&p);
        p
    };
    let rank1 = write("rank1.npy", &|p| {
        npy::write(p, &Array1::<f32>::zeros(500)).unwrap()
    });
    let f64win = write("f64.npy", &|p| {
        npy::write(p, &Array2::<f64>::zeros((4, 500))).unwrap()
    });
    let short = write("short.npy", &|p| {
        npy::write(p, &Array2::<f32>::zeros((4, 100))).unwrap()
    });
    let rows = write("rows.npy", &|p| {
        npy::write(p, &Array2::<f32>::zeros((5, 500))).unwrap()
    });
    let nan = write("nan.npy", &|p| {
        let mut a = Array2::<f32>::zeros((4, 500));
        a[[2, 7]] = f32::NAN;
        npy::write(p, &a).unwrap()
    });
    let missing = dir.path().join("missing.npy");
    let cases: [(&Path, &[&str]); 6] = [
        (&rank1, &["rank1.npy", "2-D"]),
        (&f64win, &["f64.npy", "f32"]),
        (&short, &["100 samples", "123"]),
        (&rows, &["5 rows", "4 sites"]),
        (&nan, &["channel 2, sample 7"]),
        (&missing, &["missing.npy"]),
    ];
    for (window, needles) in cases {
        let out = dir.path().join("out");
        let o = spikecube(&[
            "detect-window",
            "--window",
            s(window),
            "--probe",
            s(&probe),
            "--out",
            s(&out),
        ]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert_eq!(
            err.lines().filter(|l| l.contains("error")).count(),
            1,
            "one error line: {err}"
        );
        for n in needles {
            assert!(err.contains(n), "{window:?}: `{n}` not in: {err}");
        }
        assert!(!out.join("xy.npy").exists(), "no output after an error");
    }
}

/// `probe --png` draws the 384-site probe and the tetrode with plotters and the
/// embedded font: a picture of a sensible size with text in its title band.
#[test]
fn probe_pictures_are_drawn_with_text() {
    let out = tempfile::tempdir().unwrap();
    for case in ["np2_1shank", "tetrode_like"] {
        let png = out.path().join(format!("{case}.png"));
        let probe = common::data(&format!("fixtures/detection/{case}/probe.json"));
        let o = spikecube(&["probe", s(&probe), "--png", s(&png)]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let img = image::open(&png).unwrap().to_rgb8();
        assert!(
            img.width() >= 600 && img.height() >= 600,
            "{case}: {:?}",
            img.dimensions()
        );
        // Dark pixels in the title band: the title was drawn with the font.
        let dark = (0..img.width())
            .flat_map(|x| (5..45).map(move |y| (x, y)))
            .filter(|&(x, y)| img.get_pixel(x, y).0.iter().all(|&c| c < 100))
            .count();
        assert!(dark > 100, "{case}: {dark} dark pixels in the title band");
    }
}

/// Settings that cannot give a meaningful result are refused before any work:
/// a batch shorter than one waveform, a scale factor of 0.
#[test]
fn nonsense_batch_size_and_scale_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("rec.bin");
    std::fs::write(&bin, vec![0u8; 4 * 2 * 3000]).unwrap();
    let probe = common::data("fixtures/detection/tetrode_like/probe.json");
    let base = [
        "detect",
        s(&bin),
        "--n-channels",
        "4",
        "--fs",
        "30000",
        "--probe",
        s(&probe),
    ];
    for (extra, needle) in [
        (["--batch-size", "10"], "at least nt = 61"),
        (["--scale", "0"], "non-zero"),
    ] {
        let out = dir.path().join("out");
        let mut args = base.to_vec();
        args.extend_from_slice(&extra);
        args.extend_from_slice(&["--out", s(&out)]);
        let o = spikecube(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{extra:?}: {err}");
        assert!(err.contains(needle), "{extra:?}: `{needle}` not in {err}");
        assert!(!err.contains("panicked"), "{err}");
        assert!(!out.exists(), "no output after {extra:?}");
    }
}

/// Under -q a warning is printed once: as it happens, and not again in the
/// closing list (which, without -q, repeats every warning of the run).
#[test]
fn quiet_prints_each_warning_once() {
    let w = tempfile::tempdir().unwrap();
    let sim = w.path().join("sim");
    let o = spikecube(&[
        "simulate",
        "-q",
        "--seconds",
        "4.2",
        "--n-units",
        "6",
        "--seed",
        "3",
        "--out",
        s(&sim),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let bin = sim.join("sim_g0_t0.imec0.ap.bin");
    // Too few isolated peaks to learn templates from: a warning per pass.
    let needle = "isolated single-channel peaks";
    for (quiet, out, live_and_listed) in [(true, "q", 1), (false, "v", 2)] {
        let out = w.path().join(out);
        let mut args = vec!["detect", s(&bin), "--out", s(&out), "--backend", "cpu"];
        if quiet {
            args.insert(1, "-q");
        }
        let o = spikecube(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{err}");
        let first = err
            .lines()
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no warning about {needle}: {err}"));
        let text = &first[first.find("only").expect("the warning's text")..];
        let times = err.lines().filter(|l| l.ends_with(text)).count();
        assert_eq!(times, live_and_listed, "quiet {quiet}: {err}");
    }
}
