//! The GPU detector: the five steps of [`crate::detect::cpu`] as CubeCL kernels,
//! one file per step beside the CPU function it mirrors:
//!
//! | step | CPU twin | kernel |
//! |---|---|---|
//! | 1 filter bank | [`cpu::filter_bank`] | [`filter_bank`] |
//! | 2 centre response | [`cpu::centre_response`] / [`cpu::centre_response_pruned`] | [`centre_response`] |
//! | 3 neighbour max | [`cpu::neighbour_max`] | [`neighbour_max`] |
//! | 4 local peaks | [`cpu::local_peaks`] | [`local_peaks`] |
//! | 5 features | [`cpu::features`] | [`features`] |
//!
//! [`GpuDetector`] has the interface of [`CpuDetector`](crate::detect::cpu::CpuDetector):
//! its device buffers persist across windows, a window is one upload, five to six
//! launches and one download of the detections.
//!
//! Numerics: every sum runs in the CPU's order and every product that is then
//! added is rounded first ([`exact::product`]: GPU compilers would otherwise
//! contract `a + w·x` into a fused multiply-add, NVRTC by default), so the
//! outputs are the CPU's bits (tested on wgpu and CUDA).

pub mod blocks;
pub mod centre_response;
pub mod exact;
pub mod features;
pub mod filter_bank;
pub mod gram;
pub mod highpass_iir;
pub mod learn_clips;
pub mod local_peaks;
pub mod neighbour_max;
#[cfg(feature = "cuda")]
pub mod pinned;
pub mod preprocess;
pub mod upload;

use std::time::Instant;

#[cfg(feature = "cuda")]
use std::sync::Arc;

use cubecl::prelude::*;
use cubecl::server::Handle;
use ndarray::ArrayView2;

#[allow(unused_imports)]
use crate::detect::cpu;
use crate::detect::cpu::{Detections, NK};
use crate::detect::geometry::Geometry;
use crate::detect::settings::DetectionSettings;
use crate::detect::templates::UniversalTemplates;
use crate::error::DetectError;
use crate::preprocess::DevicePreprocessing;

use blocks::RowBlocks;

/// How steps 2–4 run on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuOptions {
    /// Step 2 skips (j, t) whose Cauchy–Schwarz bound is below Th_universal
    /// (the CPU's pruned path skips by a tighter bound; both detect the same
    /// spikes); false computes every value (Kilosort4's arrays).
    pub pruned: bool,
    /// Step 3 runs only at candidates (As > Th_universal) inside step 4 instead of
    /// as a dense pass over all centres and samples.
    pub sparse_peaks: bool,
    /// Samples per unit in step 1 (1 to 8).
    pub fb_per_unit: usize,
    /// Floats per upload chunk (0: the window in one piece).
    pub upload_chunk: usize,
    /// Consecutive outputs per unit of the high-pass kernel (8 or 16; the
    /// same values either way). Default 16; the environment variable
    /// `SPIKECUBE_HIGHPASS_PER_UNIT` (8 or 16) overrides it, for measuring.
    pub hp_per_unit: usize,
    /// Which high-pass runs: the circular IIR (f64) where the device and the
    /// window allow, else the direct kernel ([`highpass_iir::HighpassMode`]).
    /// Default `Auto`; the environment variable `SPIKECUBE_HIGHPASS`
    /// (`direct`, `iir`, `iir-f32`) overrides it, for measuring.
    pub highpass: highpass_iir::HighpassMode,
    /// The whitening kernel's cubes laid out rows first (true, the default)
    /// or samples first (the environment variable `SPIKECUBE_WHITEN_GRID=samples`,
    /// for measuring); the same values either way.
    pub whiten_rows_first: bool,
    /// The whitening fit's covariance and the int16 channel means in f64,
    /// with the CPU's bits, where the device has doubles (true, the default);
    /// false takes the float32 forms that devices without doubles run, for
    /// testing them.
    pub device_f64: bool,
}

impl Default for GpuOptions {
    fn default() -> Self {
        GpuOptions {
            pruned: true,
            sparse_peaks: true,
            fb_per_unit: filter_bank::PER_UNIT,
            upload_chunk: upload::CHUNK,
            hp_per_unit: match std::env::var("SPIKECUBE_HIGHPASS_PER_UNIT").as_deref() {
                Ok("8") => 8,
                _ => preprocess::HP_PER_UNIT,
            },
            highpass: highpass_iir::HighpassMode::from_env(),
            whiten_rows_first: std::env::var("SPIKECUBE_WHITEN_GRID").as_deref() != Ok("samples"),
            device_f64: true,
        }
    }
}

/// Dense step 2–3 arrays downloaded by [`GpuDetector::intermediates`]: As, imaxs and
/// the neighbour max, each Nf × NT row-major.
pub type DenseArrays = (Vec<f32>, Vec<i32>, Vec<f32>);

/// The steps, for launching and timing them one by one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    FilterBank,
    CentreResponse,
    NeighbourMax,
    LocalPeaks,
    Features,
}

/// Per-window buffers, sized for a window of `n_t` samples.
struct WindowBuffers {
    n_t: usize,
    x: Handle,
    b: Handle,
    q: Handle,
    as_: Handle,
    imax: Handle,
    /// Only for the dense neighbour max (not allocated by default).
    amax: Option<Handle>,
}

/// Detection outputs, sized for `cap` detections.
struct PeakBuffers {
    cap: usize,
    peak_j: Handle,
    peak_t: Handle,
    amp: Handle,
    code: Handle,
    adist: Handle,
    yct: Handle,
    tf: Handle,
}

/// Seconds spent in each step of one window, with a device sync after each.
#[derive(Debug, Clone, Copy, Default)]
pub struct StepTimes {
    /// Host → device copy of the window.
    pub upload: f64,
    /// Preprocessing on the device ([`GpuDetector::detect_raw`] only).
    pub preprocess: f64,
    /// Step 1.
    pub filter_bank: f64,
    /// Step 2.
    pub centre_response: f64,
    /// Step 3 (0 when it runs inside step 4).
    pub neighbour_max: f64,
    /// Step 4.
    pub local_peaks: f64,
    /// Step 5.
    pub features: f64,
    /// Device → host copy of the detections, and sorting them.
    pub download: f64,
}

/// A detector on one GPU for one probe geometry (generic over the CubeCL runtime:
/// CUDA or wgpu). Same interface and detections as [`crate::detect::cpu::CpuDetector`].
pub struct GpuDetector<R: Runtime> {
    client: ComputeClient<R>,
    geometry: Geometry,
    settings: DetectionSettings,
    options: GpuOptions,
    device_name: String,
    wtemp: Handle,
    wpca: Handle,
    sites: Handle,
    weights: Handle,
    weight_norm2: Handle,
    neighbours: Handle,
    blocks: RowBlocks,
    block_offsets: Handle,
    block_rows: Handle,
    block_local: Handle,
    yc: Option<(Vec<f32>, Handle)>,
    x: Option<Handle>,
    count: Option<Handle>,
    window: Option<WindowBuffers>,
    peaks: Option<PeakBuffers>,
    pre: Option<DevicePre>,
    /// The raw window's persistent device buffer (bytes, handle), for uploads
    /// that write into it directly.
    raw_buf: Option<(usize, Handle)>,
    /// A direct host → device copy into a buffer (CUDA: `cuMemcpyHtoD` from
    /// page-locked memory), bypassing CubeCL 0.10's `create`, which copies the
    /// bytes into a new pageable vector first.
    direct: Option<DirectUpload<R>>,
    /// The page-locked pool of [`GpuDetector::use_direct_upload`], kept so that
    /// every packer of this detector shares it (one pool per detector;
    /// [`GpuDetector::pinned_pool`]).
    #[cfg(feature = "cuda")]
    pinned: Option<pinned::PinnedPool>,
    /// The two persistent buffers windows are sent ahead into (bytes,
    /// handles; [`Packer::send_ahead`]).
    raw_slots: Option<(usize, [Handle; 2])>,
    /// The last window given to [`GpuDetector::preprocess_to_device`], kept
    /// so that it can be preprocessed again
    /// ([`GpuDetector::preprocess_last_again`]).
    last_recipe: Option<RawRecipe>,
    /// Device seconds and launches of each preprocessing kernel, when
    /// `SPIKECUBE_PREPROCESS_PROFILE` is set (a sync after every kernel; a
    /// diagnostic, logged when the detector is dropped).
    pre_profile: Option<std::sync::Mutex<PreprocessProfile>>,
    /// Seconds the host waited for detections to come back (the one download
    /// per window), since [`GpuDetector::take_wait_seconds`].
    wait_s: f64,
    /// The whitening fit's Gram output (bytes, handle), kept at its exact size
    /// ([`GpuDetector::window_gram`]).
    gram_out: Option<(usize, Handle)>,
    /// Windows queued on the device whose detections are not collected yet,
    /// oldest first ([`GpuDetector::submit_raw`], [`GpuDetector::collect`]).
    pending: std::collections::VecDeque<Pending>,
    /// A clone of `client` that is never dropped (one per detector), for
    /// downloads that outlive the call queuing them ([`GpuDetector::submit_raw`]).
    client_for_reads: Option<&'static ComputeClient<R>>,
    /// [`GpuDetector::take_gram_seconds`].
    gram_s: [f64; 3],
    /// Whether the int16 channel means and the whitening fit's Gram matrix
    /// are summed in f64 with the CPU's bits: [`GpuOptions::device_f64`] and
    /// a device with doubles ([`highpass_iir::supports_f64`]), asked once.
    f64_sums: bool,
    /// Set by [`GpuDetector::copy_filtered_next`]: the next window's
    /// preprocessing hands its high-passed samples' buffer to
    /// `filtered_copy` (and takes a fresh one).
    copy_filtered: bool,
    filtered_copy: Option<Handle>,
}

/// The symmetric C × C matrix from the lower triangles (row-major, diagonal
/// included) of `parts` partial Gram matrices laid one after another in `v`,
/// the parts added in f64 in order.
fn symmetric_from_parts<T: Copy + Into<f64>>(
    v: &[T],
    c: usize,
    parts: usize,
) -> ndarray::Array2<f64> {
    let mut g = ndarray::Array2::<f64>::zeros((c, c));
    for i in 0..c {
        for k in 0..=i {
            let mut s: f64 = v[i * c + k].into();
            for z in 1..parts {
                s += v[z * c * c + i * c + k].into();
            }
            g[(i, k)] = s;
            g[(k, i)] = s;
        }
    }
    g
}

/// The download of one window's detections, queued on the device's stream.
type ReadFuture = std::pin::Pin<
    Box<
        dyn std::future::Future<
                Output = Result<Vec<cubecl::bytes::Bytes>, cubecl::server::ServerError>,
            > + Send,
    >,
>;

/// Seconds of the four preprocessing kernels (means, CAR, high-pass,
/// whitening) summed over windows ([`GpuDetector`]'s `pre_profile`).
#[derive(Debug)]
struct PreprocessProfile {
    last: Instant,
    seconds: [f64; 4],
    windows: usize,
}

impl<R: Runtime> Drop for GpuDetector<R> {
    fn drop(&mut self) {
        if let Some(p) = &self.pre_profile
            && let Ok(p) = p.lock()
            && p.windows > 0
        {
            let ms = |v: f64| 1e3 * v / p.windows as f64;
            tracing::info!(
                "preprocessing profile ({} windows), ms a window: means {:.3}, CAR {:.3}, high-pass {:.3}, whitening {:.3}",
                p.windows,
                ms(p.seconds[0]),
                ms(p.seconds[1]),
                ms(p.seconds[2]),
                ms(p.seconds[3])
            );
        }
    }
}

/// Everything the device needs to preprocess one raw window (again): the
/// window's raw buffer and the whitening it was queued with.
struct RawRecipe {
    raw: Handle,
    /// Sites.
    n_rows: usize,
    /// Samples per row.
    n_t: usize,
    /// 32-bit words per row and in all.
    words_per_row: usize,
    n_words: usize,
    /// int16 pairs (true) or float32 bits.
    packed: bool,
    /// The whitening set when the window was queued.
    w: DeviceW,
    /// A window whitened earlier into a buffer of its own
    /// ([`GpuDetector::submit_filtered`]): the steps read that buffer as X
    /// (nothing is preprocessed or copied), and `raw` is not read.
    whitened: Option<Handle>,
}

