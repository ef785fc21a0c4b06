//! Page-locked (pinned) host buffers for uploads to an NVIDIA GPU.
//!
//! A copy from ordinary (pageable) memory goes through the driver's own staging
//! buffers and blocks the host; from page-locked memory the GPU's copy engine
//! reads it directly, at the bus's full speed. CubeCL 0.10 copies a [`Bytes`]
//! marked [`AllocationProperty::Pinned`] straight from its memory, so the raw
//! window is written into such a buffer once (by [`super::RawWindow::pack`]) and
//! handed over without another copy. The buffers come from the CUDA driver
//! (`cuMemHostAlloc`, portable across contexts) and return to this pool when
//! CubeCL drops the [`Bytes`], after the copy has completed.

use std::ffi::{c_int, c_uint, c_void};
use std::mem::MaybeUninit;
use std::sync::{Arc, Condvar, Mutex};

use cubecl::bytes::{AllocationController, AllocationProperty, Bytes};

type CuInit = unsafe extern "C" fn(c_uint) -> c_int;
type CuDeviceGet = unsafe extern "C" fn(*mut c_int, c_int) -> c_int;
type CuPrimaryCtxRetain = unsafe extern "C" fn(*mut *mut c_void, c_int) -> c_int;
type CuCtxSetCurrent = unsafe extern "C" fn(*mut c_void) -> c_int;
type CuMemHostAlloc = unsafe extern "C" fn(*mut *mut c_void, usize, c_uint) -> c_int;
type CuMemFreeHost = unsafe extern "C" fn(*mut c_void) -> c_int;
type CuMemcpyHtoD = unsafe extern "C" fn(u64, *const c_void, usize) -> c_int;
type CuMemcpyHtoDAsync = unsafe extern "C" fn(u64, *const c_void, usize, *mut c_void) -> c_int;
type CuStreamCreate = unsafe extern "C" fn(*mut *mut c_void, c_uint) -> c_int;
type CuStreamSynchronize = unsafe extern "C" fn(*mut c_void) -> c_int;
type CuStreamDestroy = unsafe extern "C" fn(*mut c_void) -> c_int;

/// `CU_STREAM_NON_BLOCKING`: no implicit ordering with the default stream.
const NON_BLOCKING: c_uint = 1;

/// `CU_MEMHOSTALLOC_PORTABLE`: pinned for every CUDA context.
const PORTABLE: c_uint = 1;

/// One page-locked allocation.
struct Block {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a Block owns its allocation; it is only reached through one owner at a time.
unsafe impl Send for Block {}

struct Shared {
    free: Mutex<Blocks>,
    lib: libloading::Library,
    ctx: *mut c_void,
}

/// The pool's blocks: those free now, and counts of every block it made.
#[derive(Default)]
struct Blocks {
    free: Vec<Block>,
    /// Blocks made (or being made) so far, free or in use: what
    /// [`PinnedPool::reserve`] tops up to.
    made: usize,
    stats: PoolStats,
}

/// What a [`PinnedPool`] allocated, for `spikecube.json`'s timings.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PoolStats {
    /// Blocks allocated ahead by [`PinnedPool::reserve`].
    pub reserved: usize,
    /// Seconds [`PinnedPool::reserve`] spent allocating them (on its own thread).
    pub reserve_s: f64,
    /// Blocks allocated when a buffer was asked for and none was free (on
    /// the asking thread).
    pub on_demand: usize,
    /// Seconds spent in those allocations.
    pub on_demand_s: f64,
}

// SAFETY: the context handle is only passed to the driver, which is thread-safe;
// the free list is behind a mutex.
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

impl Shared {
    fn set_current(&self) -> bool {
        // SAFETY: the symbol has the driver API's signature; ctx is the primary
        // context retained in `PinnedPool::new`.
        unsafe {
            self.lib
                .get::<CuCtxSetCurrent>(b"cuCtxSetCurrent\0")
                .is_ok_and(|f| f(self.ctx) == 0)
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        let blocks =
            std::mem::take(&mut self.free.get_mut().unwrap_or_else(|e| e.into_inner()).free);
        if blocks.is_empty() || !self.set_current() {
            return;
        }
        // SAFETY: every block came from cuMemHostAlloc and is no longer used.
        unsafe {
            if let Ok(free) = self.lib.get::<CuMemFreeHost>(b"cuMemFreeHost\0") {
                for b in blocks {
                    free(b.ptr.cast());
                }
            }
        }
    }
}

/// A pool of page-locked buffers of one size on GPU 0.
#[derive(Clone)]
pub struct PinnedPool {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for PinnedPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedPool").finish_non_exhaustive()
    }
}

