"""spikecube as a SpikeInterface peak-detection method.

Importing this module registers :class:`SpikecubePeakDetector` as
``detect_peak_methods["spikecube"]`` (SpikeInterface ≥ 0.103 has no plug-in
entry point; it registers its own methods the same way)::

    import spikecube.spikeinterface  # registers method="spikecube"
    from spikeinterface.sortingcomponents.peak_detection import detect_peaks
    peaks = detect_peaks(rec, method="spikecube", method_kwargs=dict(Th_universal=9),
                         job_kwargs=dict(chunk_size=60000, n_jobs=2))

or, faster when the recording is a plain binary file,
``spikecube.spikeinterface.detect(rec)``.

It also registers the sorter ``"spikecube"`` (:class:`SpikecubeSorter`, the
whole ``spikecube sort``) for ``run_sorter``::

    import spikecube.spikeinterface  # registers sorter "spikecube"
    from spikeinterface.sorters import run_sorter
    sorting = run_sorter("spikecube", rec, folder="sorted", Th_learned=8)

Two paths, the same spikes (see README, "Python"):

* **chunked** (``detect_peaks(..., method="spikecube")``): works on any
  recording. The whitening is fitted once, when the node is made, on the
  windows a ``spikecube detect`` run would use; each chunk is then cut into
  the window ``detect`` would cut (``nt`` = 61 samples on each side, the
  recording's first/last sample repeated past its ends instead of
  SpikeInterface's zeros), preprocessed and searched, and the detections in
  the margins are dropped. With ``chunk_size = batch_size`` (60 000 by
  default) the chunks are ``detect``'s windows and the peaks are
  ``spikecube detect --keep-boundary-duplicates``'s spikes exactly: chunks
  are independent, so an event straddling a chunk boundary may be reported
  by both chunks, as Kilosort4 does. Other chunk sizes give windows of the
  chunk's size (the same preprocessing on different windows: nearly, not
  exactly, the same spikes).
* **fast** (:func:`detect`): for a binary-compatible recording, the file is
  handed to the Rust pipeline directly (read ahead on a thread, no Python per
  chunk), with the command line's defaults, including the removal of
  duplicate detections across window boundaries.

Peaks follow SpikeInterface's conventions: ``sample_index`` at the trough
(spikecube's detection time − 10), ``channel_index`` the recording channel of
the probe site where the winning template's output is largest, ``amplitude``
the signed trace value there, in the units of the traces handed in (the raw
values, e.g. int16 counts for ``read_binary``; not µV unless the recording
gives µV). Extra fields: ``x``, ``y`` (µm: centre x, amplitude-weighted
depth), ``template_index`` (winning size·6 + template, 0–29), ``sign`` (+1
trough-first), ``center`` (template centre) and ``detection_amplitude`` (|A|,
whitened units).
"""

from __future__ import annotations

import logging
import os

import numpy as np

import spikecube

from . import Probe, _native, _settings
from . import detect as _detect_file

try:
    from spikeinterface.core.node_pipeline import PeakDetector
except ImportError as e:  # pragma: no cover
    raise ImportError("spikecube.spikeinterface needs SpikeInterface >= 0.103 (pip install spikeinterface)") from e
try:
    from spikeinterface.core.base import base_peak_dtype
except ImportError:  # SpikeInterface 0.103
    from spikeinterface.core.node_pipeline import base_peak_dtype

try:
    from spikeinterface.sortingcomponents.peak_detection.method_list import detect_peak_methods
except ImportError:  # SpikeInterface 0.103, 0.104: one module
    from spikeinterface.sortingcomponents.peak_detection import detect_peak_methods

#: SpikeInterface's peak dtype and spikecube's extra fields.
peak_dtype = np.dtype(
    list(base_peak_dtype)
    + [
        ("x", "float32"),
        ("y", "float32"),
        ("template_index", "int16"),
        ("sign", "int8"),
        ("center", "int32"),
        ("detection_amplitude", "float32"),
    ]
)