/// A window queued by [`GpuDetector::submit_raw`].
struct Pending {
    recipe: RawRecipe,
    /// The claim on the upload buffer holding the raw window, released once
    /// its detections are back.
    claim: Box<dyn Send>,
    /// Detections the peak buffers held when it was queued.
    cap: usize,
    read: ReadFuture,
}

/// See [`GpuDetector::direct`]'s field: copies the bytes into the handle's memory.
type DirectUpload<R> = Box<dyn Fn(&ComputeClient<R>, Handle, &[u8]) -> bool + Send + Sync>;

/// A whitening on the device ([`GpuDetector::upload_whitening`]): its CSR
/// form (row starts, columns, values; an empty matrix's buffers hold one
/// unread element) and its non-zeros.
#[derive(Clone)]
struct DeviceW {
    start: Handle,
    cols: Handle,
    vals: Handle,
    nnz: usize,
}

/// Preprocessing constants on the device ([`GpuDetector::set_preprocessing`]).
struct DevicePre {
    form: DevicePreprocessing,
    taps: Handle,
    /// Taps on the device (zero-padded to a multiple of HP_PER_UNIT).
    n_taps: usize,
    /// The whitening set last.
    w: DeviceW,
    means: Handle,
    /// Shared-memory size (taps) the high-pass kernel is compiled for.
    max_taps: usize,
    /// The high-pass as a circular IIR, when chosen (else the direct kernel).
    iir: Option<highpass_iir::DeviceIir>,
}

/// A raw window as the device takes it: one 32-bit word per float32 value, or
/// two int16 values per word (row-major, each row padded to whole words), in
/// host memory that is page-locked when the back end supports it ([`Packer`]).
pub struct RawWindow {
    /// Rows (sites).
    pub n_rows: usize,
    /// Samples per row.
    pub n_t: usize,
    /// int16 pairs (true) or float32 bits (false).
    pub packed: bool,
    /// Whether `data` is page-locked.
    pub pinned: bool,
    data: cubecl::bytes::Bytes,
    /// Bytes of the window (`data`'s, or what was sent ahead).
    n_bytes: usize,
    /// When the window was sent ahead into one of the detector's upload
    /// buffers ([`Packer::send_ahead`]): which one, and the claim on it
    /// (`data` is empty then).
    slot: Option<(usize, Box<dyn Send>)>,
}

impl std::fmt::Debug for RawWindow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawWindow")
            .field("n_rows", &self.n_rows)
            .field("n_t", &self.n_t)
            .field("packed", &self.packed)
            .field("pinned", &self.pinned)
            .finish_non_exhaustive()
    }
}

impl RawWindow {
    /// Words per row.
    pub fn words_per_row(&self) -> usize {
        if self.packed {
            self.n_t.div_ceil(2)
        } else {
            self.n_t
        }
    }

    /// Bytes sent to the device.
    pub fn n_bytes(&self) -> usize {
        self.n_bytes
    }

    /// Whether the window is already on the device ([`Packer::send_ahead`]).
    pub fn is_sent(&self) -> bool {
        self.slot.is_some()
    }

    /// Takes the claim on the upload buffer of a window sent ahead
    /// ([`Packer::send_ahead`]), leaving the window usable: the buffer is not
    /// written again until the claim is dropped, so hold it until the
    /// device's work on the window has completed (a read from the device
    /// after the last kernel that uses it). `None` for a window not sent ahead.
    pub fn take_claim(&mut self) -> Option<Box<dyn Send>> {
        self.slot
            .as_mut()
            .map(|s| std::mem::replace(&mut s.1, Box::new(())))
    }
}

/// Packs raw windows for [`GpuDetector::detect_raw`], into page-locked memory
/// when the back end has it (CUDA); cheap to clone and usable from any thread.
#[derive(Clone, Default)]
pub struct Packer {
    #[cfg(feature = "cuda")]
    pinned: Option<pinned::PinnedPool>,
    #[cfg(feature = "cuda")]
    slots: Option<Arc<pinned::UploadSlots>>,
}

impl std::fmt::Debug for Packer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Packer")
            .field("pinned", &self.is_pinned())
            .finish()
    }
}

impl Packer {
    /// A packer into page-locked memory of GPU 0 (CUDA), or into ordinary
    /// memory when the driver does not give any.
    #[cfg(feature = "cuda")]
    pub fn pinned_cuda() -> Packer {
        Packer {
            pinned: pinned::PinnedPool::new(),
            slots: None,
        }
    }

    /// A packer into `pool`'s page-locked memory (the pool a detector's
    /// packers share).
    #[cfg(feature = "cuda")]
    pub fn with_pool(pool: pinned::PinnedPool) -> Packer {
        Packer {
            pinned: Some(pool),
            slots: None,
        }
    }

    /// Sends later windows ahead into `slots` ([`Packer::send_ahead`]).
    #[cfg(feature = "cuda")]
    pub fn set_slots(&mut self, slots: pinned::UploadSlots) {
        self.slots = Some(Arc::new(slots));
    }

    /// Copies a page-locked window into the next of the detector's two upload
    /// buffers ([`pinned::UploadSlots`]), on a stream of its own, so that the
    /// copy overlaps the device's work on the window before; waits
    /// until the window that used that buffer before has been detected in.
    /// Other windows (not page-locked, another size, no buffers: wgpu) come
    /// back unchanged and are uploaded by [`GpuDetector::detect_raw`].
    pub fn send_ahead(&self, raw: RawWindow) -> RawWindow {
        #[cfg(feature = "cuda")]
        if let Some(slots) = &self.slots
            && raw.pinned
            && raw.slot.is_none()
            && raw.data.len() == slots.len()
            && let Some(guard) = slots.upload(&raw.data)
        {
            return RawWindow {
                data: cubecl::bytes::Bytes::from_bytes_vec(Vec::new()),
                slot: Some((guard.slot, Box::new(guard))),
                ..raw
            };
        }
        raw
    }

    /// The page-locked pool, for [`GpuDetector::use_direct_upload`].
    #[cfg(feature = "cuda")]
    pub fn pool(&self) -> Option<pinned::PinnedPool> {
        self.pinned.clone()
    }

    /// Whether buffers are page-locked.
    pub fn is_pinned(&self) -> bool {
        #[cfg(feature = "cuda")]
        {
            self.pinned.is_some()
        }
        #[cfg(not(feature = "cuda"))]
        {
            false
        }
    }

    fn buffer(&self, n_words: usize) -> (cubecl::bytes::Bytes, bool) {
        #[cfg(feature = "cuda")]
        if let Some(b) = self.pinned.as_ref().and_then(|p| p.take(n_words * 4)) {
            return (b, true);
        }
        (
            cubecl::bytes::Bytes::from_bytes_vec(vec![0u8; n_words * 4]),
            false,
        )
    }

    /// Packs a raw (C × N) f32 window: two int16 values per word when every value
    /// is an integer in int16's range (int16 files, uint16 files after their
    /// shift, stuck stretches filled with a row median), else float32 bits.
    pub fn pack(&self, x: ArrayView2<f32>) -> RawWindow {
        use rayon::prelude::*;
        let (c, n) = x.dim();
        let x = x.as_standard_layout();
        let xs = x.as_slice().expect("standard layout");
        let packed = n > 0
            && xs
                .par_chunks(1 << 16)
                .all(|p| p.iter().all(|&v| v == f32::from(v as i16)));
        let wpr = if packed { n.div_ceil(2) } else { n };
        let (mut data, pinned) = self.buffer(c * wpr);
        {
            let words: &mut [u32] = bytemuck_words(&mut data);
            if wpr > 0 {
                words
                    .par_chunks_mut(wpr)
                    .zip(xs.par_chunks(n))
                    .for_each(|(out, row)| {
                        if packed {
                            for (w, pair) in out.iter_mut().zip(row.chunks(2)) {
                                let lo = u32::from((pair[0] as i16) as u16);
                                let hi = pair.get(1).map_or(0, |&v| u32::from((v as i16) as u16));
                                *w = lo | (hi << 16);
                            }
                        } else {
                            for (w, v) in out.iter_mut().zip(row) {
                                *w = v.to_bits();
                            }
                        }
                    });
            }
        }
        RawWindow {
            n_rows: c,
            n_t: n,
            packed,
            pinned,
            n_bytes: data.len(),
            data,
            slot: None,
        }
    }
}

/// An int16 window's storage made by [`Packer::raw16_buffer`]: the reader
/// fills it ([`crate::recording::read_window_i16`]), the input checks work on
/// it, and it goes to the device as it is, a packed [`RawWindow`] (no float
/// copy and no packing on the host).
pub struct PackedRows {
    data: cubecl::bytes::Bytes,
    pinned: bool,
}

