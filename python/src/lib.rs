//! `spikecube._native`: the Rust side of the Python package. The Pythonic API
//! (settings with Kilosort4's names, docstrings, `Result`, SpikeInterface) is in
//! `python/spikecube/`; this module only converts and calls the core crate.
//!
//! * Long calls release the GIL; Ctrl-C is seen through `check_signals` on every
//!   window read and progress report, and in the stages between (the
//!   clusterings) through Python's signal wakeup file ([`SigintWatch`]); it
//!   stops the run with an error so that the staged output folder is removed,
//!   and the `KeyboardInterrupt` is raised.
//! * Rust errors become `spikecube.SpikecubeError` with the command line's text.
//! * `tracing` events go to Python's `logging` (logger `spikecube`).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use ndarray::{Array2, Axis};
use numpy::{IntoPyArray, PyArray2, PyArrayMethods, PyReadonlyArray2};
use pyo3::create_exception;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use spikecube::backend::{Backend, Detector};
use spikecube::detect::{DetectionSettings, Geometry, UniversalTemplates};
use spikecube::error::RecordingError;
use spikecube::output::RunInfo;
use spikecube::pipeline::{Checks, DetectJob, Progress};
use spikecube::preprocess::{PreprocessSettings, Preprocessor};
use spikecube::recording::{Dtype, OpenOptions, Opened, Recording};
use spikecube::sort::run::{SortFlags, SortJob, SortProgress, run_sort};
use spikecube::universal::TemplateChoice;
use spikecube::{Probe, checks};

create_exception!(
    _native,
    SpikecubeError,
    PyRuntimeError,
    "An error reported by spikecube's Rust core (the same text as the command line's)."
);

/// The error's text as the command line prints it: each cause once.
fn message(err: &anyhow::Error) -> String {
    let mut line = err.to_string();
    for cause in err.chain().skip(1) {
        let c = cause.to_string();
        if !line.contains(&c) {
            line = format!("{line}: {c}");
        }
    }
    line
}

fn to_py(err: anyhow::Error) -> PyErr {
    SpikecubeError::new_err(message(&err))
}

// ---------------------------------------------------------------------------
// Interrupts

/// The first Python exception seen while the GIL was released (Ctrl-C's
/// `KeyboardInterrupt`, or one raised by a progress callback), and a flag that
/// makes every later read fail so that the run stops.
#[derive(Clone, Default)]
struct Interrupt {
    flag: Arc<AtomicBool>,
    error: Arc<Mutex<Option<PyErr>>>,
}

impl Interrupt {
    fn set(&self, e: PyErr) {
        let mut slot = self.error.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            *slot = Some(e);
        }
        self.flag.store(true, Ordering::SeqCst);
    }
    fn is_set(&self) -> bool {
        self.flag.load(Ordering::SeqCst)
    }
    /// Runs Python's signal handlers (only on the main thread; elsewhere a no-op).
    fn check_signals(&self) {
        if self.is_set() {
            return;
        }
        if let Err(e) = Python::with_gil(|py| py.check_signals()) {
            self.set(e);
        }
    }
    /// The stored exception, else `err` converted.
    fn into_err(self, err: anyhow::Error) -> PyErr {
        let stored = self.error.lock().unwrap_or_else(|p| p.into_inner()).take();
        stored.unwrap_or_else(|| to_py(err))
    }
}

/// A recording whose reads fail once an interrupt was seen (and that looks
/// for one before each read).
struct Interruptible {
    inner: Arc<dyn Recording>,
    interrupt: Interrupt,
}

impl Recording for Interruptible {
    fn n_channels(&self) -> usize {
        self.inner.n_channels()
    }
    fn n_samples(&self) -> u64 {
        self.inner.n_samples()
    }
    fn fs(&self) -> f64 {
        self.inner.fs()
    }
    fn first_sample(&self) -> u64 {
        self.inner.first_sample()
    }
    fn read_channels(
        &self,
        start: u64,
        count: usize,
        chan_map: &[u64],
        out: &mut [f32],
    ) -> Result<(), RecordingError> {
        self.interrupt.check_signals();
        if self.interrupt.is_set() || spikecube::cancel::requested() {
            return Err(RecordingError::Read {
                what: self.inner.describe(),
                message: "interrupted".into(),
            });
        }
        self.inner.read_channels(start, count, chan_map, out)
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
}

/// Sees Ctrl-C while a long call runs without the GIL, in stages that neither
/// read windows nor report progress (the clusterings): Python's own handler
/// runs only when the main thread gets back to Python, so this points
/// Python's signal wakeup file (`signal.set_wakeup_fd`) at a socket and asks
/// the core to stop ([`spikecube::cancel::request`]) when SIGINT's byte
/// arrives; the pending `KeyboardInterrupt` is then raised as usual. Only on
/// the main thread (elsewhere Python takes no wakeup file, and Ctrl-C does
/// not reach the call anyway); the previous wakeup file is restored after.
struct SigintWatch {
    #[cfg(unix)]
    inner: Option<Watching>,
}

/// A watch in place: the previous wakeup file, the socket's end Python
/// writes into (kept open until the previous file is back), the end the
/// thread reads, and the thread.
#[cfg(unix)]
struct Watching {
    old: Py<PyAny>,
    writer: std::os::unix::net::UnixStream,
    reader: std::os::unix::net::UnixStream,
    thread: std::thread::JoinHandle<()>,
}

impl SigintWatch {
    fn start(py: Python<'_>) -> SigintWatch {
        #[cfg(unix)]
        {
            let inner = Self::start_unix(py);
            // A stop asked for before this call is not this call's; without
            // a watch (off the main thread) the request is left to the call
            // that watches.
            if inner.is_some() {
                spikecube::cancel::reset();
            }
            SigintWatch { inner }
        }
        #[cfg(not(unix))]
        {
            let _ = py;
            SigintWatch {}
        }
    }