# The chunked path preprocesses and detects each chunk with the built-in
# templates: the settings of the templates, the drift correction, the artifact
# blanking and the worker pool are the whole-run paths' (``detect``, the sorter).
_NODE_SETTINGS = {
    k for k, (g, _) in _settings.SETTINGS.items() if g in ("detection", "preprocessing", "recording")
} - {
    "tmin",
    "tmax",
    "exclude_channels",
    "keep_boundary_duplicates",
    "shift",
    "artifact_times",
    "artifact_window",
    "blank_transients",
}


def _get_traces(recording, segment_index):
    def get(start, end):
        t = recording.get_traces(segment_index=segment_index, start_frame=int(start), end_frame=int(end))
        return np.ascontiguousarray(t, dtype=np.float32)

    return get


class SpikecubePeakDetector(PeakDetector):
    """Kilosort4's universal-template detection (spikecube) on each chunk.

    The whitening is fitted at construction (Kilosort4's fit over every
    ``nskip``-th window of ``batch_size`` samples, as ``spikecube detect``
    does); each chunk is preprocessed as ``detect`` preprocesses a window and
    searched with the 30 universal templates. Use ``chunk_size=batch_size``
    (job kwargs) for ``spikecube detect``'s windows exactly.
    """

    name = "spikecube"
    engine = "spikecube"
    need_noise_levels = False
    # Rayon's thread pool does not survive fork(): workers are spawned.
    preferred_mp_context = "spawn"
    params_doc = """
    backend: str, default "cpu"
        Where detection runs ("cpu", or "auto"/"cuda"/"wgpu" in GPU builds).
    **settings:
        Kilosort4's settings by name: Th_universal (9), nearest_chans (10),
        batch_size (60000), highpass_cutoff (300), whitening_range (32), nskip (25),
        do_CAR (True), ... and spikecube's mask_clipped (True), scale (None:
        automatic rescaling of data far from int16 scale). spikecube.settings() lists them.
    """

    def __init__(self, recording, return_output=True, backend="cpu", **settings):
        PeakDetector.__init__(self, recording, return_output=return_output)
        self.recording = recording
        groups = _settings.split(settings, _NODE_SETTINGS)
        self._det = groups["detection"]
        self._pre = groups["preprocessing"]
        rec_opts = groups["recording"]
        self._mask_clipped = bool(rec_opts["mask_clipped"])
        self._scale = rec_opts["scale"]
        self._backend = backend
        self._nt = int(self._det["nt"])
        self._probe = Probe.from_recording(recording)
        fs = float(recording.get_sampling_frequency())
        self._fs = fs
        spikecube._sync_log_level()
        # One whitening fit per segment (each segment is a recording of its own).
        self._fits = []
        for seg in range(recording.get_num_segments()):
            n = int(recording.get_num_samples(segment_index=seg))
            get = _get_traces(recording, seg)
            if self._scale is not None:
                k = float(self._scale)
                get = (lambda g: lambda s, e: (g(s, e) * np.float32(k)))(get)
            w, factor, batch, n_windows, n_used, warnings = _native.fit_whitening(
                get,
                int(recording.get_num_channels()),
                n,
                fs,
                f"SpikeInterface recording segment {seg} ({n} samples at {fs} Hz)",
                self._probe._tuple(),
                _settings.preprocessing_json(self._pre, fs=fs, nt=self._nt),
                self._scale is None,
                self._mask_clipped,
            )
            for w_ in warnings:
                logging.getLogger("spikecube").warning(w_)
            self._fits.append(
                dict(whitening=w, scale_factor=factor, batch_size=int(batch), n_windows=int(n_windows),
                     n_used=int(n_used), n_samples=n, warnings=list(warnings))
            )
        self._kwargs.update(dict(backend=backend, **settings))
        self._native = {}
        self._geometry = None

    # Rust objects do not pickle: workers build their own.
    def __getstate__(self):
        d = self.__dict__.copy()
        d["_native"] = {}
        return d

    def __setstate__(self, d):
        self.__dict__.update(d)

    def get_margin(self):
        return self._nt

    def get_dtype(self):
        return peak_dtype

    def _detector(self, segment_index):
        nd = self._native.get(segment_index)
        if nd is None:
            fit = self._fits[segment_index]
            pre = dict(self._pre, batch_size=fit["batch_size"])
            nd = _native.ChunkDetector(
                self._probe._tuple(),
                fit["whitening"],
                _settings.preprocessing_json(pre, fs=self._fs, nt=self._nt),
                _settings.detection_json(self._det),
                self._mask_clipped,
                self._backend,
            )
            self._native[segment_index] = nd
            if self._geometry is None:
                self._geometry = nd.geometry()
        return nd

    def compute(self, traces, start_frame, end_frame, segment_index, max_margin):
        nt = self._nt
        fit = self._fits[segment_index]
        B, N = fit["batch_size"], fit["n_samples"]
        s, e = int(start_frame), int(end_frame)
        empty = (np.zeros(0, dtype=peak_dtype),)
        aligned = s % B == 0 and (e - s == B or e == N)
        if aligned:
            i = s // B
            if i >= fit["n_windows"]:
                return empty  # a tail shorter than nt: Kilosort4 skips it too
            single = fit["n_windows"] == 1
            limit = N if single else fit["n_used"]
            own = min(B, limit - s)
            L = B + 2 * nt
        else:
            single = False
            limit = N
            own = e - s
            if own < nt:
                return empty
            L = own + 2 * nt
        first = s - nt  # absolute sample of window column 0 and of traces row 0
        idx = np.arange(first, first + L)
        real = (idx >= 0) & (idx < limit)
        lo = int(np.argmax(real))
        hi = lo + int(real.sum())
        rows = np.clip(idx, 0, limit - 1) - first
        chan_map = self._probe.chanMap
        win = np.ascontiguousarray(np.asarray(traces)[rows][:, chan_map].T, dtype=np.float32)
        if self._scale is not None:
            win *= np.float32(self._scale)
        if single:
            win[:, hi:] = 0.0
        det = self._detector(segment_index).detect(win, lo, hi, not single, own)
        return (self._peaks(det, traces, first, segment_index),)

    def _peaks(self, det, traces, first, segment_index):
        """Peaks from window detections (window column c = traces row c)."""
        g = self._geometry
        t = det["sample"].astype(np.int64)
        j = det["centre"].astype(np.int64)
        order = np.lexsort((j, t))
        t, j = t[order], j[order]
        adist = det["adist"][order]
        n = t.size
        peaks = np.zeros(n, dtype=peak_dtype)
        if n == 0:
            return peaks
        best = np.argmax(np.abs(adist), axis=1) if adist.shape[1] else np.zeros(n, np.int64)
        site = g["iC"][best, j]
        chan = self._probe.chanMap[site]
        trough = np.maximum(t - _native.TROUGH_OFFSET, -first)  # not before sample 0
        peaks["sample_index"] = trough
        peaks["channel_index"] = site
        peaks["amplitude"] = np.asarray(traces)[trough, chan]
        peaks["segment_index"] = segment_index
        peaks["x"] = g["xcup"][j]
        peaks["y"] = det["yct"][order]
        peaks["template_index"] = det["imax"][order]
        peaks["sign"] = det["sign"][order]
        peaks["center"] = j
        peaks["detection_amplitude"] = det["amp"][order]
        return peaks