impl PinnedPool {
    /// Opens the driver and GPU 0's primary context (the one CubeCL uses).
    /// `None` when the driver cannot be loaded or answers with an error.
    pub fn new() -> Option<PinnedPool> {
        // SAFETY: loading the driver library runs its initialisers, which have no
        // preconditions; the symbols have the driver API's C signatures.
        unsafe {
            let lib = libloading::Library::new("libcuda.so.1")
                .or_else(|_| libloading::Library::new("libcuda.so"))
                .ok()?;
            let init = lib.get::<CuInit>(b"cuInit\0").ok()?;
            let get = lib.get::<CuDeviceGet>(b"cuDeviceGet\0").ok()?;
            let retain = lib
                .get::<CuPrimaryCtxRetain>(b"cuDevicePrimaryCtxRetain\0")
                .ok()?;
            if init(0) != 0 {
                return None;
            }
            let mut dev: c_int = 0;
            if get(&mut dev, 0) != 0 {
                return None;
            }
            let mut ctx: *mut c_void = std::ptr::null_mut();
            if retain(&mut ctx, dev) != 0 {
                return None;
            }
            Some(PinnedPool {
                shared: Arc::new(Shared {
                    free: Mutex::new(Blocks::default()),
                    lib,
                    ctx,
                }),
            })
        }
    }

    /// Copies `src` to device address `dst` (synchronously: the copy has
    /// completed when this returns). Returns false when the driver refuses.
    ///
    /// # Safety
    /// `dst` must be a device allocation of GPU 0 with at least `src.len()`
    /// bytes that no kernel uses during the copy.
    pub unsafe fn copy_to_device(&self, dst: u64, src: &[u8]) -> bool {
        if !self.shared.set_current() {
            return false;
        }
        // SAFETY: the symbol has the driver API's signature; the caller vouches
        // for dst; src is a valid host slice.
        unsafe {
            self.shared
                .lib
                .get::<CuMemcpyHtoD>(b"cuMemcpyHtoD_v2\0")
                .is_ok_and(|f| f(dst, src.as_ptr().cast(), src.len()) == 0)
        }
    }

    /// A page-locked buffer of `len` bytes, reused from the pool when one is
    /// large enough (a block of [`PinnedPool::reserve`], or one an earlier
    /// window gave back), else allocated now; `None` when the driver refuses
    /// the allocation.
    ///
    /// Its bytes are unspecified (an earlier window's, or whatever the driver's
    /// new memory holds): the caller writes every byte it lets be read. Every
    /// use does: [`super::Packer::pack`] writes every word of the window, and
    /// an int16 read ([`crate::recording::read_window_i16`]) writes every
    /// value of every row, row padding included. So new blocks are not zeroed
    /// (46 MB each for a 384-channel window: a few ms per block at start-up).
    pub fn take(&self, len: usize) -> Option<Bytes> {
        let reused = {
            let mut blocks = self.shared.free.lock().ok()?;
            let found = blocks
                .free
                .iter()
                .position(|b| b.len >= len)
                .map(|i| blocks.free.swap_remove(i));
            if found.is_none() {
                // Counted before the allocation, so that a reservation running
                // beside this does not add a block for it too.
                blocks.made += 1;
            }
            found
        };
        let block = match reused {
            Some(b) => b,
            None => {
                let t = std::time::Instant::now();
                let made = self.alloc(len);
                let mut blocks = self.shared.free.lock().ok()?;
                match made {
                    Some(b) => {
                        blocks.stats.on_demand += 1;
                        blocks.stats.on_demand_s += t.elapsed().as_secs_f64();
                        b
                    }
                    None => {
                        blocks.made -= 1;
                        return None;
                    }
                }
            }
        };
        let controller = Controller {
            block: Some(block),
            shared: self.shared.clone(),
        };
        // SAFETY: the block holds at least `len` bytes that the process may
        // read (memory from the driver, or written by an earlier window); what
        // they hold is unspecified until the caller writes them (see above).
        Some(unsafe { Bytes::from_controller(Box::new(controller), len) })
    }

    /// One new page-locked block of `len` bytes (not zeroed: see
    /// [`PinnedPool::take`]); `None` when the driver refuses.
    fn alloc(&self, len: usize) -> Option<Block> {
        if !self.shared.set_current() {
            return None;
        }
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: the symbol has the driver API's signature; the context is current.
        let rc = unsafe {
            let alloc = self
                .shared
                .lib
                .get::<CuMemHostAlloc>(b"cuMemHostAlloc\0")
                .ok()?;
            alloc(&mut p, len.max(1), PORTABLE)
        };
        if rc != 0 || p.is_null() {
            return None;
        }
        Some(Block {
            ptr: p.cast(),
            len: len.max(1),
        })
    }