impl crate::recording::Raw16Buffer for PackedRows {
    fn values(&self) -> &[i16] {
        let bytes: &[u8] = &self.data;
        // SAFETY: every i16 bit pattern is valid; alignment is checked below.
        let (pre, v, post) = unsafe { bytes.align_to::<i16>() };
        assert!(pre.is_empty() && post.is_empty(), "aligned buffer");
        v
    }
    fn values_mut(&mut self) -> &mut [i16] {
        let bytes: &mut [u8] = &mut self.data;
        // SAFETY: as in `values`.
        let (pre, v, post) = unsafe { bytes.align_to_mut::<i16>() };
        assert!(pre.is_empty() && post.is_empty(), "aligned buffer");
        v
    }
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send> {
        self
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl Packer {
    /// Storage for `n_values` int16 values (page-locked with CUDA), for a
    /// window of rows of [`crate::recording::Raw16::stride_for`] (whole
    /// 32-bit words: a packed [`RawWindow`]'s rows).
    pub fn raw16_buffer(&self, n_values: usize) -> PackedRows {
        let (data, pinned) = self.buffer(n_values.div_ceil(2));
        PackedRows { data, pinned }
    }

    /// The [`RawWindow`] of a window as read: its int16 values as they are
    /// when they were read into this packer's storage ([`Packer::from_raw16`]),
    /// else packed here from them or from its f32 `data` ([`Packer::pack`]).
    /// Takes the window's `raw16`.
    pub fn raw_window(&self, w: &mut crate::recording::Window) -> RawWindow {
        match w.raw16.take().map(|r| self.from_raw16(r)) {
            Some(Ok(raw)) => raw,
            Some(Err(r)) => self.pack(r.to_f32().view()),
            None => self.pack(w.data.view()),
        }
    }

    /// The packed [`RawWindow`] of an int16 window read into a
    /// [`Packer::raw16_buffer`]; the window back when it is in other storage
    /// or rows of another length.
    pub fn from_raw16(
        &self,
        raw: crate::recording::Raw16,
    ) -> std::result::Result<RawWindow, crate::recording::Raw16> {
        if raw.stride != crate::recording::Raw16::stride_for(raw.n_cols)
            || !raw.buffer().is::<PackedRows>()
        {
            return Err(raw);
        }
        let (n_rows, n_t) = (raw.n_rows, raw.n_cols);
        match raw.into_buffer().downcast::<PackedRows>() {
            Ok(p) => Ok(RawWindow {
                n_rows,
                n_t,
                packed: true,
                pinned: p.pinned,
                n_bytes: p.data.len(),
                data: p.data,
                slot: None,
            }),
            Err(_) => unreachable!("checked"),
        }
    }
}

/// The bytes as 32-bit words (every buffer here is 4096- or 4-byte aligned and a
/// whole number of words long).
fn bytemuck_words(b: &mut cubecl::bytes::Bytes) -> &mut [u32] {
    let bytes: &mut [u8] = b;
    let (pre, words, post) = unsafe { bytes.align_to_mut::<u32>() };
    assert!(pre.is_empty() && post.is_empty(), "word-aligned buffer");
    words
}

#[cfg(feature = "cuda")]
impl GpuDetector<cubecl::cuda::CudaRuntime> {
    /// Uploads page-locked raw windows ([`Packer::pinned_cuda`]) with one
    /// `cuMemcpyHtoD` into a persistent buffer (about 25 GB/s measured on the H200
    /// machine, docs/benchmarks-history.md) instead of CubeCL's `create`.
    pub fn use_direct_upload(&mut self, pool: pinned::PinnedPool) {
        self.pinned = Some(pool.clone());
        self.direct = Some(Box::new(move |client, handle, bytes| {
            let Ok(res) = client.get_resource(handle) else {
                return false;
            };
            let ptr = res.resource().ptr;
            // SAFETY: ptr is the handle's device memory (at least bytes.len()
            // long: the buffer was sized for them) and the stream was synced, so
            // no kernel uses it.
            unsafe { pool.copy_to_device(ptr, bytes) }
        }));
    }
}

#[cfg(feature = "cuda")]
impl GpuDetector<cubecl::cuda::CudaRuntime> {
    /// The page-locked pool given to [`GpuDetector::use_direct_upload`], if any.
    pub fn pinned_pool(&self) -> Option<pinned::PinnedPool> {
        self.pinned.clone()
    }

    /// Allocates the two persistent upload buffers of `len` bytes each (kept
    /// while the size stays) and returns their device addresses, for
    /// [`pinned::PinnedPool::upload_slots`].
    pub fn upload_slot_ptrs(&mut self, len: usize) -> Option<[u64; 2]> {
        if self.raw_slots.as_ref().map(|(n, _)| *n) != Some(len) {
            self.raw_slots = None;
            // The buffer of windows that were not sent ahead (the warm-up's, the
            // whitening fit's; all synced by now): freed first, so that a slot
            // of the same size takes its memory instead of adding to it.
            self.raw_buf = None;
            let h = self.persistent(|client| [client.empty(len.max(4)), client.empty(len.max(4))]);
            self.raw_slots = Some((len, h));
        }
        let (_, h) = self.raw_slots.as_ref()?;
        let a = self.client.get_resource(h[0].clone()).ok()?.resource().ptr;
        let b = self.client.get_resource(h[1].clone()).ok()?.resource().ptr;
        Some([a, b])
    }
}

impl<R: Runtime> std::fmt::Debug for GpuDetector<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuDetector")
            .field("device", &self.device_name)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

fn bytes_f32(v: &[f32]) -> &[u8] {
    f32::as_bytes(v)
}
fn bytes_u32(v: &[u32]) -> &[u8] {
    u32::as_bytes(v)
}

impl<R: Runtime> GpuDetector<R> {
    /// Prepares a detector on `device` for `geometry`: uploads the templates, the
    /// neighbourhoods and the spatial weights once.
    ///
    /// # Errors
    /// [`DetectError::Setting`] for invalid settings (as the CPU detector), or for
    /// nC·nsz·6 too large to keep in registers (nC > 32 or more than 8 sizes).
    pub fn new(
        device: &R::Device,
        device_name: String,
        geometry: Geometry,
        templates: UniversalTemplates,
        settings: DetectionSettings,
        options: GpuOptions,
    ) -> Result<Self, DetectError> {
        settings.validate()?;
        let nc = geometry.n_chans();
        let nc2 = geometry.n_neighbours();
        if nc > 32 {
            return Err(DetectError::Setting {
                name: "nearest_chans",
                message: format!("is {nc}; the GPU back ends take at most 32 (use --backend cpu)"),
            });
        }
        let client = R::client(device);
        let f64_sums = options.device_f64 && highpass_iir::supports_f64(&client);
        let cpu::CentreMajor {
            sites,
            weights,
            neighbours,
            weight_max: _,
        } = cpu::CentreMajor::new(&geometry);
        // Per centre, max over sizes of Σ_c weigh² (summed in f64), for the
        // pruning bound of `centre_response_kernel`.
        let (nc_j, nsz) = (geometry.n_chans(), geometry.n_sizes());
        let weight_norm2: Vec<f32> = weights
            .chunks_exact(nc_j * nsz)
            .map(|w_j| {
                (0..nsz)
                    .map(|s| {
                        (0..nc_j)
                            .map(|c| (w_j[c * nsz + s] as f64).powi(2))
                            .sum::<f64>()
                    })
                    .fold(0f64, f64::max) as f32
            })
            .collect();
        let hw = &client.properties().hardware;
        let max_shared = hw.max_shared_memory_size.min(48 * 1024);
        let max_units = (hw.max_units_per_cube as usize).min(256);
        let blocks = RowBlocks::new(&neighbours, nc2, 1, max_shared, max_units, 16);
        let wtemp = templates.wtemp.as_standard_layout().to_owned();
        let wpca = templates.wpca.as_standard_layout().to_owned();
        let up_f = |v: &[f32]| client.create_from_slice(bytes_f32(v));
        let up_u = |v: &[u32]| client.create_from_slice(bytes_u32(v));
        Ok(GpuDetector {
            wtemp: up_f(wtemp.as_slice().expect("standard layout")),
            wpca: up_f(wpca.as_slice().expect("standard layout")),
            sites: up_u(&sites),
            weights: up_f(&weights),
            weight_norm2: up_f(&weight_norm2),
            neighbours: up_u(&neighbours),
            block_offsets: up_u(&blocks.offsets),
            block_rows: up_u(&blocks.rows),
            block_local: up_u(&blocks.local),
            blocks,
            client,
            geometry,
            settings,
            options,
            device_name,
            yc: None,
            x: None,
            count: None,
            window: None,
            peaks: None,
            pre: None,
            raw_buf: None,
            direct: None,
            #[cfg(feature = "cuda")]
            pinned: None,
            raw_slots: None,
            last_recipe: None,
            copy_filtered: false,
            filtered_copy: None,
            pre_profile: std::env::var_os("SPIKECUBE_PREPROCESS_PROFILE").map(|_| {
                std::sync::Mutex::new(PreprocessProfile {
                    last: Instant::now(),
                    seconds: [0.0; 4],
                    windows: 0,
                })
            }),
            wait_s: 0.0,
            gram_out: None,
            pending: Default::default(),
            client_for_reads: None,
            gram_s: [0.0; 3],
            f64_sums,
        })
    }

    /// Seconds the host spent waiting for the device's detections (inside
    /// [`GpuDetector::detect_raw`]'s download) since the last call: the rest
    /// of a window's host time is launching and sorting.
    pub fn take_wait_seconds(&mut self) -> f64 {
        std::mem::take(&mut self.wait_s)
    }

    /// Compiles every kernel of [`GpuDetector::detect_raw`] for windows of
    /// `form`'s shape from int16 input, and allocates the window's buffers, by
    /// running one all-zero window through them (it has no detections). For
    /// hiding the device's start-up behind the whitening fit: `form` may carry
    /// any whitening (e.g. the identity); [`GpuDetector::set_preprocessing`]
    /// with the fitted one follows. `packer`: the back end's (page-locked
    /// memory under CUDA, so the window goes up as the fit's windows will).
    ///
    /// # Errors
    /// As [`GpuDetector::set_preprocessing`] and [`GpuDetector::detect_raw`].
    pub fn warm_up(
        &mut self,
        form: &DevicePreprocessing,
        yc: &[f32],
        packer: &Packer,
    ) -> Result<(), DetectError> {
        let t0 = std::time::Instant::now();
        self.set_preprocessing(form)?;
        let t1 = std::time::Instant::now();
        let zeros = ndarray::Array2::<f32>::zeros((form.n_sites, form.n));
        let raw = packer.pack(zeros.view());
        let t2 = std::time::Instant::now();
        self.detect_raw(raw, yc, None)?;
        self.wait_s = 0.0;
        tracing::info!(
            "device warm-up: constants {:.3} s, a window packed {:.3} s, detected (kernels loaded, buffers made) {:.3} s",
            (t1 - t0).as_secs_f64(),
            (t2 - t1).as_secs_f64(),
            t2.elapsed().as_secs_f64()
        );
        Ok(())
    }

    /// Uploads the preprocessing constants, after which
    /// [`GpuDetector::detect_raw`] takes raw windows and preprocesses them on the
    /// device (see [`preprocess`]).
    ///
    /// # Errors
    /// [`DetectError::Setting`] when the form's sites differ from the geometry's
    /// or the high-pass has more taps than shared memory holds.
    pub fn set_preprocessing(&mut self, form: &DevicePreprocessing) -> Result<(), DetectError> {
        let max_shared = self.client.properties().hardware.max_shared_memory_size;
        // Taps zero-padded to a whole number of hp_per_unit (zeros add exact zeros).
        let per = self.options.hp_per_unit;
        let n_taps = form.taps.len().div_ceil(per) * per;
        let max_taps = n_taps.div_ceil(64) * 64;
        let span = preprocess::UNITS * per + max_taps;
        let hp_bytes = (span + span / 32 + 1 + max_taps) * 4;
        let iir = highpass_iir::DeviceIir::select(&self.client, form, self.options.highpass);
        if hp_bytes > max_shared && iir.is_none() {
            return Err(DetectError::Setting {
                name: "highpass_cutoff",
                message: format!(
                    "the high-pass kernel has {} taps and needs {hp_bytes} bytes of shared memory; the device has {max_shared}; use --backend cpu",
                    form.taps.len()
                ),
            });
        }
        if form.n_sites > preprocess::CAR_MAX_SITES {
            return Err(DetectError::Setting {
                name: "probe",
                message: format!(
                    "{} sites; the device median CAR takes at most {} (use --backend cpu)",
                    form.n_sites,
                    preprocess::CAR_MAX_SITES
                ),
            });
        }
        let mut taps = form.taps.clone();
        taps.resize(n_taps, 0.0);
        let w = self.upload_whitening(&form.w_start, &form.w_cols, &form.w_vals);
        self.pre = Some(DevicePre {
            taps: self.client.create_from_slice(bytes_f32(&taps)),
            n_taps,
            w,
            means: self.client.empty(form.n_sites.max(1) * 4),
            max_taps,
            form: form.clone(),
            iir,
        });
        Ok(())
    }

    /// A C × C whitening in CSR form on the device.
    fn upload_whitening(&self, start: &[u32], cols: &[u32], vals: &[f32]) -> DeviceW {
        // An all-zero matrix still gets one (unread) element per buffer.
        let cols_up: &[u32] = if cols.is_empty() { &[0] } else { cols };
        let vals_up: &[f32] = if vals.is_empty() { &[0.0] } else { vals };
        DeviceW {
            start: self.client.create_from_slice(bytes_u32(start)),
            cols: self.client.create_from_slice(bytes_u32(cols_up)),
            vals: self.client.create_from_slice(bytes_f32(vals_up)),
            nnz: cols.len(),
        }
    }

    /// Replaces the whitening of the device preprocessing by another C × C
    /// matrix in the same CSR form (`start`: C + 1 row starts, `cols`/`vals`
    /// the non-zeros in the order the CPU sums them), e.g. drift correction's
    /// per-window `M_b·W` ([`crate::drift::DriftRun::window_whitening`]; Kilosort4
    /// applies `(M_b·W)·X` in place of `W·X`).
    ///
    /// # Errors
    /// [`DetectError::Setting`] when no preprocessing was set;
    /// [`DetectError::Input`] when the CSR does not have C rows or a column is
    /// not below C.
    pub fn set_whitening(
        &mut self,
        start: &[u32],
        cols: &[u32],
        vals: &[f32],
    ) -> Result<(), DetectError> {
        let Some(pre) = self.pre.as_mut() else {
            return Err(DetectError::Setting {
                name: "backend",
                message: "no device preprocessing was set up".into(),
            });
        };
        let c = pre.form.n_sites;
        let nnz = start.last().copied().unwrap_or(0) as usize;
        if start.len() != c + 1
            || cols.len() != nnz
            || vals.len() != nnz
            || start.windows(2).any(|w| w[0] > w[1])
            || cols.iter().any(|&k| k as usize >= c)
        {
            return Err(DetectError::Input {
                what: "whitening matrix".into(),
                message: format!(
                    "a CSR of {} row starts, {} columns and {} values is not a {c} × {c} matrix",
                    start.len(),
                    cols.len(),
                    vals.len()
                ),
            });
        }
        let w = self.upload_whitening(start, cols, vals);
        let pre = self.pre.as_mut().expect("checked above");
        pre.w = w;
        pre.form.w_start = start.to_vec();
        pre.form.w_cols = cols.to_vec();
        pre.form.w_vals = vals.to_vec();
        Ok(())
    }

    /// Detects with other universal templates of the same shape from the next
    /// window on (e.g. learned again for the drift-corrected pass), keeping
    /// every device buffer.
    ///
    /// # Errors
    /// [`DetectError::Setting`] when their shapes differ from the current ones.
    pub fn set_templates(&mut self, templates: &UniversalTemplates) -> Result<(), DetectError> {
        let (nk, nt) = templates.wtemp.dim();
        let (npc, nt2) = templates.wpca.dim();
        if nk != NK || nt != self.settings.nt || npc != self.settings.n_pcs || nt2 != nt {
            return Err(DetectError::Setting {
                name: "templates",
                message: format!(
                    "wTEMP is {nk} × {nt} and wPCA {npc} × {nt2}; this detector takes {NK} × {} and {} × {}",
                    self.settings.nt, self.settings.n_pcs, self.settings.nt
                ),
            });
        }
        let wtemp = templates.wtemp.as_standard_layout().to_owned();
        let wpca = templates.wpca.as_standard_layout().to_owned();
        self.wtemp = self
            .client
            .create_from_slice(bytes_f32(wtemp.as_slice().expect("standard layout")));
        self.wpca = self
            .client
            .create_from_slice(bytes_f32(wpca.as_slice().expect("standard layout")));
        Ok(())
    }

    /// Whether [`GpuDetector::set_preprocessing`] was called.
    pub fn preprocesses(&self) -> bool {
        self.pre.is_some()
    }

    /// Preprocesses one raw window on the device (channel means, median CAR,
    /// high-pass, whitening: [`preprocess`]) and detects in it, as
    /// [`crate::preprocess::Preprocessor::apply`] then [`GpuDetector::detect`]
    /// would, within the float32 tolerance stated in [`preprocess`].
    ///
    /// # Errors
    /// [`DetectError::Setting`] when no preprocessing was set; as
    /// [`GpuDetector::detect`] otherwise.
    pub fn detect_raw(
        &mut self,
        mut raw: RawWindow,
        yc: &[f32],
        times: Option<&mut StepTimes>,
    ) -> Result<Detections, DetectError> {
        let timed = times.is_some();
        let clock = Instant::now();
        // A window sent ahead keeps its upload buffer until its detections
        // are back (the kernels have read it then).
        let claim = raw.take_claim();
        let pre_s = self.upload_raw(raw, yc, timed, 4)?;
        let upload_s = clock.elapsed().as_secs_f64() - pre_s;
        let mut times = times;
        let det = self.run_uploaded(yc, times.as_deref_mut(), Instant::now())?;
        drop(claim);
        if let Some(t) = times {
            t.upload = upload_s;
            t.preprocess = pre_s;
        }
        Ok(det)
    }

    /// Queues one raw window on the device (one sent ahead,
    /// [`Packer::send_ahead`], or else copied into a device buffer of its
    /// own): preprocessing, detection and the download of its
    /// detections, without waiting for them, so that the device starts on it
    /// as soon as the window before is done (no gap between windows while
    /// the host sorts and hands on the previous window's detections).
    /// [`GpuDetector::collect`] returns the detections, in the order the
    /// windows were queued; each equals what [`GpuDetector::detect_raw`] gives
    /// for that window. Every buffer the queued work uses is either the
    /// window's own (its upload buffer, held until collected; the whitening
    /// set when it was queued) or written and read in stream order, so
    /// several windows may be queued. Uses the current whitening
    /// ([`GpuDetector::set_whitening`]).
    ///
    /// # Errors
    /// As [`GpuDetector::detect_raw`].
    pub fn submit_raw(&mut self, mut raw: RawWindow, yc: &[f32]) -> Result<(), DetectError> {
        let claim = match raw.slot.as_mut() {
            Some((_, claim)) => std::mem::replace(claim, Box::new(())),
            None => Box::new(()),
        };
        let recipe = self.raw_recipe(raw, yc, true)?;
        let cap = self.peaks.as_ref().map_or(4096, |p| p.cap);
        let read = self.launch_window(&recipe, cap);
        self.pending.push_back(Pending {
            recipe,
            claim,
            cap,
            read,
        });
        Ok(())
    }

    /// Makes the peak buffers hold `cap` detections (at least one) from the
    /// next window on, e.g. few, to test how a window with more is run again.
    pub fn set_peak_capacity(&mut self, cap: usize) {
        if self.peaks.as_ref().is_some_and(|p| p.cap != cap.max(1)) {
            self.peaks = None;
        }
        self.ensure_peaks(cap.max(1));
    }

    /// Windows queued by [`GpuDetector::submit_raw`] and not collected yet.
    pub fn pending_windows(&self) -> usize {
        self.pending.len()
    }

    /// The detections of the oldest window queued by
    /// [`GpuDetector::submit_raw`] (waiting for them); `None` when none is
    /// queued. When a window has more detections than the peak buffers hold,
    /// the buffers grow and that window and the ones queued after it run again
    /// (the later ones have overwritten its intermediate arrays since).
    ///
    /// # Errors
    /// [`DetectError::Device`] when the device fails.
    pub fn collect(&mut self) -> Result<Option<Detections>, DetectError> {
        let Some(Pending {
            recipe,
            claim,
            cap,
            read,
        }) = self.pending.pop_front()
        else {
            return Ok(None);
        };
        let (n, det) = match self.finish_download(read, cap) {
            Ok(v) => v,
            Err(e) => {
                // The device failed: nothing queued will come back.
                self.pending.clear();
                return Err(e);
            }
        };
        if n <= cap {
            drop(claim);
            return Ok(Some(det));
        }
        let mut later = Vec::new();
        while let Some(p) = self.pending.pop_front() {
            // Its download read buffers about to be redone: let it finish.
            let _ = cubecl::future::block_on(p.read);
            later.push((p.recipe, p.claim));
        }
        let mut cap = n.next_power_of_two();
        let det = loop {
            let read = self.launch_window(&recipe, cap);
            let (n, det) = self.finish_download(read, cap)?;
            if n <= cap {
                break det;
            }
            cap = n.next_power_of_two();
        };
        drop(claim);
        for (recipe, claim) in later {
            let read = self.launch_window(&recipe, cap);
            self.pending.push_back(Pending {
                recipe,
                claim,
                cap,
                read,
            });
        }
        Ok(Some(det))
    }

    /// Launches a whole window (preprocessing, steps 1–5 with peak buffers of
    /// at least `cap` detections) and queues its download.
    fn launch_window(&mut self, recipe: &RawRecipe, cap: usize) -> ReadFuture {
        self.launch_preprocess(recipe, 4);
        self.steps_1_to_3(false);
        self.ensure_peaks(cap);
        self.launch_peaks();
        self.launch_features();
        self.start_download()
    }

    /// The whitening fit's term of one raw window (Kilosort4's
    /// `get_whitening_matrix`): channel means, median CAR and high-pass on the
    /// device as [`GpuDetector::detect_raw`] does them, then the Gram matrix
    /// `Σ_t X[:, t]·X[:, t]ᵀ` over samples `lo .. hi` ([`gram`]), C × C, f64,
    /// symmetric. Needs [`GpuDetector::set_preprocessing`] (its whitening is
    /// not used).
    ///
    /// # Errors
    /// As [`GpuDetector::detect_raw`]; [`DetectError::Input`] when `lo .. hi`
    /// is not within the window.
    pub fn window_gram(
        &mut self,
        raw: RawWindow,
        yc: &[f32],
        lo: usize,
        hi: usize,
    ) -> Result<ndarray::Array2<f64>, DetectError> {
        let (c, n_t) = (raw.n_rows, raw.n_t);
        if lo > hi || hi > n_t {
            return Err(DetectError::Input {
                what: "whitening fit".into(),
                message: format!("samples {lo}..{hi} are not within a window of {n_t}"),
            });
        }
        let clock = Instant::now();
        let pre_s = self.upload_raw(raw, yc, true, 3)?;
        self.gram_s[0] += clock.elapsed().as_secs_f64() - pre_s;
        self.gram_s[1] += pre_s;
        let clock = Instant::now();
        let nb = c.div_ceil(gram::GRAM_TILE);
        let g = if self.f64_sums {
            // The CPU's sums exactly: f64, in 512-sample blocks from `lo`.
            let out = self.gram_buffer(c * c * 8);
            let w = self.window.as_ref().expect("allocated");
            // SAFETY: rows < c and samples < hi ≤ n_t are read from the C × n_t
            // buffer `q`; entries row·C + col with row, col < c are written to
            // the C·C buffer `out`.
            unsafe {
                gram::gram_f64_kernel::launch_unchecked::<R>(
                    &self.client,
                    CubeCount::Static(nb as u32, nb as u32, 1),
                    CubeDim::new_1d(gram::GRAM_UNITS as u32),
                    ArrayArg::from_raw_parts(w.q.clone(), c * n_t),
                    ArrayArg::from_raw_parts(out.clone(), c * c),
                    c as u32,
                    n_t as u32,
                    lo as u32,
                    hi as u32,
                );
            }
            symmetric_from_parts(f64::from_bytes(&self.read_gram(out)?), c, 1)
        } else {
            // Without doubles: f32 sums in parts, added in f64 here.
            let tiles = nb * (nb + 1) / 2;
            // Enough cubes for every SM of a large GPU, each part ≥ a few runs long.
            let parts = 264usize
                .div_ceil(tiles)
                .clamp(1, 16)
                .min(((hi - lo) / (8 * gram::GRAM_RUN)).max(1));
            let out = self.gram_buffer(parts * c * c * 4);
            let w = self.window.as_ref().expect("allocated");
            // SAFETY: rows < c and samples < hi ≤ n_t are read from the C × n_t
            // buffer `q`; entries row·C + col with row, col < c of part z < parts
            // are written to the parts·C·C buffer `out`.
            unsafe {
                gram::gram_kernel::launch_unchecked::<R>(
                    &self.client,
                    CubeCount::Static(nb as u32, nb as u32, parts as u32),
                    CubeDim::new_1d(gram::GRAM_UNITS as u32),
                    ArrayArg::from_raw_parts(w.q.clone(), c * n_t),
                    ArrayArg::from_raw_parts(out.clone(), parts * c * c),
                    c as u32,
                    n_t as u32,
                    lo as u32,
                    hi as u32,
                );
            }
            symmetric_from_parts(f32::from_bytes(&self.read_gram(out)?), c, parts)
        };
        self.gram_s[2] += clock.elapsed().as_secs_f64();
        Ok(g)
    }

    /// The whitening fit's Gram output buffer of `bytes`, kept between
    /// windows at its exact size (a pool page for it would stay held through
    /// the pass).
    fn gram_buffer(&mut self, bytes: usize) -> Handle {
        if self.gram_out.as_ref().map(|(n, _)| *n) != Some(bytes) {
            self.gram_out = None;
            self.gram_out = Some((bytes, self.persistent(|client| client.empty(bytes))));
        }
        self.gram_out.as_ref().expect("allocated").1.clone()
    }

    /// Downloads a Gram output buffer.
    ///
    /// # Errors
    /// [`DetectError::Device`] when the read fails.
    fn read_gram(&self, out: Handle) -> Result<cubecl::bytes::Bytes, DetectError> {
        let bytes = cubecl::future::block_on(self.client.read_async(vec![out])).map_err(|e| {
            DetectError::Device {
                message: format!("{} failed reading a Gram matrix: {e:?}", self.device_name),
            }
        })?;
        Ok(bytes.into_iter().next().expect("one buffer read"))
    }

    /// Seconds [`GpuDetector::window_gram`] spent since the last call: putting
    /// the windows on the device, preprocessing them, and the products with
    /// their download.
    pub fn take_gram_seconds(&mut self) -> [f64; 3] {
        std::mem::take(&mut self.gram_s)
    }

    /// Whitened window X after [`GpuDetector::detect_raw`]'s preprocessing
    /// (C × N, row-major), for comparisons with the CPU.
    ///
    /// # Errors
    /// As [`GpuDetector::detect_raw`].
    pub fn preprocess_only(&mut self, raw: RawWindow, yc: &[f32]) -> Result<Vec<f32>, DetectError> {
        self.preprocess_stage(raw, yc, 4)
    }

    /// The template learning's clips of one raw window
    /// ([`crate::detect::learn::ClipCut::cut`] of the window preprocessed on
    /// the device as [`GpuDetector::detect_raw`] does, with the whitening
    /// set last), cut on the device:
    /// only the peaks' bits and the clips come back (module
    /// [`learn_clips`]). The same clips, bit for bit, as the host's on the
    /// window read back.
    ///
    /// # Errors
    /// As [`GpuDetector::detect_raw`].
    pub fn learning_clips(
        &mut self,
        mut raw: RawWindow,
        yc: &[f32],
        cut: &crate::detect::learn::ClipCut,
    ) -> Result<ndarray::Array2<f32>, DetectError> {
        let claim = raw.take_claim();
        self.upload_raw(raw, yc, false, 4)?;
        let x = self.window.as_ref().expect("allocated").x.clone();
        let c = self.pre.as_ref().map_or(0, |p| p.form.n_sites);
        let n = self.window.as_ref().expect("allocated").n_t;
        let read = |client: &ComputeClient<R>, h: Handle, what: &str| {
            cubecl::future::block_on(client.read_async(vec![h])).map_err(|e| DetectError::Device {
                message: format!("{} failed reading {what}: {e:?}", self.device_name),
            })
        };
        let words = n.div_ceil(32);
        let n_words = c * words;
        let bits = self.client.empty(n_words.max(1) * 4);
        let (pr, pt) = crate::detect::learn::PEAK_BOX;
        // SAFETY: unit w < n_rows·words writes bits[w] and reads x at rows
        // and samples clipped to the c × n window.
        unsafe {
            learn_clips::peak_bits_kernel::launch_unchecked::<R>(
                &self.client,
                CubeCount::Static(n_words.div_ceil(learn_clips::UNITS as usize) as u32, 1, 1),
                CubeDim::new_1d(learn_clips::UNITS),
                ArrayArg::from_raw_parts(x.clone(), c * n),
                ArrayArg::from_raw_parts(bits.clone(), n_words),
                c as u32,
                n as u32,
                words as u32,
                cut.th_single_ch,
                pr as u32,
                pt as u32,
            );
        }
        let out = read(&self.client, bits, "the learning's peaks")?;
        // The preprocessing kernels have read the upload buffer by now.
        drop(claim);
        let v = u32::from_bytes(&out[0]);
        if v.len() < n_words {
            return Err(DetectError::Device {
                message: format!(
                    "{}: {} of {n_words} peak words read back",
                    self.device_name,
                    v.len()
                ),
            });
        }
        let peaks = learn_clips::peaks_from_bits(&v[..n_words], c, words);
        let kept = crate::detect::learn::isolate_peaks(&peaks, cut.nt, n);
        let nt = cut.nt;
        if kept.is_empty() {
            return Ok(ndarray::Array2::zeros((0, nt)));
        }
        // Each clip starts nt0min samples before its peak (t ≥ nt > nt0min).
        let starts: Vec<u32> = kept
            .iter()
            .map(|&(r, t)| (r * n + t - cut.nt0min) as u32)
            .collect();
        let starts_h = self.client.create_from_slice(bytes_u32(&starts));
        let total = kept.len() * nt;
        let clips = self.client.empty(total * 4);
        // SAFETY: unit i < n_clips·nt writes out[i] and reads x at a clip's
        // start + j, inside its row (nt ≤ t < n − nt).
        unsafe {
            learn_clips::gather_clips_kernel::launch_unchecked::<R>(
                &self.client,
                CubeCount::Static(total.div_ceil(learn_clips::UNITS as usize) as u32, 1, 1),
                CubeDim::new_1d(learn_clips::UNITS),
                ArrayArg::from_raw_parts(x, c * n),
                ArrayArg::from_raw_parts(starts_h, starts.len()),
                ArrayArg::from_raw_parts(clips.clone(), total),
                kept.len() as u32,
                nt as u32,
            );
        }
        let out = read(&self.client, clips, "the learning's clips")?;
        let v = f32::from_bytes(&out[0]);
        if v.len() < total {
            return Err(DetectError::Device {
                message: format!(
                    "{}: {} of {total} clip values read back",
                    self.device_name,
                    v.len()
                ),
            });
        }
        Ok(
            ndarray::Array2::from_shape_vec((kept.len(), nt), v[..total].to_vec())
                .expect("length checked"),
        )
    }

    /// Frees what [`GpuDetector::learning_clips`] keeps between windows (the
    /// device buffer of a raw window not sent ahead): for after the template
    /// learning.
    pub fn end_whitened(&mut self) {
        self.raw_buf = None;
    }

    /// Preprocesses `raw` on the device (the four kernels, with the whitening
    /// set last) and returns the device buffer holding the whitened window,
    /// C × N f32 row-major, without reading it back: for another stage on
    /// the same device (the learned-template matching) to work on. The
    /// buffer is this detector's and is overwritten by its next window.
    ///
    /// # Errors
    /// As [`GpuDetector::detect_raw`].
    pub fn preprocess_to_device(
        &mut self,
        raw: RawWindow,
        yc: &[f32],
    ) -> Result<Handle, DetectError> {
        let recipe = self.raw_recipe(raw, yc, false)?;
        self.launch_preprocess(&recipe, 4);
        self.last_recipe = Some(recipe);
        Ok(self.window.as_ref().expect("allocated").x.clone())
    }

    /// The whitened window X the last launched window left (C × N f32
    /// row-major) in a device buffer of its own, the caller's: X's buffer
    /// itself (that window's kernels, queued before, are the last to write
    /// it), the detector taking a fresh one for the next window; `None`
    /// before any window.
    pub fn keep_window(&mut self) -> Option<Handle> {
        let len = self.pre.as_ref()?.form.n_sites * self.window.as_ref()?.n_t;
        // X itself is handed out (the window's kernels, queued before, are the
        // last to write it) and the next window gets a fresh buffer: no copy.
        let fresh = self.client.empty(len.max(1) * 4);
        let w = self.window.as_mut()?;
        Some(std::mem::replace(&mut w.x, fresh))
    }

    /// Asks the next window's preprocessing (the next [`GpuDetector::submit_raw`]
    /// or [`GpuDetector::detect_raw`]) to hand out its samples after the
    /// high-pass and before the whitening (C × N f32 row-major) in a device
    /// buffer of their own, for [`GpuDetector::take_filtered_copy`] (the
    /// buffer they were made in; the detector takes a fresh one, so nothing is
    /// copied): so that a later
    /// pass over the same window with another whitening (Kilosort4's
    /// drift-corrected pass, whose per-window matrix replaces W) starts from
    /// it ([`GpuDetector::submit_filtered`]) instead of the raw window.
    pub fn copy_filtered_next(&mut self) {
        self.copy_filtered = true;
        self.filtered_copy = None;
    }

    /// The copy [`GpuDetector::copy_filtered_next`] asked for, once the window
    /// after the call was launched; `None` otherwise.
    pub fn take_filtered_copy(&mut self) -> Option<Handle> {
        self.copy_filtered = false;
        self.filtered_copy.take()
    }

    /// Queues a window whose samples after the high-pass are in `filtered`
    /// ([`GpuDetector::take_filtered_copy`], C × N f32, N the size of the
    /// windows set up): whitening with the current whitening
    /// ([`GpuDetector::set_whitening`]), detection and the download of its
    /// detections, collected by [`GpuDetector::collect`] as for
    /// [`GpuDetector::submit_raw`]. Returns the device buffer holding the
    /// whitened window (C × N f32, the bits [`GpuDetector::keep_window`] would
    /// hand out), the caller's from then on; `filtered`'s memory becomes this
    /// detector's X for the next window, so no copy is made and no buffer is
    /// added. The detections are those of [`GpuDetector::submit_raw`] on the
    /// raw window the copy was made from, with the same whitening: the
    /// whitening kernel reads the same samples.
    ///
    /// # Errors
    /// [`DetectError::Setting`] before any window was preprocessed on the
    /// device; [`DetectError::Input`] when `filtered` is not of that size.
    pub fn submit_filtered(&mut self, filtered: Handle, yc: &[f32]) -> Result<Handle, DetectError> {
        let (Some(pre), Some(w)) = (self.pre.as_ref(), self.window.as_ref()) else {
            return Err(DetectError::Setting {
                name: "backend",
                message: "no window was preprocessed on the device yet".into(),
            });
        };
        let (c, n_t) = (pre.form.n_sites, w.n_t);
        if (filtered.size_in_used() as usize) < c * n_t * 4 || c != yc.len() {
            return Err(DetectError::Input {
                what: "high-passed window".into(),
                message: format!(
                    "holds {} bytes; windows of {c} × {n_t} f32 were set up and the probe has {} sites",
                    filtered.size_in_used(),
                    yc.len()
                ),
            });
        }
        self.ensure_window(c, n_t, yc);
        let pre = self.pre.as_ref().expect("checked");
        let w = self.window.as_ref().expect("allocated");
        self.launch_whiten(&filtered, &pre.w, &w.x, c, n_t);
        // X now holds the whitened window: it is handed out as the kept
        // window, and the high-passed buffer, no longer needed, becomes X for
        // the next window (no copy either way).
        let whitened = std::mem::replace(&mut self.window.as_mut().expect("allocated").x, filtered);
        let pre = self.pre.as_ref().expect("checked");
        let recipe = RawRecipe {
            raw: whitened.clone(),
            n_rows: c,
            n_t,
            words_per_row: n_t,
            n_words: c * n_t,
            packed: false,
            w: pre.w.clone(),
            whitened: Some(whitened.clone()),
        };
        let cap = self.peaks.as_ref().map_or(4096, |p| p.cap);
        let read = self.launch_window(&recipe, cap);
        self.pending.push_back(Pending {
            recipe,
            claim: Box::new(()),
            cap,
            read,
        });
        Ok(whitened)
    }

    /// Preprocesses the window of the last [`GpuDetector::preprocess_to_device`]
    /// again, into the same buffer, with the whitening it had then: for a
    /// caller that overwrote that buffer and needs the window again. Its raw
    /// buffer must not have been reused since (hold a sent-ahead window's
    /// claim until this returns).
    ///
    /// # Errors
    /// [`DetectError::Setting`] when no window was preprocessed on the device yet.
    pub fn preprocess_last_again(&mut self) -> Result<Handle, DetectError> {
        let Some(recipe) = self.last_recipe.take() else {
            return Err(DetectError::Setting {
                name: "backend",
                message: "no window was preprocessed on the device yet".into(),
            });
        };
        self.launch_preprocess(&recipe, 4);
        self.last_recipe = Some(recipe);
        Ok(self.window.as_ref().expect("allocated").x.clone())
    }

    /// The window after the first `stages` of the four preprocessing kernels
    /// (1: nothing yet in X; 2: means removed and median CAR; 3: high-pass; 4:
    /// whitening), C × N row-major: for finding where a device departs from the CPU.
    ///
    /// # Errors
    /// As [`GpuDetector::detect_raw`].
    pub fn preprocess_stage(
        &mut self,
        raw: RawWindow,
        yc: &[f32],
        stages: usize,
    ) -> Result<Vec<f32>, DetectError> {
        self.upload_raw(raw, yc, false, stages)?;
        let w = self.window.as_ref().expect("allocated");
        let h = if stages == 3 {
            w.q.clone()
        } else {
            w.x.clone()
        };
        let out = self.client.read(vec![h]);
        Ok(f32::from_bytes(&out[0]).to_vec())
    }

    /// Uploads `raw` and launches the preprocessing kernels; with `timed`, syncs
    /// after the upload and after the kernels and returns the kernels' seconds.
    /// Only the first `kernels` of the four preprocessing kernels are launched.
    fn upload_raw(
        &mut self,
        raw: RawWindow,
        yc: &[f32],
        timed: bool,
        kernels: usize,
    ) -> Result<f64, DetectError> {
        let recipe = self.raw_recipe(raw, yc, false)?;
        if timed {
            self.sync()?;
        }
        let clock = Instant::now();
        self.launch_preprocess(&recipe, kernels);
        if timed {
            self.sync()?;
        }
        Ok(clock.elapsed().as_secs_f64())
    }

    /// Checks a raw window against the preprocessing set up, allocates the
    /// window's buffers, puts the window on the device (unless it was sent
    /// ahead: into the persistent raw buffer, or into one of its own with
    /// `own_buffer`) and returns what [`GpuDetector::launch_preprocess`] needs.
    fn raw_recipe(
        &mut self,
        raw: RawWindow,
        yc: &[f32],
        own_buffer: bool,
    ) -> Result<RawRecipe, DetectError> {
        let Some(pre) = self.pre.as_ref() else {
            return Err(DetectError::Setting {
                name: "backend",
                message: "no device preprocessing was set up".into(),
            });
        };
        let (c, n_t) = (raw.n_rows, raw.n_t);
        if c != pre.form.n_sites || n_t != pre.form.n || c != yc.len() {
            return Err(DetectError::Input {
                what: "raw window".into(),
                message: format!(
                    "is {c} × {n_t}; the preprocessing was set up for {} × {} and the probe has {} sites",
                    pre.form.n_sites,
                    pre.form.n,
                    yc.len()
                ),
            });
        }
        self.check_size(c, n_t)?;
        self.ensure_window(c, n_t, yc);
        let words_per_row = raw.words_per_row();
        let n_words = raw.n_bytes() / 4;
        let packed = raw.packed;
        let raw_h = match raw.slot.as_ref().map(|s| s.0) {
            Some(slot) => match &self.raw_slots {
                Some((len, h)) if *len == raw.n_bytes => h[slot].clone(),
                _ => {
                    return Err(DetectError::Input {
                        what: "raw window".into(),
                        message: "was sent ahead into a buffer this detector does not hold".into(),
                    });
                }
            },
            None if own_buffer => self.client.create_from_slice(&raw.data),
            None => self.raw_to_device(raw.data, raw.pinned)?,
        };
        let pre = self.pre.as_ref().expect("checked");
        Ok(RawRecipe {
            raw: raw_h,
            n_rows: c,
            n_t,
            words_per_row,
            n_words,
            packed,
            w: pre.w.clone(),
            whitened: None,
        })
    }

    /// Launches the whitening X = W·Y of the C × N window `y` into `x` with
    /// the device whitening `w` ([`preprocess::whiten_kernel`]).
    fn launch_whiten(&self, y: &Handle, w: &DeviceW, x: &Handle, c: usize, n_t: usize) {
        let arr = |h: &Handle, len: usize| unsafe { ArrayArg::from_raw_parts(h.clone(), len) };
        let DeviceW {
            start,
            cols,
            vals,
            nnz,
        } = w;
        let nnz = *nnz;
        // SAFETY: row r < c of the C × N buffers `y` and `x`, samples t < N;
        // CSR indices are < C by construction (DevicePreprocessing,
        // set_whitening's check), checked against the CPU in tests/gpu.rs.
        unsafe {
            preprocess::whiten_kernel::launch_unchecked::<R>(
                &self.client,
                preprocess::whiten_cubes(c, n_t, self.options.whiten_rows_first),
                CubeDim::new_1d(preprocess::UNITS as u32),
                arr(y, c * n_t),
                arr(start, c + 1),
                arr(cols, nnz.max(1)),
                arr(vals, nnz.max(1)),
                arr(x, c * n_t),
                n_t as u32,
                exact::NEG_ZERO,
                self.options.whiten_rows_first,
            );
        }
    }

    /// Launches the first `kernels` preprocessing kernels (channel means,
    /// median CAR, high-pass, whitening) on the window of `r`, into the
    /// detector's whitened window X.
    fn launch_preprocess(&mut self, win: &RawRecipe, kernels: usize) {
        self.pre_mark(None);
        let (c, n_t) = (win.n_rows, win.n_t);
        if let Some(whitened) = &win.whitened {
            // The steps only read X: they read the window's own buffer.
            self.x = Some(whitened.clone());
            return;
        }
        let w = self.window.as_ref().expect("allocated");
        let mut fresh_q = None;
        let pre = self.pre.as_ref().expect("set up");
        let arr = |h: &Handle, len: usize| unsafe { ArrayArg::from_raw_parts(h.clone(), len) };
        let units = CubeDim::new_1d(preprocess::UNITS as u32);
        let (cols, slots) = preprocess::car_tile(c);
        // SAFETY (all four launches): row r < c reads words r·wpr .. r·wpr + wpr of
        // `raw` (c·wpr words) and writes row r of the C × N buffers; samples
        // t < N only; taps q < K; CSR indices are < C by construction
        // (DevicePreprocessing), checked against the CPU in tests/gpu.rs.
        unsafe {
            if kernels > 0 {
                if !win.packed && self.f64_sums {
                    preprocess::row_means_float_f64_kernel::launch_unchecked::<R>(
                        &self.client,
                        CubeCount::Static(c as u32, 1, 1),
                        units,
                        arr(&win.raw, win.n_words),
                        arr(&pre.means, c),
                        n_t as u32,
                        win.words_per_row as u32,
                    );
                } else {
                    preprocess::row_means_kernel::launch_unchecked::<R>(
                        &self.client,
                        CubeCount::Static(c as u32, 1, 1),
                        units,
                        arr(&win.raw, win.n_words),
                        arr(&pre.means, c),
                        n_t as u32,
                        win.words_per_row as u32,
                        win.packed,
                        self.f64_sums,
                    );
                }
                self.pre_mark(Some(0));
            }
            if kernels > 1 {
                preprocess::car_kernel::launch_unchecked::<R>(
                    &self.client,
                    CubeCount::Static(n_t.div_ceil(cols) as u32, 1, 1),
                    units,
                    arr(&win.raw, win.n_words),
                    arr(&pre.means, c),
                    arr(&w.x, c * n_t),
                    c as u32,
                    n_t as u32,
                    win.words_per_row as u32,
                    cols,
                    slots,
                    win.packed,
                    pre.form.do_car,
                );
                self.pre_mark(Some(1));
            }
            // The IIR high-pass (the filter bank's buffer B holds its forward
            // pass's output); it declines only a window not of the form's
            // shape, which the recipe has ruled out; then the direct kernel.
            if kernels > 2
                && let Some(iir) = &pre.iir
                && iir.launch(&self.client, &w.x, &w.b, &w.q, c, n_t).is_ok()
            {
            } else if kernels > 2 {
                preprocess::highpass_kernel::launch_unchecked::<R>(
                    &self.client,
                    CubeCount::Static(
                        n_t.div_ceil(preprocess::UNITS * self.options.hp_per_unit) as u32,
                        c as u32,
                        1,
                    ),
                    units,
                    arr(&w.x, c * n_t),
                    arr(&pre.taps, pre.n_taps),
                    arr(&w.q, c * n_t),
                    n_t as u32,
                    pre.form.first.rem_euclid(n_t as i32) as u32,
                    pre.n_taps as u32,
                    pre.max_taps,
                    self.options.hp_per_unit,
                );
            }
            if kernels > 2 {
                self.pre_mark(Some(2));
                if std::mem::take(&mut self.copy_filtered) {
                    // The high-passed window stays in its buffer, which is
                    // handed out; the whitening below still reads it, and the
                    // steps after it (which write Q) get a fresh one.
                    self.filtered_copy = Some(w.q.clone());
                    fresh_q = Some(self.client.empty(c * n_t * 4));
                }
            }
            if kernels > 3 {
                self.launch_whiten(&w.q, &win.w, &w.x, c, n_t);
                self.pre_mark(Some(3));
            }
        }
        let w = self.window.as_mut().expect("allocated");
        if let Some(q) = fresh_q {
            w.q = q;
        }
        self.x = Some(w.x.clone());
    }

    /// The geometry in use.
    pub fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    /// The longest window (samples, padding included) whose buffers this device
    /// can hold for `n_sites` channels: the largest buffer, B (C × 6 × NT floats)
    /// or As (Nf × NT floats), must fit the device's largest buffer.
    pub fn max_window_samples(&self, n_sites: usize) -> usize {
        let per_sample = (n_sites * NK).max(self.geometry.n_centres()) * 4;
        (self.client.properties().memory.max_page_size as usize / per_sample.max(1)).max(1)
    }

    fn check_size(&self, n_sites: usize, n_t: usize) -> Result<(), DetectError> {
        let max = self.max_window_samples(n_sites);
        if n_t <= max {
            return Ok(());
        }
        let per_sample = (n_sites * NK).max(self.geometry.n_centres()) * 4;
        let pad = 2 * self.settings.nt;
        let fit = max.saturating_sub(pad) / 1000 * 1000;
        Err(DetectError::Device {
            message: format!(
                "a window of {n_sites} channels × {n_t} samples needs a {:.0} MB buffer, but {} allows at most {:.0} MB per buffer; use --batch-size {fit} or less, or --backend cpu",
                (per_sample * n_t) as f64 / 1e6,
                self.device_name,
                self.client.properties().memory.max_page_size as f64 / 1e6
            ),
        })
    }

    /// The device's name, as its driver reports it.
    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    /// The options in use.
    pub fn options(&self) -> GpuOptions {
        self.options
    }

    /// The high-pass the device preprocessing runs, for logs: `iir-f64`,
    /// `iir-f32`, `direct`, or `none` before [`GpuDetector::set_preprocessing`].
    pub fn highpass_form(&self) -> &'static str {
        match &self.pre {
            None => "none",
            Some(DevicePre { iir: Some(i), .. }) => i.name(),
            Some(_) => "direct",
        }
    }

    /// Device memory in use by CubeCL's pools, bytes (None when the runtime does not say).
    pub fn memory_in_use(&self) -> Option<u64> {
        self.client.memory_usage().ok().map(|m| m.bytes_reserved)
    }

    /// Detects spikes in one whitened window `x` (C sites × NT samples, float32),
    /// exactly as [`crate::detect::cpu::CpuDetector::detect`] does.
    ///
    /// # Errors
    /// As the CPU detector for bad input; [`DetectError::Device`] when the device fails.
    pub fn detect(&mut self, x: ArrayView2<f32>, yc: &[f32]) -> Result<Detections, DetectError> {
        self.run(x, yc, None)
    }

    /// As [`GpuDetector::detect`], with a device sync after each step to time it.
    ///
    /// # Errors
    /// As [`GpuDetector::detect`].
    pub fn detect_timed(
        &mut self,
        x: ArrayView2<f32>,
        yc: &[f32],
    ) -> Result<(Detections, StepTimes), DetectError> {
        let mut times = StepTimes::default();
        let d = self.run(x, yc, Some(&mut times))?;
        Ok((d, times))
    }

    /// Steps 1–2 only, densely (every centre and sample), returning As (Nf × NT)
    /// and imaxs (Nf × NT) and the dense neighbour max before edge zeroing:
    /// for comparison with [`crate::detect::cpu::CpuDetector::intermediates`].
    ///
    /// # Errors
    /// As [`GpuDetector::detect`].
    pub fn intermediates(
        &mut self,
        x: ArrayView2<f32>,
        yc: &[f32],
    ) -> Result<DenseArrays, DetectError> {
        let saved = self.options;
        self.options = GpuOptions {
            pruned: false,
            sparse_peaks: false,
            ..saved
        };
        let r = (|| {
            cpu::check_window(&self.geometry, &self.settings, x, yc)?;
            self.check_size(x.nrows(), x.ncols())?;
            self.upload_window(x, yc);
            self.steps_1_to_3(true);
            let w = self.window.as_ref().expect("allocated");
            let out = self.client.read(vec![
                w.as_.clone(),
                w.imax.clone(),
                w.amax
                    .clone()
                    .expect("allocated for the dense neighbour max"),
            ]);
            Ok((
                f32::from_bytes(&out[0]).to_vec(),
                i32::from_bytes(&out[1]).to_vec(),
                f32::from_bytes(&out[2]).to_vec(),
            ))
        })();
        self.options = saved;
        r
    }

    /// With `SPIKECUBE_PREPROCESS_PROFILE` set: waits for the device and books
    /// the seconds since the last mark to preprocessing kernel `kernel`
    /// (`None` restarts the clock; the whitening's mark ends a window).
    fn pre_mark(&self, kernel: Option<usize>) {
        let Some(p) = &self.pre_profile else {
            return;
        };
        let _ = cubecl::future::block_on(self.client.sync());
        let now = Instant::now();
        if let Ok(mut p) = p.lock() {
            if let Some(k) = kernel {
                let d = now.duration_since(p.last).as_secs_f64();
                p.seconds[k] += d;
                if k == 3 {
                    p.windows += 1;
                }
            }
            p.last = now;
        }
    }

    fn sync(&self) -> Result<(), DetectError> {
        cubecl::future::block_on(self.client.sync()).map_err(|e| DetectError::Device {
            message: format!("{} failed: {e:?}", self.device_name),
        })
    }

    fn upload_window(&mut self, x: ArrayView2<f32>, yc: &[f32]) {
        let (c, n_t) = x.dim();
        self.ensure_window(c, n_t, yc);
        let x = x.as_standard_layout();
        let xs = x.as_slice().expect("standard layout");
        let chunk = self.options.upload_chunk;
        if chunk == 0 {
            self.x = Some(self.client.create_from_slice(bytes_f32(xs)));
            return;
        }
        let dst = self.window.as_ref().expect("allocated").x.clone();
        for (i, part) in xs.chunks(chunk).enumerate() {
            let src = self.client.create_from_slice(bytes_f32(part));
            // SAFETY: the kernel writes dst[offset + i] for i < len = part.len(), and
            // offset + len ≤ xs.len(), the length of dst.
            unsafe {
                upload::copy_chunk_kernel::launch_unchecked::<R>(
                    &self.client,
                    CubeCount::Static(part.len().div_ceil(256) as u32, 1, 1),
                    CubeDim::new_1d(256),
                    ArrayArg::from_raw_parts(src, part.len()),
                    ArrayArg::from_raw_parts(dst.clone(), xs.len()),
                    (i * chunk) as u32,
                    part.len() as u32,
                );
            }
        }
        self.x = Some(dst);
    }

    /// Puts the raw window's bytes on the device: straight into the persistent
    /// raw buffer with the direct copy when there is one and the bytes are
    /// page-locked, else in 4 MiB pieces through CubeCL (whose `create` copies
    /// its input once more on the host) and a copy kernel into that buffer.
    fn raw_to_device(
        &mut self,
        data: cubecl::bytes::Bytes,
        pinned: bool,
    ) -> Result<Handle, DetectError> {
        let len = data.len();
        if self.raw_buf.as_ref().map(|(n, _)| *n) != Some(len) {
            self.raw_buf = None;
            self.raw_buf = Some((len, self.persistent(|client| client.empty(len.max(4)))));
        }
        let dst = self.raw_buf.as_ref().expect("allocated").1.clone();
        if pinned && let Some(copy) = self.direct.as_ref() {
            // The previous window's kernels may still read the buffer.
            self.sync()?;
            let copy = copy.as_ref();
            if copy(&self.client, dst.clone(), &data) {
                return Ok(dst);
            }
        }
        let words: &[u8] = &data;
        let chunk = upload::CHUNK * 4;
        for (i, part) in words.chunks(chunk).enumerate() {
            let src = self.client.create_from_slice(part);
            // SAFETY: the kernel writes dst[offset + i] for i < len = part words,
            // and offset + len ≤ the buffer's words.
            unsafe {
                upload::copy_words_kernel::launch_unchecked::<R>(
                    &self.client,
                    CubeCount::Static((part.len() / 4).div_ceil(256) as u32, 1, 1),
                    CubeDim::new_1d(256),
                    ArrayArg::from_raw_parts(src, part.len() / 4),
                    ArrayArg::from_raw_parts(dst.clone(), len / 4),
                    (i * chunk / 4) as u32,
                    (part.len() / 4) as u32,
                );
            }
        }
        Ok(dst)
    }

    /// Runs `alloc` with CubeCL's persistent allocation mode: buffers of exactly
    /// the asked size instead of slices of the pools' pages (which held 3–4 GB
    /// for our 1.3 GB of window buffers on the H200, docs/benchmarks-history.md).
    fn persistent<T: Send>(&self, alloc: impl Fn(&ComputeClient<R>) -> T + Send + Sync) -> T {
        match self
            .client
            .memory_persistent_allocation(&self.client, &alloc)
        {
            Ok(t) => t,
            Err(_) => alloc(&self.client),
        }
    }

    /// Allocates the per-window buffers for C × `n_t` (kept while the size stays)
    /// and uploads the site positions when they change.
    fn ensure_window(&mut self, c: usize, n_t: usize, yc: &[f32]) {
        let nf = self.geometry.n_centres();
        if self.window.as_ref().map(|w| w.n_t) != Some(n_t) {
            // Free the old buffers before the new ones are taken.
            self.window = None;
            self.window = Some(self.persistent(|client| {
                let f = |n: usize| client.empty(n * 4);
                WindowBuffers {
                    n_t,
                    x: f(c * n_t),
                    b: f(c * NK * n_t),
                    q: f(c * n_t),
                    as_: f(nf * n_t),
                    imax: f(nf * n_t),
                    amax: None,
                }
            }));
        }
        if !self.options.sparse_peaks {
            let w = self.window.as_mut().expect("allocated");
            if w.amax.is_none() {
                w.amax = Some(self.client.empty(nf * n_t * 4));
            }
        }
        if self.yc.as_ref().map(|(v, _)| v.as_slice()) != Some(yc) {
            self.yc = Some((yc.to_vec(), self.client.create_from_slice(bytes_f32(yc))));
        }
    }

    fn ensure_peaks(&mut self, cap: usize) {
        if self.peaks.as_ref().is_some_and(|p| p.cap >= cap) {
            return;
        }
        let nc = self.geometry.n_chans();
        let npc = self.settings.n_pcs;
        let f = |n: usize| self.client.empty(n.max(1) * 4);
        self.peaks = Some(PeakBuffers {
            cap,
            peak_j: f(cap),
            peak_t: f(cap),
            amp: f(cap),
            code: f(cap),
            adist: f(cap * nc),
            yct: f(cap),
            tf: f(cap * nc * npc),
        });
    }

    /// Steps 1–3 (3 only when dense peaks are asked for, or `force_dense_max`).
    fn steps_1_to_3(&mut self, force_dense_max: bool) {
        self.launch_step(Step::FilterBank);
        self.launch_step(Step::CentreResponse);
        if force_dense_max || !self.options.sparse_peaks {
            self.launch_step(Step::NeighbourMax);
        }
    }

    fn launch_step(&mut self, step: Step) {
        match step {
            Step::FilterBank => self.launch_filter_bank(),
            Step::CentreResponse => self.launch_centre_response(),
            Step::NeighbourMax => self.launch_neighbour_max(),
            Step::LocalPeaks => self.launch_peaks(),
            Step::Features => self.launch_features(),
        }
    }

    fn launch_filter_bank(&self) {
        let w = self.window.as_ref().expect("allocated");
        let x = self.x.as_ref().expect("uploaded");
        let n_t = w.n_t;
        let n_ch = self.yc.as_ref().expect("uploaded").0.len();
        let ntaps = self.settings.nt;
        let arr = |h: &Handle, len: usize| unsafe { ArrayArg::from_raw_parts(h.clone(), len) };
        let per_unit = self.options.fb_per_unit.max(1);
        // SAFETY: every index the kernel computes is within the lengths passed
        // (shapes fixed by the geometry and the window; checked by tests/gpu.rs
        // against the bounds-checked CPU twin on odd sizes).
        unsafe {
            filter_bank::filter_bank_kernel::launch_unchecked::<R>(
                &self.client,
                CubeCount::Static(
                    n_t.div_ceil(filter_bank::UNITS * per_unit) as u32,
                    n_ch as u32,
                    1,
                ),
                CubeDim::new_1d(filter_bank::UNITS as u32),
                arr(x, n_ch * n_t),
                arr(&self.wtemp, NK * ntaps),
                arr(&w.b, n_ch * NK * n_t),
                arr(&w.q, n_ch * n_t),
                n_t as u32,
                exact::NEG_ZERO,
                NK,
                ntaps,
                filter_bank::UNITS,
                per_unit,
            );
        }
    }

    fn launch_centre_response(&self) {
        let w = self.window.as_ref().expect("allocated");
        let n_t = w.n_t;
        let n_ch = self.yc.as_ref().expect("uploaded").0.len();
        let nf = self.geometry.n_centres();
        let nc = self.geometry.n_chans();
        let nsz = self.geometry.n_sizes();
        let th = self.settings.th_universal;
        let arr = |h: &Handle, len: usize| unsafe { ArrayArg::from_raw_parts(h.clone(), len) };
        // SAFETY: every index the kernel computes is within the lengths passed
        // (shapes fixed by the geometry and the window; checked by tests/gpu.rs
        // against the bounds-checked CPU twin on odd sizes).
        unsafe {
            centre_response::centre_response_kernel::launch_unchecked::<R>(
                &self.client,
                CubeCount::Static(nf as u32, n_t.div_ceil(centre_response::TILE) as u32, 1),
                CubeDim::new_1d(centre_response::TILE as u32),
                arr(&w.b, n_ch * NK * n_t),
                arr(&w.q, n_ch * n_t),
                arr(&self.sites, nf * nc),
                arr(&self.weights, nf * nc * nsz),
                arr(&self.weight_norm2, nf),
                arr(&w.as_, nf * n_t),
                arr(&w.imax, nf * n_t),
                n_t as u32,
                th * th,
                exact::NEG_ZERO,
                nc,
                nsz,
                NK,
                self.options.pruned,
            );
        }
    }

    fn launch_neighbour_max(&self) {
        let w = self.window.as_ref().expect("allocated");
        let n_t = w.n_t;
        let nf = self.geometry.n_centres();
        let nc2 = self.geometry.n_neighbours();
        let arr = |h: &Handle, len: usize| unsafe { ArrayArg::from_raw_parts(h.clone(), len) };
        let bl = &self.blocks;
        // SAFETY: every index the kernel computes is within the lengths passed
        // (shapes fixed by the geometry and the window; checked by tests/gpu.rs
        // against the bounds-checked CPU twin on odd sizes).
        unsafe {
            neighbour_max::neighbour_max_kernel::launch_unchecked::<R>(
                &self.client,
                CubeCount::Static(bl.n_blocks() as u32, n_t.div_ceil(bl.tile) as u32, 1),
                CubeDim::new_2d(bl.tile as u32, bl.per_block as u32),
                arr(&w.as_, nf * n_t),
                arr(&self.block_offsets, bl.offsets.len()),
                arr(&self.block_rows, bl.rows.len()),
                arr(&self.block_local, bl.local.len()),
                arr(
                    w.amax
                        .as_ref()
                        .expect("allocated for the dense neighbour max"),
                    nf * n_t,
                ),
                n_t as u32,
                nf as u32,
                nc2 as u32,
                bl.max_union,
                bl.tile,
                bl.per_block,
            );
        }
    }

    /// Times the raw-window path of [`GpuDetector::detect_raw`] over `reps`
    /// windows from `make_raw` (with a sync after each part): seconds per window
    /// for packing (`make_raw`, host), upload, and the device preprocessing up to
    /// and including each of its four kernels (means, CAR, high-pass, whitening:
    /// cumulative).
    ///
    /// # Errors
    /// As [`GpuDetector::detect_raw`].
    pub fn profile_raw(
        &mut self,
        make_raw: &mut dyn FnMut() -> RawWindow,
        yc: &[f32],
        reps: usize,
    ) -> Result<[f64; 6], DetectError> {
        let mut out = [0f64; 6];
        for k in 1..=4 {
            for _ in 0..reps.max(1) {
                let t0 = Instant::now();
                let raw = make_raw();
                let t1 = Instant::now();
                let pre = self.upload_raw(raw, yc, true, k)?;
                let total = t1.elapsed().as_secs_f64();
                out[0] += (t1 - t0).as_secs_f64();
                out[1] += total - pre;
                out[1 + k] += pre;
            }
        }
        out[0] /= (4 * reps.max(1)) as f64;
        out[1] /= (4 * reps.max(1)) as f64;
        for v in &mut out[2..] {
            *v /= reps.max(1) as f64;
        }
        Ok(out)
    }

    /// Times each step on the window last given to [`GpuDetector::detect`] (or `x`):
    /// each step launched `reps` times back to back with one device sync at the end
    /// (seconds per launch), the upload likewise, and all five steps together
    /// without syncs in between (`total`). Launch overheads are included; the host's
    /// sync latency is spread over `reps` launches.
    ///
    /// # Errors
    /// As [`GpuDetector::detect`].
    pub fn profile(
        &mut self,
        x: ArrayView2<f32>,
        yc: &[f32],
        reps: usize,
    ) -> Result<(StepTimes, f64), DetectError> {
        let reps = reps.max(1);
        self.detect(x, yc)?;
        self.sync()?;
        let per = |me: &mut Self, f: &mut dyn FnMut(&mut Self)| -> Result<f64, DetectError> {
            me.sync()?;
            let t = Instant::now();
            for _ in 0..reps {
                f(me);
            }
            me.sync()?;
            Ok(t.elapsed().as_secs_f64() / reps as f64)
        };
        let upload = per(self, &mut |me| me.upload_window(x, yc))?;
        let fb = per(self, &mut |me| me.launch_step(Step::FilterBank))?;
        let cr = per(self, &mut |me| me.launch_step(Step::CentreResponse))?;
        let nm = if self.options.sparse_peaks {
            0.0
        } else {
            per(self, &mut |me| me.launch_step(Step::NeighbourMax))?
        };
        let lp = per(self, &mut |me| me.launch_step(Step::LocalPeaks))?;
        let ft = per(self, &mut |me| me.launch_step(Step::Features))?;
        let total = per(self, &mut |me| {
            me.steps_1_to_3(false);
            me.launch_step(Step::LocalPeaks);
            me.launch_step(Step::Features);
        })?;
        let t = Instant::now();
        let (n, _) = self.download()?;
        let download = t.elapsed().as_secs_f64();
        debug_assert!(n <= self.peaks.as_ref().map_or(0, |p| p.cap));
        Ok((
            StepTimes {
                upload,
                preprocess: 0.0,
                filter_bank: fb,
                centre_response: cr,
                neighbour_max: nm,
                local_peaks: lp,
                features: ft,
                download,
            },
            total,
        ))
    }

    fn run(
        &mut self,
        x: ArrayView2<f32>,
        yc: &[f32],
        times: Option<&mut StepTimes>,
    ) -> Result<Detections, DetectError> {
        cpu::check_window(&self.geometry, &self.settings, x, yc)?;
        self.check_size(x.nrows(), x.ncols())?;
        let clock = Instant::now();
        self.upload_window(x, yc);
        self.run_uploaded(yc, times, clock)
    }

    /// Steps 1–5 on the window in `self.x`; `clock` started before its upload.
    fn run_uploaded(
        &mut self,
        _yc: &[f32],
        mut times: Option<&mut StepTimes>,
        clock: Instant,
    ) -> Result<Detections, DetectError> {
        let timed = times.is_some();
        if timed {
            self.sync()?;
        }
        let upload = clock.elapsed().as_secs_f64();
        let mut t3 = [0f64; 3];
        for (i, step) in [Step::FilterBank, Step::CentreResponse, Step::NeighbourMax]
            .into_iter()
            .enumerate()
        {
            if step == Step::NeighbourMax && self.options.sparse_peaks {
                continue;
            }
            let clock = Instant::now();
            self.launch_step(step);
            if timed {
                self.sync()?;
                t3[i] = clock.elapsed().as_secs_f64();
            }
        }
        let mut cap = self.peaks.as_ref().map_or(4096, |p| p.cap);
        loop {
            self.ensure_peaks(cap);
            let clock = Instant::now();
            self.launch_peaks();
            if timed {
                self.sync()?;
            }
            let t_peaks = clock.elapsed().as_secs_f64();
            let clock = Instant::now();
            self.launch_features();
            if timed {
                self.sync()?;
            }
            let t_features = clock.elapsed().as_secs_f64();
            let clock = Instant::now();
            let (n, det) = self.download()?;
            if n > cap {
                cap = n.next_power_of_two();
                continue;
            }
            if let Some(t) = times.as_deref_mut() {
                *t = StepTimes {
                    upload,
                    preprocess: 0.0,
                    filter_bank: t3[0],
                    centre_response: t3[1],
                    neighbour_max: t3[2],
                    local_peaks: t_peaks,
                    features: t_features,
                    download: clock.elapsed().as_secs_f64(),
                };
            }
            return Ok(det);
        }
    }

    fn launch_peaks(&mut self) {
        if let Some(old) = self.count.take() {
            drop(old);
        }
        let w = self.window.as_ref().expect("allocated");
        let p = self.peaks.as_ref().expect("allocated");
        let n_t = w.n_t;
        let nf = self.geometry.n_centres();
        let nc2 = self.geometry.n_neighbours();
        let client = &self.client;
        let arr = |h: &Handle, len: usize| unsafe { ArrayArg::from_raw_parts(h.clone(), len) };
        let count = client.create_from_slice(bytes_u32(&[0]));
        let nt = self.settings.nt as u32;
        let half = self.settings.nt0min() as u32;
        let th = self.settings.th_universal;
        let grid = CubeCount::Static(nf as u32, n_t.div_ceil(local_peaks::TILE) as u32, 1);
        let dim = CubeDim::new_1d(local_peaks::TILE as u32);
        if self.options.sparse_peaks {
            // SAFETY: every index the kernel computes is within the lengths passed
            // (shapes fixed by the geometry and the window; checked by tests/gpu.rs
            // against the bounds-checked CPU twin on odd sizes).
            unsafe {
                local_peaks::local_peaks_sparse_kernel::launch_unchecked::<R>(
                    client,
                    grid,
                    dim,
                    arr(&w.as_, nf * n_t),
                    arr(&self.neighbours, nf * nc2),
                    arr(&count, 1),
                    arr(&p.peak_j, p.cap),
                    arr(&p.peak_t, p.cap),
                    n_t as u32,
                    nc2 as u32,
                    nt,
                    half,
                    th,
                    p.cap as u32,
                );
            }
        } else {
            // SAFETY: every index the kernel computes is within the lengths passed
            // (shapes fixed by the geometry and the window; checked by tests/gpu.rs
            // against the bounds-checked CPU twin on odd sizes).
            unsafe {
                local_peaks::local_peaks_kernel::launch_unchecked::<R>(
                    client,
                    grid,
                    dim,
                    arr(&w.as_, nf * n_t),
                    arr(
                        w.amax
                            .as_ref()
                            .expect("allocated for the dense neighbour max"),
                        nf * n_t,
                    ),
                    arr(&count, 1),
                    arr(&p.peak_j, p.cap),
                    arr(&p.peak_t, p.cap),
                    n_t as u32,
                    nt,
                    half,
                    th,
                    p.cap as u32,
                );
            }
        }
        self.count = Some(count);
    }

    fn launch_features(&mut self) {
        let w = self.window.as_ref().expect("allocated");
        let p = self.peaks.as_ref().expect("allocated");
        let x = self.x.as_ref().expect("uploaded");
        let (ycv, yc) = self.yc.as_ref().expect("uploaded");
        let count = self.count.as_ref().expect("launched");
        let n_t = w.n_t;
        let n_ch = ycv.len();
        let nf = self.geometry.n_centres();
        let nc = self.geometry.n_chans();
        let npc = self.settings.n_pcs;
        let ntaps = self.settings.nt;
        let client = &self.client;
        let arr = |h: &Handle, len: usize| unsafe { ArrayArg::from_raw_parts(h.clone(), len) };
        const UNITS: usize = 128;
        // SAFETY: every index the kernel computes is within the lengths passed
        // (shapes fixed by the geometry and the window; checked by tests/gpu.rs
        // against the bounds-checked CPU twin on odd sizes).
        unsafe {
            features::features_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static((p.cap * nc).div_ceil(UNITS) as u32, 1, 1),
                CubeDim::new_1d(UNITS as u32),
                arr(x, n_ch * n_t),
                arr(&w.b, n_ch * NK * n_t),
                arr(&w.as_, nf * n_t),
                arr(&w.imax, nf * n_t),
                arr(&self.sites, nf * nc),
                arr(yc, n_ch),
                arr(&self.wpca, npc * ntaps),
                arr(count, 1),
                arr(&p.peak_j, p.cap),
                arr(&p.peak_t, p.cap),
                arr(&p.amp, p.cap),
                arr(&p.code, p.cap),
                arr(&p.adist, p.cap * nc),
                arr(&p.yct, p.cap),
                arr(&p.tf, p.cap * nc * npc),
                n_t as u32,
                p.cap as u32,
                exact::NEG_ZERO,
                nc,
                NK,
                npc,
                ntaps,
            );
        }
    }