detect_peak_methods["spikecube"] = SpikecubePeakDetector


def _binary_file(recording):
    """(file path, dtype, n_channels, offset) when the recording is one
    time-major binary file whose channels are the recording's, else None."""
    try:
        if recording.get_num_segments() != 1 or not recording.is_binary_compatible():
            return None
        d = recording.get_binary_description()
    except Exception:
        return None
    if d.get("time_axis", 0) != 0 or len(d.get("file_paths", [])) != 1:
        return None
    if int(d["num_channels"]) != recording.get_num_channels():
        return None
    dtype = np.dtype(d["dtype"])
    if dtype.name not in ("int16", "uint16", "int32", "float32") or dtype.byteorder == ">":
        return None
    return str(d["file_paths"][0]), dtype.name, int(d["num_channels"]), int(d.get("file_offset", 0))


def detect(recording, *, out=None, backend="auto", progress=True, job_kwargs=None, **settings):
    """spikecube's spikes of a SpikeInterface recording, as SpikeInterface peaks.

    When the recording is one binary-compatible file (``read_binary``, a
    saved recording) whose channels are the recording's, the file goes to the
    Rust pipeline directly (the fast path: ``spikecube.detect`` on the file,
    with the recording's channel locations as the probe). Otherwise this runs
    ``detect_peaks(recording, method="spikecube", ...)`` with ``chunk_size =
    batch_size``. See the module's docs for how the two differ.

    Parameters
    ----------
    recording : BaseRecording
    out : path, optional
        Fast path only: also keep the output folder there.
    backend, progress, **settings
        As :func:`spikecube.detect` (Kilosort4's setting names).
    job_kwargs : dict, optional
        Chunked path: SpikeInterface's job kwargs (``n_jobs``, ...); its
        ``chunk_size`` is always ``batch_size``.

    Returns
    -------
    np.ndarray (n,) of :data:`peak_dtype`
        ``sample_index`` (trough, samples), ``channel_index``, ``amplitude``
        (signed, units of the recording's traces), ``segment_index``, ``x``,
        ``y`` (µm), ``template_index``, ``sign``, ``center``,
        ``detection_amplitude`` (|A|, whitened).
    """
    for k in ("tmin", "tmax"):
        if k in settings:
            raise ValueError(f"{k}: give a time range as recording.frame_slice(start_frame, end_frame)")
    binary = _binary_file(recording)
    if binary is None:
        from spikeinterface.sortingcomponents.peak_detection import detect_peaks

        jk = dict(job_kwargs or {})
        jk["chunk_size"] = int(settings.get("batch_size", 60000))
        jk.pop("chunk_duration", None)
        return detect_peaks(
            recording,
            method="spikecube",
            method_kwargs=dict(settings, backend="cpu" if backend == "auto" else backend),
            job_kwargs=jk,
        )
    path, dtype, n_channels, offset = binary
    r = _detect_file(
        path,
        Probe.from_recording(recording),
        n_channels=n_channels,
        fs=recording.get_sampling_frequency(),
        dtype=dtype,
        offset=offset,
        out=out,
        backend=backend,
        progress=progress,
        **settings,
    )
    n = len(r)
    peaks = np.zeros(n, dtype=peak_dtype)
    peaks["sample_index"] = r.peaks["sample_index"]
    peaks["channel_index"] = r.peaks["channel_index"]
    raw = np.memmap(path, dtype=dtype, mode="r", offset=offset)
    raw = raw[: raw.size - raw.size % n_channels].reshape(-1, n_channels)
    chan = r.channel_map[r.peaks["channel_index"]]
    peaks["amplitude"] = raw[r.peaks["sample_index"], chan] if n else 0.0
    peaks["segment_index"] = 0
    peaks["x"] = r.positions[:, 0]
    peaks["y"] = r.positions[:, 1]
    peaks["template_index"] = r.templates
    peaks["sign"] = r.signs
    peaks["center"] = r.centers
    peaks["detection_amplitude"] = r.amplitudes
    return peaks