    #[cfg(unix)]
    fn start_unix(py: Python<'_>) -> Option<Watching> {
        use std::io::Read;
        use std::os::fd::AsRawFd;
        // SIGINT's number on every Unix.
        const SIGINT: u8 = 2;
        let (mut reader, writer) = std::os::unix::net::UnixStream::pair().ok()?;
        writer.set_nonblocking(true).ok()?;
        let keep = reader.try_clone().ok()?;
        let signal = py.import("signal").ok()?;
        let kwargs = PyDict::new(py);
        kwargs.set_item("warn_on_full_buffer", false).ok()?;
        // A ValueError off the main thread: then no watch.
        let old = signal
            .call_method("set_wakeup_fd", (writer.as_raw_fd(),), Some(&kwargs))
            .ok()?
            .unbind();
        let thread = std::thread::Builder::new()
            .name("spikecube-sigint".into())
            .spawn(move || {
                let mut buf = [0u8; 64];
                loop {
                    match reader.read(&mut buf) {
                        // Python's handlers do not restart reads: a signal
                        // delivered to this thread interrupts this one.
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Ok(0) | Err(_) => break,
                        Ok(n) if buf[..n].contains(&SIGINT) => spikecube::cancel::request(),
                        Ok(_) => {}
                    }
                }
            });
        match thread {
            Ok(thread) => Some(Watching {
                old,
                writer,
                reader: keep,
                thread,
            }),
            Err(_) => {
                let _ = signal.call_method1("set_wakeup_fd", (old,));
                None
            }
        }
    }

    /// Restores the previous wakeup file, ends the watching thread, then
    /// closes the socket; true when a watch was in place.
    fn stop(&mut self, py: Python<'_>) -> bool {
        #[cfg(unix)]
        if let Some(w) = self.inner.take() {
            if let Ok(signal) = py.import("signal") {
                let _ = signal.call_method1("set_wakeup_fd", (w.old,));
            }
            let _ = w.reader.shutdown(std::net::Shutdown::Both);
            let _ = w.thread.join();
            drop(w.writer);
            return true;
        }
        let _ = py;
        false
    }

    /// Ends the watch and turns the call's result into Python's: a run
    /// stopped on SIGINT raises the pending `KeyboardInterrupt`.
    fn finish<T>(
        mut self,
        py: Python<'_>,
        interrupt: Interrupt,
        result: anyhow::Result<T>,
    ) -> PyResult<T> {
        let watched = self.stop(py);
        if watched {
            if result.is_err() && spikecube::cancel::requested() {
                interrupt.check_signals();
            }
            spikecube::cancel::reset();
        }
        result.map_err(|e| interrupt.into_err(e))
    }
}

impl Drop for SigintWatch {
    /// A call that panicked gives the wakeup file back too.
    fn drop(&mut self) {
        #[cfg(unix)]
        if self.inner.is_some() {
            Python::with_gil(|py| {
                if self.stop(py) {
                    spikecube::cancel::reset();
                }
            });
        }
    }
}

// ---------------------------------------------------------------------------
// Logging: tracing events to Python's `logging`.

struct PyLogLayer;

/// The lowest Python logging level (10 debug … 40 error) passed on to Python;
/// events below it are dropped without taking the GIL. `spikecube` sets it
/// from the `spikecube` logger's effective level before each call.
static LOG_LEVEL: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(20);

/// Sets the lowest Python logging level passed on to Python (see `LOG_LEVEL`).
#[pyfunction]
fn set_log_level(level: u8) {
    LOG_LEVEL.store(level, Ordering::Relaxed);
}

struct MessageVisitor(String);

impl tracing::field::Visit for MessageVisitor {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.0 = format!("{value:?}");
        } else {
            self.0 = format!("{} {}={value:?}", self.0, field.name());
        }
    }
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        if field.name() == "message" {
            self.0 = value.to_string();
        } else {
            self.0 = format!("{} {}={value}", self.0, field.name());
        }
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for PyLogLayer {
    fn on_event(
        &self,
        event: &tracing::Event<'_>,
        _ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        let meta = event.metadata();
        let level = match *meta.level() {
            tracing::Level::ERROR => 40,
            tracing::Level::WARN => 30,
            tracing::Level::INFO => 20,
            _ => 10,
        };
        if level < LOG_LEVEL.load(Ordering::Relaxed) {
            return;
        }
        let mut v = MessageVisitor(String::new());
        event.record(&mut v);
        let target = meta.target().to_string();
        Python::with_gil(|py| {
            let name = if target.starts_with("spikecube") {
                "spikecube".to_string()
            } else {
                format!("spikecube.{}", target.split("::").next().unwrap_or("other"))
            };
            let r = py
                .import("logging")
                .and_then(|l| l.call_method1("getLogger", (name,)))
                .and_then(|lg| lg.call_method1("log", (level, v.0)));
            if let Err(e) = r {
                e.print(py);
            }
        });
    }
}