    /// Allocates blocks of `len` bytes until the pool has made `n` in all
    /// (counting those in use and those [`PinnedPool::take`] allocated),
    /// putting each in the free list as soon as it exists, so that a `take`
    /// running beside this gets it at once, or allocates its own (the list is
    /// locked only to count and to push, never during an allocation). Stops
    /// early when `stop` is set or the driver refuses. Returns the blocks it
    /// allocated.
    pub fn reserve(&self, n: usize, len: usize, stop: &std::sync::atomic::AtomicBool) -> usize {
        let mut done = 0;
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            {
                let Ok(mut blocks) = self.shared.free.lock() else {
                    break;
                };
                if blocks.made >= n {
                    break;
                }
                blocks.made += 1;
            }
            let t = std::time::Instant::now();
            let made = self.alloc(len);
            let Ok(mut blocks) = self.shared.free.lock() else {
                break;
            };
            match made {
                Some(b) => {
                    blocks.free.push(b);
                    blocks.stats.reserved += 1;
                    blocks.stats.reserve_s += t.elapsed().as_secs_f64();
                    done += 1;
                }
                None => {
                    blocks.made -= 1;
                    break;
                }
            }
        }
        done
    }

    /// What the pool allocated so far.
    pub fn stats(&self) -> PoolStats {
        self.shared.free.lock().map(|b| b.stats).unwrap_or_default()
    }

    /// Opens a pool ([`PinnedPool::new`]) and reserves `n` blocks of `len`
    /// bytes ([`PinnedPool::reserve`]) on a thread of its own
    /// (`spikecube-pinned`), so that a run's page-locked buffers are made
    /// while the device opens and warms up. The pool is usable as soon as it
    /// is open ([`ReservedPool::pool`]), before the reservation ends.
    pub fn open_reserving(n: usize, len: usize) -> ReservedPool {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stop_r = stop.clone();
        let spawned = std::thread::Builder::new()
            .name("spikecube-pinned".into())
            .spawn(move || {
                let pool = PinnedPool::new();
                let _ = tx.send(pool.clone());
                if let Some(p) = pool {
                    p.reserve(n, len, &stop_r);
                }
            });
        ReservedPool {
            rx: spawned.ok().map(|_| rx),
            pool: None,
            stop,
        }
    }
}

/// A pool being opened and filled on its own thread ([`PinnedPool::open_reserving`]).
/// Dropping it stops the reservation at its next block (the blocks made
/// stay with the pool, freed when its last user drops it).
pub struct ReservedPool {
    rx: Option<std::sync::mpsc::Receiver<Option<PinnedPool>>>,
    /// The pool once received.
    pool: Option<Option<PinnedPool>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
}

impl ReservedPool {
    /// The pool, once open (waits for the driver's start, not for the
    /// reservation); `None` when the driver gave none.
    pub fn pool(&mut self) -> Option<PinnedPool> {
        if self.pool.is_none() {
            let got = self.rx.take().and_then(|rx| rx.recv().ok()).flatten();
            self.pool = Some(got);
        }
        self.pool.clone().flatten()
    }
}

impl Drop for ReservedPool {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

impl std::fmt::Debug for ReservedPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReservedPool").finish_non_exhaustive()
    }
}

/// Two device buffers that windows are copied into, in turn, on a CUDA stream
/// of their own: the copy of window k + 1 runs on the GPU's copy
/// engine while its compute units work on window k, which reads the other
/// buffer. A buffer is written only after the window that used it before has
/// released it ([`SlotGuard`], dropped once its detections are downloaded).
pub struct UploadSlots {
    shared: Arc<Shared>,
    stream: *mut c_void,
    ptrs: [u64; 2],
    len: usize,
    state: Arc<SlotState>,
}

// SAFETY: the stream handle is only passed to the driver, which is
// thread-safe; the slot state is behind a mutex.
unsafe impl Send for UploadSlots {}
unsafe impl Sync for UploadSlots {}

struct SlotState {
    /// Which buffers hold a window not yet released; the next one to use.
    busy: Mutex<([bool; 2], usize)>,
    freed: Condvar,
}