# ---------------------------------------------------------------------------
# The sorter

from spikeinterface.sorters import BaseSorter  # noqa: E402
from spikeinterface.sorters import sorterlist as _sorterlist  # noqa: E402

#: Settings a sorter run takes: Kilosort4's names, less the time range (give
#: SpikeInterface a ``frame_slice``) and what the recording itself says.
_SORTER_SETTINGS = [k for k in _settings.SETTINGS if k not in ("tmin", "tmax", "shift", "scale")]

# What the settings mean, where more than Kilosort4's name is worth saying:
# spikecube's own settings (the command line's flags in snake case) and the
# ones that choose the templates, the drift correction and the worker pool.
_OWN_SETTINGS = {
    "neighbourhoods": "Folder with Kilosort4's iC.npy, iC2.npy and weigh.npy, for exact comparisons",
    "exclude_channels": "File channels to leave out (the role of Kilosort4's bad_channels)",
    "mask_clipped": "Replace stuck (clipped) stretches by the channel's median before filtering",
    "keep_boundary_duplicates": "Keep both detections of an event on a window boundary, as Kilosort4 does",
    "cluster_init_generator": "Generator of the clusters' seeding draws: torch (Kilosort4's CPU draws) or chacha8",
    "ks4_swarm_ccg_bug": "Kilosort4 4.1.5-4.1.7's skipped refractory test in the final clustering's tree",
    "same_template_amplitude_ratio": (
        "Two units whose most frequent learned template is the same merge only when the smaller "
        "of their median amplitudes (amplitudes.npy) is at least this fraction of the larger "
        "(0: Kilosort4's merges, the CCG alone decides)"
    ),
    "keep_windows_gb": (
        "GB for keeping the detection's preprocessed windows for the matching "
        "(None: half of the GPU's free memory with CUDA, else a third of the host memory the process "
        "may still take under its job's limit; 0: none; the sort is the same either way)"
    ),
    "templates_from_data": (
        "Learn the universal templates from the recording (Kilosort4's templates_from_data); "
        "False: Kilosort4's built-in ones; None: learned unless templates is given"
    ),
    "templates": "A .npz file holding wTEMP and wPCA, used instead of learning the universal templates",
    "Th_single_ch": "Threshold of the single-channel peaks the templates are learned from, whitened units",
    "seed": "Seed of the k-means++ draws when learning templates (same seed, same templates on any machine)",
    "min_learn_clips": "Fewer isolated peaks than this: the built-in templates are used, with a warning",
    "template_check": "Realign or replace a learned template whose peak is off centre, with a warning",
    "nblocks": "Drift correction: 0 off, 1 rigid, n > 1 non-rigid in 2n - 1 depth blocks (Kilosort4's nblocks)",
    "drift_smoothing": "Gaussian sigma of the drift scores over lag, window and block: three numbers",
    "sig_interp": "Width of the drift correction's interpolation kernel, um (Kilosort4's sig_interp)",
    "binning_depth": "Height of the depth bins of the drift histogram, um (Kilosort4's binning_depth)",
    "drift_mode": (
        "'spikecube' makes Kilosort4's drift sharp edges safe (empty windows, probes too short for the "
        "search, too many blocks); 'kilosort' keeps them, with warnings"
    ),
    "drift_edge_margin": (
        "um: sites whose drift-corrected position lies more than this beyond the probe's end read zero; "
        "inf keeps Kilosort4's extrapolation"
    ),
    "drift_only": "Stop after the drift estimate (detection only; a sort refuses it)",
    "artifact_times": (
        "Stimulus-artifact times, seconds from the recording's start: a file (text, CSV or .npy) "
        "or a list of times; the preprocessed data are set to zero over artifact_window around each"
    ),
    "artifact_window": "Stretch set to zero around each artifact: (ms before, ms after)",
    "blank_transients": "Also set to zero the preprocessed data around transients common to most channels",
    "threads": (
        "CPU worker threads (None: RAYON_NUM_THREADS, else one per core); fixed at a process's first "
        "spikecube run"
    ),
}