    /// The one download of a window: the count and every detection's outputs,
    /// sorted into Kilosort4's (centre, sample) order. Returns the count found on
    /// the device (more than the capacity means the buffers must grow).
    fn download(&mut self) -> Result<(usize, Detections), DetectError> {
        let cap = self.peaks.as_ref().expect("allocated").cap;
        let read = self.start_download();
        self.finish_download(read, cap)
    }

    /// Queues the copies of the count and the peak buffers to the host on the
    /// device's stream, after the kernels queued before.
    fn start_download(&mut self) -> ReadFuture {
        // CubeCL 0.10's `read_async` queues the copies when called, but its
        // future borrows the client (by its signature, not in fact): a client
        // kept for the program's life lets the future outlive this call.
        if self.client_for_reads.is_none() {
            self.client_for_reads = Some(Box::leak(Box::new(self.client.clone())));
        }
        let client: &'static ComputeClient<R> = self.client_for_reads.expect("set above");
        let p = self.peaks.as_ref().expect("allocated");
        let count = self.count.take().expect("launched");
        Box::pin(client.read_async(vec![
            count,
            p.peak_j.clone(),
            p.peak_t.clone(),
            p.amp.clone(),
            p.code.clone(),
            p.adist.clone(),
            p.yct.clone(),
            p.tf.clone(),
        ]))
    }