fn install_logging() {
    use tracing_subscriber::prelude::*;
    let filter = tracing_subscriber::EnvFilter::new(
        "debug,cubecl_wgpu=warn,cubecl_cuda=warn,cubecl_runtime=warn,wgpu_core=warn,wgpu_hal=warn,naga=warn,cubecl=warn,wgpu=warn",
    );
    let _ = tracing_subscriber::registry()
        .with(PyLogLayer.with_filter(filter))
        .try_init();
}

// ---------------------------------------------------------------------------
// Arguments shared by the calls

/// A probe as Python hands it over: (xc, yc, kcoords, chanMap, n_chan, source).
type ProbeTuple = (Vec<f32>, Vec<f32>, Vec<i64>, Vec<u64>, u64, String);

fn probe_from(t: ProbeTuple) -> PyResult<Probe> {
    let (xc, yc, kcoords, chan_map, n_chan, source) = t;
    let p = Probe {
        xc,
        yc,
        kcoords,
        chan_map,
        n_chan,
        source: PathBuf::from(source),
    };
    p.validate()
        .map_err(|e| SpikecubeError::new_err(e.to_string()))?;
    Ok(p)
}

fn probe_to(p: &Probe) -> ProbeTuple {
    (
        p.xc.clone(),
        p.yc.clone(),
        p.kcoords.clone(),
        p.chan_map.clone(),
        p.n_chan,
        p.source.display().to_string(),
    )
}

fn backend_from(s: &str) -> PyResult<Backend> {
    match s {
        "auto" => Ok(Backend::Auto),
        "cpu" => Ok(Backend::Cpu),
        "cuda" if cfg!(feature = "gpu") => Ok(Backend::Cuda),
        "wgpu" if cfg!(feature = "gpu") => Ok(Backend::Wgpu),
        other => Err(pyo3::exceptions::PyValueError::new_err(format!(
            "backend {other:?} is not in this build; use one of {}",
            Backend::compiled().join(", ")
        ))),
    }
}

fn settings_from<T: serde::de::DeserializeOwned>(json: &str, what: &str) -> PyResult<T> {
    serde_json::from_str(json)
        .map_err(|e| pyo3::exceptions::PyValueError::new_err(format!("{what} settings: {e}")))
}

/// `artifact_times` as Python gives it: a file's path, or the times.
#[derive(serde::Deserialize)]
#[serde(untagged)]
enum ArtifactTimes {
    File(PathBuf),
    Seconds(Vec<f64>),
}

/// How to open the recording (the command line's recording flags).
#[derive(serde::Deserialize)]
struct RecordingOpts {
    n_channels: Option<u64>,
    fs: Option<f64>,
    dtype: Option<String>,
    offset: u64,
    scale: Option<f32>,
    shift: Option<f32>,
    tmin: f64,
    tmax: Option<f64>,
    exclude_channels: Vec<u64>,
    mask_clipped: bool,
    keep_boundary_duplicates: bool,
    /// Stimulus-artifact times (`--artifact-times`): a file, or the times
    /// in seconds; blanked over `artifact_window` ms; `blank_transients`
    /// also blanks the transients common to most channels.
    artifact_times: Option<ArtifactTimes>,
    artifact_window: (f64, f64),
    blank_transients: bool,
}

/// Opens the recording and applies the probe and input checks, the artifact
/// blanking included, as the command line does (`src/cli/common.rs`:
/// `open_input`, `CheckArgs::blanking`).
fn open_recording(
    paths: &[PathBuf],
    probe: Option<ProbeTuple>,
    o: &RecordingOpts,
) -> anyhow::Result<(Opened, Probe, Checks)> {
    let dtype = match &o.dtype {
        None => Dtype::Int16,
        Some(s) => Dtype::parse(s).ok_or_else(|| {
            anyhow::anyhow!("unknown dtype {s:?}; use int16, uint16, int32 or float32")
        })?,
    };
    if let Some(s) = o.scale
        && (!s.is_finite() || s == 0.0)
    {
        anyhow::bail!(
            "scale {s} would make every sample 0 or non-finite; give a finite, non-zero factor"
        );
    }
    let req = spikecube::pipeline::InputRequest {
        paths: paths.to_vec(),
        open: OpenOptions {
            n_channels: o.n_channels,
            fs: o.fs,
            dtype,
            offset: o.offset,
            scale: o.scale,
            shift: o.shift,
            tmin: o.tmin,
            tmax: o.tmax.unwrap_or(f64::INFINITY),
            ..OpenOptions::default()
        },
        probe: probe
            .map(probe_from)
            .transpose()
            .map_err(|e| anyhow::anyhow!("{e}"))?,
        probe_hint: "probe= (a file or a spikecube.Probe)",
        exclude_channels: o.exclude_channels.clone(),
        mask_clipped: o.mask_clipped,
        keep_boundary_duplicates: o.keep_boundary_duplicates,
    };
    let (opened, probe, mut checks) = spikecube::pipeline::open_for_detection(&req)?;
    use spikecube::preprocess::blanking::TimesSource;
    checks.blanking = spikecube::preprocess::blanking::blanking_for(
        opened.recording.as_ref(),
        o.artifact_times.as_ref().map(|t| match t {
            ArtifactTimes::File(p) => TimesSource::File(p),
            ArtifactTimes::Seconds(s) => TimesSource::Seconds(s),
        }),
        o.artifact_window,
        o.blank_transients,
        &mut checks.warnings,
    )?;
    Ok((opened, probe, checks))
}