class SpikecubeSorter(BaseSorter):
    """spikecube's whole sort (``spikecube sort``: Kilosort4 4.1.7's pipeline
    in Rust) as a SpikeInterface sorter: ``run_sorter("spikecube", rec, ...)``.

    A recording that is one binary file (``read_binary``, a saved recording,
    ...) is read where it lies; any other is first written to
    ``sorter_output/recording.dat`` in its own dtype (float32 when it has
    none spikecube reads). The Phy folder is ``sorter_output/phy``, read
    back with ``read_kilosort``; open it with ``phy template-gui
    sorter_output/phy/params.py``. Parameters are Kilosort4's settings by
    name (:func:`spikecube.settings`), plus ``backend`` and ``progress``.
    """

    sorter_name = "spikecube"
    requires_locations = True
    gpu_capability = "nvidia-optional"
    requires_binary_data = False
    compatible_with_parallel = {"loky": True, "multiprocessing": True, "threading": True}
    handle_multi_segment = False

    _default_params = dict(
        {k: _settings.SETTINGS[k][1] for k in _SORTER_SETTINGS},
        backend="auto",
        progress=False,
    )
    _params_description = dict(
        {
            k: _OWN_SETTINGS.get(k, f"Kilosort4's {k} (spikecube.settings() and README list them)")
            for k in _SORTER_SETTINGS
        },
        backend="Where the sort's detection and matching run: auto, cpu, cuda or wgpu",
        progress="Show a progress bar per stage (tqdm)",
    )
    sorter_description = (
        "spikecube: Kilosort4 4.1.7's sort (drift correction, universal and learned templates, "
        "graph clustering, CCG merges) in Rust, on CUDA, Vulkan or the CPU."
    )
    installation_mesg = "pip install spikecube (or build it with maturin from the spikecube repository)"

    @classmethod
    def is_installed(cls):
        return True

    @classmethod
    def get_sorter_version(cls):
        return spikecube.__version__

    @classmethod
    def _check_params(cls, recording, output_folder, params):
        settings = {k: v for k, v in params.items() if k not in ("backend", "progress")}
        # Raises ValueError naming an unknown setting or a value of the wrong
        # type; the values are kept as checked (paths as str, plain numbers),
        # which SpikeInterface then writes to its parameters file.
        groups = _settings.split(settings)
        params = dict(params)
        for k in settings:
            name = _settings.ALIASES.get(k, k)
            params[k] = groups[_settings.SETTINGS[name][0]][name]
            # Files are looked for now, before the recording is copied.
            kind = _settings.KINDS[name].rstrip("?")
            if kind in ("path", "times") and isinstance(params[k], str):
                if not os.path.exists(params[k]):
                    raise ValueError(f"{k} = {params[k]!r}: no such file")
        return params

    @classmethod
    def _setup_recording(cls, recording, sorter_output_folder, params, verbose):
        from pathlib import Path as _Path

        out = _Path(sorter_output_folder)
        binary = _binary_file(recording)
        if binary is None:
            from spikeinterface.core import write_binary_recording

            dtype = np.dtype(recording.get_dtype())
            if dtype.name not in ("int16", "uint16", "int32", "float32"):
                dtype = np.dtype("float32")
            path = out / "recording.dat"
            write_binary_recording(recording, file_paths=[path], dtype=dtype)
            binary = (str(path), dtype.name, recording.get_num_channels(), 0)
        path, dtype, n_channels, offset = binary
        probe = Probe.from_recording(recording)
        job = {
            "path": path,
            "dtype": dtype,
            "n_channels": n_channels,
            "offset": offset,
            "fs": float(recording.get_sampling_frequency()),
            "probe": {"xc": probe.xc.tolist(), "yc": probe.yc.tolist(), "kcoords": probe.kcoords.tolist(),
                      "chanMap": probe.chanMap.tolist(), "n_chan": int(probe.n_chan)},
        }
        import json as _json

        (out / "spikecube_input.json").write_text(_json.dumps(job))

    @classmethod
    def _run_from_folder(cls, sorter_output_folder, params, verbose):
        import json as _json
        from pathlib import Path as _Path

        out = _Path(sorter_output_folder)
        job = _json.loads((out / "spikecube_input.json").read_text())
        p = job["probe"]
        probe = Probe(p["xc"], p["yc"], p["kcoords"], p["chanMap"], p["n_chan"], "SpikeInterface recording")
        settings = {k: v for k, v in params.items() if k not in ("backend", "progress")}
        spikecube.sort(
            job["path"],
            probe,
            out=out / "phy",
            n_channels=job["n_channels"],
            fs=job["fs"],
            dtype=job["dtype"],
            offset=job["offset"],
            backend=params.get("backend", "auto"),
            progress=bool(params.get("progress", False)),
            **settings,
        )

    @classmethod
    def _get_result_from_folder(cls, sorter_output_folder):
        from pathlib import Path as _Path

        from spikeinterface.extractors import read_kilosort

        return read_kilosort(_Path(sorter_output_folder) / "phy", keep_good_only=False)


_sorterlist.sorter_dict[SpikecubeSorter.sorter_name] = SpikecubeSorter
if SpikecubeSorter not in _sorterlist.sorter_full_list:
    _sorterlist.sorter_full_list.append(SpikecubeSorter)