/// A window's claim on one of the [`UploadSlots`]: while it lives, the buffer
/// `slot` holds that window and is not written again.
pub struct SlotGuard {
    /// Which buffer (0 or 1).
    pub slot: usize,
    state: Arc<SlotState>,
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        let mut b = self.state.busy.lock().unwrap_or_else(|e| e.into_inner());
        b.0[self.slot] = false;
        self.state.freed.notify_all();
    }
}

impl Drop for UploadSlots {
    fn drop(&mut self) {
        if self.shared.set_current() {
            // SAFETY: the stream was created by cuStreamCreate and is not used
            // after this.
            unsafe {
                if let Ok(f) = self
                    .shared
                    .lib
                    .get::<CuStreamDestroy>(b"cuStreamDestroy_v2\0")
                {
                    f(self.stream);
                }
            }
        }
    }
}

impl UploadSlots {
    /// Bytes each buffer holds.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffers hold nothing.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies `src` (page-locked, `len()` bytes) into the next buffer in turn,
    /// once the window before in that buffer has released it, and waits for
    /// the copy. `None` when the driver refuses (nothing is claimed then).
    pub fn upload(&self, src: &[u8]) -> Option<SlotGuard> {
        if src.len() != self.len {
            return None;
        }
        let slot = {
            let mut b = self.state.busy.lock().ok()?;
            let slot = b.1;
            while b.0[slot] {
                b = self.state.freed.wait(b).ok()?;
            }
            b.0[slot] = true;
            b.1 = 1 - slot;
            slot
        };
        let guard = SlotGuard {
            slot,
            state: self.state.clone(),
        };
        if !self.shared.set_current() {
            return None;
        }
        // SAFETY: ptrs[slot] is a device buffer of `len` bytes (UploadSlots
        // was made for them) that no kernel reads: the window that used it
        // released it after its kernels completed. src is valid host memory.
        let ok = unsafe {
            let copy = self
                .shared
                .lib
                .get::<CuMemcpyHtoDAsync>(b"cuMemcpyHtoDAsync_v2\0")
                .ok()?;
            let sync = self
                .shared
                .lib
                .get::<CuStreamSynchronize>(b"cuStreamSynchronize\0")
                .ok()?;
            copy(self.ptrs[slot], src.as_ptr().cast(), src.len(), self.stream) == 0
                && sync(self.stream) == 0
        };
        ok.then_some(guard)
    }
}

impl PinnedPool {
    /// [`UploadSlots`] over the device buffers at `ptrs` (each `len` bytes, of
    /// GPU 0, kept alive by the caller as long as the slots are used); `None`
    /// when the driver gives no stream.
    pub fn upload_slots(&self, ptrs: [u64; 2], len: usize) -> Option<UploadSlots> {
        if !self.shared.set_current() {
            return None;
        }
        let mut stream: *mut c_void = std::ptr::null_mut();
        // SAFETY: the symbol has the driver API's signature; the context is current.
        let rc = unsafe {
            let create = self
                .shared
                .lib
                .get::<CuStreamCreate>(b"cuStreamCreate\0")
                .ok()?;
            create(&mut stream, NON_BLOCKING)
        };
        if rc != 0 || stream.is_null() {
            return None;
        }
        Some(UploadSlots {
            shared: self.shared.clone(),
            stream,
            ptrs,
            len,
            state: Arc::new(SlotState {
                busy: Mutex::new(([false; 2], 0)),
                freed: Condvar::new(),
            }),
        })
    }
}

/// Hands a pool block to CubeCL as pinned [`Bytes`], and back to the pool on drop.
struct Controller {
    block: Option<Block>,
    shared: Arc<Shared>,
}

impl Drop for Controller {
    fn drop(&mut self) {
        if let (Some(b), Ok(mut blocks)) = (self.block.take(), self.shared.free.lock()) {
            blocks.free.push(b);
        }
    }
}

impl AllocationController for Controller {
    fn alloc_align(&self) -> usize {
        // cuMemHostAlloc returns page-aligned memory.
        4096
    }

    fn property(&self) -> AllocationProperty {
        AllocationProperty::Pinned
    }

    unsafe fn memory_mut(&mut self) -> &mut [MaybeUninit<u8>] {
        let b = self.block.as_ref().expect("held until drop");
        // SAFETY: the block is b.len bytes owned by this controller.
        unsafe { std::slice::from_raw_parts_mut(b.ptr.cast(), b.len) }
    }

    fn memory(&self) -> &[MaybeUninit<u8>] {
        let b = self.block.as_ref().expect("held until drop");
        // SAFETY: as above.
        unsafe { std::slice::from_raw_parts(b.ptr.cast(), b.len) }
    }
}