fn progress_dict<'py>(py: Python<'py>, p: &Progress) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("windows_done", p.windows_done)?;
    d.set_item("windows_total", p.windows_total)?;
    d.set_item("spikes", p.spikes)?;
    d.set_item("seconds_done", p.seconds_done)?;
    d.set_item("elapsed", p.elapsed)?;
    d.set_item("first_pass", p.first_pass)?;
    Ok(d)
}

/// The unwinding payload that stops a run from its progress callback.
struct Interrupted;

/// The progress callback of a run: checks for Ctrl-C, then calls `callback`.
/// On an exception (Ctrl-C's `KeyboardInterrupt` or the callback's own) it
/// stops the run at once by unwinding with [`Interrupted`] (without the panic
/// hook's message): the run's output writer and window reader are dropped on
/// the way, which removes the staged output folder and stops the reader.
/// [`guarded`] catches it.
fn reporter<'a, P: 'a>(
    interrupt: &'a Interrupt,
    callback: &'a Option<Py<PyAny>>,
    to_dict: for<'py> fn(Python<'py>, &P) -> PyResult<Bound<'py, PyDict>>,
) -> impl FnMut(P) + 'a {
    move |p: P| {
        interrupt.check_signals();
        if !interrupt.is_set()
            && let Some(cb) = callback
        {
            let r = Python::with_gil(|py| -> PyResult<()> {
                cb.call1(py, (to_dict(py, &p)?,))?;
                Ok(())
            });
            if let Err(e) = r {
                interrupt.set(e);
            }
        }
        if interrupt.is_set() {
            std::panic::resume_unwind(Box::new(Interrupted));
        }
    }
}

/// Runs `f`, turning an [`Interrupted`] unwind into an error (the stored
/// exception is raised by [`Interrupt::into_err`]); other panics go on.
fn guarded<T>(f: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload)
            if payload.is::<Interrupted>() || payload.is::<spikecube::cancel::Cancelled>() =>
        {
            Err(anyhow::anyhow!("interrupted"))
        }
        Err(payload) => std::panic::resume_unwind(payload),
    }
}

/// The detection run of `detect` and `sort`, as the command line builds it
/// (the universal templates `templates` chooses, drift correction with
/// `drift`), reading through an [`Interruptible`] recording.
#[allow(clippy::too_many_arguments)]
fn detect_job(
    paths: &[PathBuf],
    probe: Option<ProbeTuple>,
    o: &RecordingOpts,
    det: DetectionSettings,
    pre: PreprocessSettings,
    drift: DriftOpts,
    templates: &TemplateChoice,
    out: PathBuf,
    backend: Backend,
    interrupt: &Interrupt,
) -> anyhow::Result<DetectJob> {
    det.validate()?;
    let templates = templates.source(&det)?;
    let (opened, probe, checks) = open_recording(paths, probe, o)?;
    let rec: Arc<dyn Recording> = Arc::new(Interruptible {
        inner: opened.recording.clone(),
        interrupt: interrupt.clone(),
    });
    let fs = rec.fs();
    let (dat_path, more_dat_paths) = spikecube::recording::raw_data_files(paths);
    let run_info = RunInfo {
        input_description: rec.describe(),
        dat_path,
        more_dat_paths,
        n_channels_dat: rec.n_channels() as u64,
        dtype: opened.dtype.name().into(),
        offset: opened.offset,
        hp_filtered: false,
        ..RunInfo::default()
    };
    let mode = match drift.drift_mode.as_str() {
        "spikecube" => spikecube::drift::DriftMode::Spikecube,
        "kilosort" => spikecube::drift::DriftMode::Kilosort,
        other => anyhow::bail!("drift_mode = {other:?}: expected 'spikecube' or 'kilosort'"),
    };
    let drift = spikecube::drift::DriftSettings {
        nblocks: drift.nblocks,
        binning_depth: drift.binning_depth,
        drift_smoothing: drift.drift_smoothing,
        sig_interp: drift.sig_interp,
        drift_only: drift.drift_only,
        mode,
        edge_margin: drift.drift_edge_margin.unwrap_or(f64::INFINITY),
    };
    Ok(DetectJob {
        recording: rec,
        probe,
        detection: det,
        preprocess: PreprocessSettings { fs, ..pre },
        out,
        run_info,
        backend,
        checks,
        templates,
        drift,
        device_preprocessing: true,
        last_device_use: false,
        scratch: false,
        keep_windows: None,
    })
}

/// Drift settings from Python, the command line's drift flags
/// (`drift_edge_margin` `None`: infinite, Kilosort4's extrapolation).
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct DriftOpts {
    nblocks: usize,
    binning_depth: f64,
    drift_smoothing: [f64; 3],
    sig_interp: f64,
    drift_mode: String,
    drift_edge_margin: Option<f64>,
    drift_only: bool,
}