    /// Waits for a download queued by [`GpuDetector::start_download`] when the
    /// peak buffers held `cap` detections, and sorts the detections.
    fn finish_download(
        &mut self,
        read: ReadFuture,
        cap: usize,
    ) -> Result<(usize, Detections), DetectError> {
        let waiting = Instant::now();
        let out = cubecl::future::block_on(read).map_err(|e| DetectError::Device {
            message: format!("{} failed: {e:?}", self.device_name),
        })?;
        self.wait_s += waiting.elapsed().as_secs_f64();
        let n = u32::from_bytes(&out[0])[0] as usize;
        let nc = self.geometry.n_chans();
        let npc = self.settings.n_pcs;
        let mut d = Detections {
            n_chans: nc,
            n_pcs: npc,
            ..Detections::default()
        };
        if n > cap {
            return Ok((n, d));
        }
        let pj = u32::from_bytes(&out[1]);
        let pt = u32::from_bytes(&out[2]);
        let amp = f32::from_bytes(&out[3]);
        let code = i32::from_bytes(&out[4]);
        let adist = f32::from_bytes(&out[5]);
        let yct = f32::from_bytes(&out[6]);
        let tf = f32::from_bytes(&out[7]);
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_unstable_by_key(|&i| (pj[i], pt[i]));
        for i in order {
            d.centre.push(pj[i]);
            d.sample.push(pt[i] as u64);
            d.amp.push(amp[i]);
            d.imax.push((code[i].unsigned_abs() - 1) as u8);
            d.sign.push(code[i].signum() as i8);
            d.adist.extend_from_slice(&adist[i * nc..(i + 1) * nc]);
            d.yct.push(yct[i]);
            d.tf.extend_from_slice(&tf[i * nc * npc..(i + 1) * nc * npc]);
        }
        Ok((n, d))
    }
}