/// Sizes the worker pool of this process (`--threads`): the pool every
/// parallel step uses is made once per process, at its first use, so a
/// count can be set only before the first run, or again with the same value.
#[pyfunction]
fn set_threads(n: usize) -> PyResult<()> {
    use pyo3::exceptions::PyValueError;
    if n == 0 {
        return Err(PyValueError::new_err(
            "threads = 0: give at least 1 thread (or None for one per core)",
        ));
    }
    if rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build_global()
        .is_ok()
    {
        return Ok(());
    }
    let running = rayon::current_num_threads();
    if running == n {
        Ok(())
    } else {
        Err(PyValueError::new_err(format!(
            "threads = {n}: this Python process already runs spikecube's worker pool with {}, \
             set at its first run; start a new process to use another count",
            spikecube::error::count(running as u64, "thread")
        )))
    }
}

// ---------------------------------------------------------------------------
// Functions

/// Loads a probe file (Kilosort JSON, probeinterface JSON, .prb or SpikeGLX
/// .meta) as (xc, yc, kcoords, chanMap, n_chan, source).
#[pyfunction]
fn load_probe(path: PathBuf) -> PyResult<ProbeTuple> {
    let p = Probe::load(&path).map_err(|e| SpikecubeError::new_err(e.to_string()))?;
    Ok(probe_to(&p))
}

/// Checks a probe; returns it unchanged.
#[pyfunction]
fn check_probe(probe: ProbeTuple) -> PyResult<ProbeTuple> {
    Ok(probe_to(&probe_from(probe)?))
}

/// The whole `spikecube detect` run (see `spikecube.detect`). Returns the run's
/// report as JSON text.
#[pyfunction]
#[pyo3(signature = (paths, probe, recording_opts, detection, preprocess, drift, templates, out, backend, progress=None))]
#[allow(clippy::too_many_arguments)]
fn detect(
    py: Python<'_>,
    paths: Vec<PathBuf>,
    probe: Option<ProbeTuple>,
    recording_opts: &str,
    detection: &str,
    preprocess: &str,
    drift: &str,
    templates: &str,
    out: PathBuf,
    backend: &str,
    progress: Option<Py<PyAny>>,
) -> PyResult<String> {
    let o: RecordingOpts = settings_from(recording_opts, "recording")?;
    let det: DetectionSettings = settings_from(detection, "detection")?;
    let pre: PreprocessSettings = settings_from(preprocess, "preprocessing")?;
    let drift: DriftOpts = settings_from(drift, "drift")?;
    let templates: TemplateChoice = settings_from(templates, "templates")?;
    let backend = backend_from(backend)?;
    let interrupt = Interrupt::default();
    let watch = SigintWatch::start(py);
    let result = py.allow_threads(|| -> anyhow::Result<String> {
        let job = detect_job(
            &paths, probe, &o, det, pre, drift, &templates, out, backend, &interrupt,
        )?;
        let report = guarded(|| {
            spikecube::pipeline::run_detection(
                job,
                &mut reporter(&interrupt, &progress, progress_dict),
            )
        })?;
        if interrupt.is_set() {
            anyhow::bail!("interrupted");
        }
        Ok(serde_json::json!({
            "out": report.summary.path,
            "spikes": report.summary.n_spikes,
            "windows": report.n_windows,
            "seconds": report.seconds,
            "wall_s": report.wall,
            "template_centres": report.n_centres,
            "boundary_duplicates_removed": report.boundary_duplicates_removed,
            "clipped_samples_masked": report.clipped_samples_masked,
            "scale_factor": report.scale_factor,
            "warnings": report.warnings,
        })
        .to_string())
    });
    watch.finish(py, interrupt, result)
}

fn sort_progress_dict<'py>(py: Python<'py>, p: &SortProgress) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("stage", p.stage)?;
    d.set_item("windows_done", p.done)?;
    d.set_item("windows_total", p.total)?;
    d.set_item("seconds_done", p.seconds_done)?;
    d.set_item("elapsed", p.elapsed)?;
    d.set_item("units", p.units)?;
    Ok(d)
}

/// The whole `spikecube sort` run (see `spikecube.sort`): detection, both
/// clusterings, matching, merges and the Phy folder at `out`. Returns the
/// run's report as JSON text.
#[pyfunction]
#[pyo3(signature = (paths, probe, recording_opts, detection, preprocess, drift, templates, sort, out, backend, progress=None))]
#[allow(clippy::too_many_arguments)]
fn sort(
    py: Python<'_>,
    paths: Vec<PathBuf>,
    probe: Option<ProbeTuple>,
    recording_opts: &str,
    detection: &str,
    preprocess: &str,
    drift: &str,
    templates: &str,
    sort: &str,
    out: PathBuf,
    backend: &str,
    progress: Option<Py<PyAny>>,
) -> PyResult<String> {
    let o: RecordingOpts = settings_from(recording_opts, "recording")?;
    let det: DetectionSettings = settings_from(detection, "detection")?;
    let pre: PreprocessSettings = settings_from(preprocess, "preprocessing")?;
    let drift: DriftOpts = settings_from(drift, "drift")?;
    let templates: TemplateChoice = settings_from(templates, "templates")?;
    let sort: SortFlags = settings_from(sort, "sort")?;
    let backend = backend_from(backend)?;
    let interrupt = Interrupt::default();
    let watch = SigintWatch::start(py);
    let result = py.allow_threads(|| -> anyhow::Result<String> {
        let nearest_chans = det.nearest_chans;
        let detect = detect_job(
            &paths, probe, &o, det, pre, drift, &templates, out, backend, &interrupt,
        )?;
        let job = SortJob {
            detect,
            sort: sort.settings(nearest_chans),
        };
        let mut report_to = reporter(&interrupt, &progress, sort_progress_dict);
        let report = guarded(|| run_sort(job, &mut report_to))?;
        if interrupt.is_set() {
            anyhow::bail!("interrupted");
        }
        let total: f64 = report.timings.iter().map(|t| t.1).sum();
        Ok(serde_json::json!({
            "out": report.phy.path,
            "units": report.phy.n_units,
            "good_units": report.phy.n_good,
            "spikes": report.phy.n_spikes,
            "seconds": report.seconds,
            "wall_s": total,
            "timings_s": report.timings.iter()
                .map(|(k, v)| ((*k).to_string(), serde_json::json!(v)))
                .collect::<serde_json::Map<_, _>>(),
            "warnings": report.warnings,
        })
        .to_string())
    });
    watch.finish(py, interrupt, result)
}

/// `spikecube preprocess`: writes the folder `out` as the command line does
/// ([`spikecube::preprocess_folder::write_preprocess_folder`]: staged, never
/// touching a file it did not write; `temp_wh.dat`, `whitening_mat.npy`,
/// `hp_filter.npy`, `spikecube.json`). Returns (whitening matrix, report JSON
/// with the folder's path as `out` and the whitened file's as `path`).
#[pyfunction]
#[pyo3(signature = (paths, probe, recording_opts, preprocess, out, float32, progress=None))]
#[allow(clippy::too_many_arguments)]
fn preprocess<'py>(
    py: Python<'py>,
    paths: Vec<PathBuf>,
    probe: Option<ProbeTuple>,
    recording_opts: &str,
    preprocess: &str,
    out: PathBuf,
    float32: bool,
    progress: Option<Py<PyAny>>,
) -> PyResult<(Bound<'py, PyArray2<f32>>, String)> {
    let o: RecordingOpts = settings_from(recording_opts, "recording")?;
    let pre: PreprocessSettings = settings_from(preprocess, "preprocessing")?;
    let interrupt = Interrupt::default();
    let format = if float32 {
        spikecube::pipeline::WhitenedFormat::Float32
    } else {
        spikecube::pipeline::WhitenedFormat::Int16x200
    };
    let result = py.allow_threads(|| -> anyhow::Result<(Array2<f32>, String)> {
        let (opened, probe, checks) = open_recording(&paths, probe, &o)?;
        let rec: Arc<dyn Recording> = Arc::new(Interruptible {
            inner: opened.recording.clone(),
            interrupt: interrupt.clone(),
        });
        let settings = PreprocessSettings {
            fs: rec.fs(),
            ..pre
        };
        // An interrupt unwinds through the staged folder, which removes itself.
        let (path, report) = guarded(|| {
            spikecube::preprocess_folder::write_preprocess_folder(
                rec.clone(),
                &probe,
                &settings,
                format,
                &out,
                &checks,
                &mut reporter(&interrupt, &progress, progress_dict),
            )
        })?;
        if interrupt.is_set() {
            anyhow::bail!("interrupted");
        }
        let json = serde_json::json!({
            "out": path,
            "path": path.join(spikecube::preprocess_folder::WHITENED_FILE),
            "input": rec.describe(),
            "n_samples": report.n_samples,
            "n_sites": report.n_sites,
            "n_windows": report.n_windows,
            "saturated": report.saturated,
            "wall_s": report.wall,
            "warnings": report.warnings,
            "settings": settings,
            "channel_map": probe.chan_map,
        });
        Ok((report.whitening, json.to_string()))
    });
    match result {
        Ok((w, j)) => Ok((w.into_pyarray(py), j)),
        Err(e) => Err(interrupt.into_err(e)),
    }
}

fn detections_dict<'py>(
    py: Python<'py>,
    det: &spikecube::Detections,
) -> PyResult<Bound<'py, PyDict>> {
    let n = det.len();
    let d = PyDict::new(py);
    d.set_item("centre", det.centre.clone().into_pyarray(py))?;
    d.set_item("sample", det.sample.clone().into_pyarray(py))?;
    d.set_item("amp", det.amp.clone().into_pyarray(py))?;
    d.set_item("imax", det.imax.clone().into_pyarray(py))?;
    d.set_item("sign", det.sign.clone().into_pyarray(py))?;
    d.set_item("yct", det.yct.clone().into_pyarray(py))?;
    let adist = Array2::from_shape_vec((n, det.n_chans), det.adist.clone())
        .map_err(|e| SpikecubeError::new_err(e.to_string()))?;
    d.set_item("adist", adist.into_pyarray(py))?;
    d.set_item("tF", det.tf_array().into_pyarray(py))?;
    Ok(d)
}

fn geometry_dict<'py>(py: Python<'py>, g: &Geometry) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("xcup", g.xcup.clone().into_pyarray(py))?;
    d.set_item("ycup", g.ycup.clone().into_pyarray(py))?;
    d.set_item("iC", g.i_c.mapv(i64::from).into_pyarray(py))?;
    d.set_item("iC2", g.i_c2.mapv(i64::from).into_pyarray(py))?;
    d.set_item("weigh", g.weigh.clone().into_pyarray(py))?;
    d.set_item("dmin", g.dmin)?;
    Ok(d)
}

fn choose_detector(
    backend: Backend,
    geometry: Geometry,
    settings: &DetectionSettings,
) -> anyhow::Result<Detector> {
    let chosen = spikecube::backend::choose(backend)?;
    Ok(Detector::new(
        &chosen,
        geometry,
        UniversalTemplates::builtin(),
        settings.clone(),
    )?)
}

/// Detection in one whitened window X (C × N, float32). Returns
/// (detections dict, geometry dict).
#[pyfunction]
fn detect_window<'py>(
    py: Python<'py>,
    x: PyReadonlyArray2<'py, f32>,
    probe: ProbeTuple,
    detection: &str,
    backend: &str,
) -> PyResult<(Bound<'py, PyDict>, Bound<'py, PyDict>)> {
    let settings: DetectionSettings = settings_from(detection, "detection")?;
    let backend = backend_from(backend)?;
    let probe = probe_from(probe)?;
    let x = x.as_array().to_owned();
    let (det, geometry) = py
        .allow_threads(|| -> anyhow::Result<_> {
            settings.validate()?;
            if x.nrows() != probe.n_sites() {
                anyhow::bail!(
                    "X has {} rows but the probe has {} sites (X is channels × samples)",
                    x.nrows(),
                    probe.n_sites()
                );
            }
            let geometry = Geometry::new(&probe, &settings)?;
            let mut d = choose_detector(backend, geometry.clone(), &settings)?;
            Ok((d.detect(x.view(), &probe.yc)?, geometry))
        })
        .map_err(to_py)?;
    Ok((detections_dict(py, &det)?, geometry_dict(py, &geometry)?))
}

/// A recording read through a Python callable `get_traces(start, end)`
/// returning float32 (end − start) × n_channels (time-major), e.g. a
/// SpikeInterface recording's `get_traces`.
struct CallbackRecording {
    get_traces: Py<PyAny>,
    n_channels: usize,
    n_samples: u64,
    fs: f64,
    what: String,
}

impl Recording for CallbackRecording {
    fn n_channels(&self) -> usize {
        self.n_channels
    }
    fn n_samples(&self) -> u64 {
        self.n_samples
    }
    fn fs(&self) -> f64 {
        self.fs
    }
    fn first_sample(&self) -> u64 {
        0
    }
    fn read_channels(
        &self,
        start: u64,
        count: usize,
        chan_map: &[u64],
        out: &mut [f32],
    ) -> Result<(), RecordingError> {
        let err = |message: String| RecordingError::Read {
            what: self.what.clone(),
            message,
        };
        if start + count as u64 > self.n_samples || out.len() != chan_map.len() * count {
            return Err(err(format!(
                "read of {count} samples from {start} outside {} samples",
                self.n_samples
            )));
        }
        Python::with_gil(|py| -> PyResult<()> {
            let a = self.get_traces.call1(py, (start, start + count as u64))?;
            let a = a.bind(py).downcast::<PyArray2<f32>>()?.readonly();
            let a = a.as_array();
            if a.dim() != (count, self.n_channels) {
                return Err(SpikecubeError::new_err(format!(
                    "get_traces gave {:?}, expected ({count}, {})",
                    a.dim(),
                    self.n_channels
                )));
            }
            for (r, &c) in chan_map.iter().enumerate() {
                let col = a.index_axis(Axis(1), c as usize);
                for (o, v) in out[r * count..(r + 1) * count].iter_mut().zip(col.iter()) {
                    *o = *v;
                }
            }
            Ok(())
        })
        .map_err(|e| err(e.to_string()))
    }
    fn describe(&self) -> String {
        self.what.clone()
    }
}

/// The whitening fit of a `detect` run on a recording read through
/// `get_traces(start, end)`. Returns (whitening matrix, scale factor,
/// batch_size used, n_windows, n_used, warnings).
#[pyfunction]
#[pyo3(signature = (get_traces, n_channels, n_samples, fs, what, probe, preprocess, auto_scale, mask_clipped))]
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
fn fit_whitening<'py>(
    py: Python<'py>,
    get_traces: Py<PyAny>,
    n_channels: usize,
    n_samples: u64,
    fs: f64,
    what: String,
    probe: ProbeTuple,
    preprocess: &str,
    auto_scale: bool,
    mask_clipped: bool,
) -> PyResult<(Bound<'py, PyArray2<f32>>, f64, u64, u64, u64, Vec<String>)> {
    let pre: PreprocessSettings = settings_from(preprocess, "preprocessing")?;
    let probe = probe_from(probe)?;
    let interrupt = Interrupt::default();
    let rec: Arc<dyn Recording> = Arc::new(Interruptible {
        inner: Arc::new(CallbackRecording {
            get_traces,
            n_channels,
            n_samples,
            fs,
            what,
        }),
        interrupt: interrupt.clone(),
    });
    let checks = Checks {
        auto_scale,
        mask_clipped,
        ..Checks::default()
    };
    let fit = py
        .allow_threads(|| spikecube::pipeline::fit_whitening_for(&rec, &probe, &pre, &checks))
        .map_err(|e| interrupt.into_err(e))?;
    Ok((
        fit.whitening.into_pyarray(py),
        fit.scale_factor,
        fit.plan.batch_size,
        fit.plan.n_windows,
        fit.plan.n_used,
        fit.warnings,
    ))
}

/// Preprocessing and detection of windows cut by the caller (the
/// SpikeInterface method), with a fitted whitening matrix.
#[pyclass(unsendable)]
struct ChunkDetector {
    probe: Probe,
    whitening: Array2<f32>,
    preprocess: PreprocessSettings,
    detection: DetectionSettings,
    mask_clipped: bool,
    detector: Detector,
    geometry: Geometry,
    preprocessors: HashMap<usize, Preprocessor>,
}

#[pymethods]
impl ChunkDetector {
    #[new]
    #[pyo3(signature = (probe, whitening, preprocess, detection, mask_clipped, backend))]
    fn new(
        py: Python<'_>,
        probe: ProbeTuple,
        whitening: PyReadonlyArray2<'_, f32>,
        preprocess: &str,
        detection: &str,
        mask_clipped: bool,
        backend: &str,
    ) -> PyResult<Self> {
        let probe = probe_from(probe)?;
        let preprocess: PreprocessSettings = settings_from(preprocess, "preprocessing")?;
        let detection: DetectionSettings = settings_from(detection, "detection")?;
        let backend = backend_from(backend)?;
        let whitening = whitening.as_array().to_owned();
        py.allow_threads(|| -> anyhow::Result<Self> {
            detection.validate()?;
            preprocess.validate()?;
            let geometry = Geometry::new(&probe, &detection)?;
            let detector = choose_detector(backend, geometry.clone(), &detection)?;
            Ok(ChunkDetector {
                probe,
                whitening,
                preprocess,
                detection,
                mask_clipped,
                detector,
                geometry,
                preprocessors: HashMap::new(),
            })
        })
        .map_err(to_py)
    }

    /// The detector's geometry (xcup, ycup, iC, iC2, weigh, dmin).
    fn geometry<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        geometry_dict(py, &self.geometry)
    }

    /// Preprocesses raw window `x` (C × N float32, rows in the probe's order,
    /// columns `lo..hi` real samples, the rest edge padding, repeating the edge
    /// sample when `pad_repeats`) as `detect` does, detects, and keeps the
    /// detections at columns `nt .. nt + own_len`.
    fn detect<'py>(
        &mut self,
        py: Python<'py>,
        x: PyReadonlyArray2<'py, f32>,
        lo: usize,
        hi: usize,
        pad_repeats: bool,
        own_len: u64,
    ) -> PyResult<Bound<'py, PyDict>> {
        let mut w = x.as_array().to_owned();
        let nt = self.detection.nt;
        let det = (|| -> anyhow::Result<_> {
            let n = w.ncols();
            if n < 2 * nt + nt || w.nrows() != self.probe.n_sites() {
                anyhow::bail!(
                    "window is {:?}; expected {} rows and at least {} columns",
                    w.dim(),
                    self.probe.n_sites(),
                    3 * nt
                );
            }
            if !self.preprocessors.contains_key(&n) {
                let s = PreprocessSettings {
                    batch_size: n - 2 * nt,
                    nt,
                    ..self.preprocess.clone()
                };
                self.preprocessors
                    .insert(n, Preprocessor::new(&s, self.whitening.clone())?);
            }
            let pre = &self.preprocessors[&n];
            let detector = &mut self.detector;
            let yc = &self.probe.yc;
            let mask = self.mask_clipped;
            let fs = self.preprocess.fs;
            py.allow_threads(|| -> anyhow::Result<_> {
                if mask {
                    let runs = checks::find_stuck_runs(&w, lo, hi, checks::stuck_min_run(fs));
                    checks::fill_stuck_runs(&mut w, &runs, lo, hi, pad_repeats);
                }
                pre.apply(&mut w)?;
                let mut det = detector.detect(w.view(), yc)?;
                let end = nt as u64 + own_len;
                det.retain(|_, t| t >= nt as u64 && t < end);
                Ok(det)
            })
        })()
        .map_err(to_py)?;
        detections_dict(py, &det)
    }
}

/// The GPU back ends compiled into this build ("auto", "cpu", maybe "cuda", "wgpu").
#[pyfunction]
fn backends() -> Vec<&'static str> {
    Backend::compiled()
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    install_logging();
    m.add("SpikecubeError", m.py().get_type::<SpikecubeError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("TROUGH_OFFSET", spikecube::output::TROUGH_OFFSET)?;
    m.add_function(wrap_pyfunction!(load_probe, m)?)?;
    m.add_function(wrap_pyfunction!(check_probe, m)?)?;
    m.add_function(wrap_pyfunction!(detect, m)?)?;
    m.add_function(wrap_pyfunction!(sort, m)?)?;
    m.add_function(wrap_pyfunction!(preprocess, m)?)?;
    m.add_function(wrap_pyfunction!(detect_window, m)?)?;
    m.add_function(wrap_pyfunction!(fit_whitening, m)?)?;
    m.add_function(wrap_pyfunction!(backends, m)?)?;
    m.add_function(wrap_pyfunction!(set_log_level, m)?)?;
    m.add_function(wrap_pyfunction!(set_threads, m)?)?;
    m.add_class::<ChunkDetector>()?;
    Ok(())
}
