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
use std::sync::{Arc, Mutex};

use cubecl::bytes::{AllocationController, AllocationProperty, Bytes};

type CuInit = unsafe extern "C" fn(c_uint) -> c_int;
type CuDeviceGet = unsafe extern "C" fn(*mut c_int, c_int) -> c_int;
type CuPrimaryCtxRetain = unsafe extern "C" fn(*mut *mut c_void, c_int) -> c_int;
type CuCtxSetCurrent = unsafe extern "C" fn(*mut c_void) -> c_int;
type CuMemHostAlloc = unsafe extern "C" fn(*mut *mut c_void, usize, c_uint) -> c_int;
type CuMemFreeHost = unsafe extern "C" fn(*mut c_void) -> c_int;
type CuMemcpyHtoD = unsafe extern "C" fn(u64, *const c_void, usize) -> c_int;

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
    free: Mutex<Vec<Block>>,
    lib: libloading::Library,
    ctx: *mut c_void,
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
        let blocks = std::mem::take(self.free.get_mut().unwrap_or_else(|e| e.into_inner()));
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
                    free: Mutex::new(Vec::new()),
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

    /// A page-locked buffer of `len` bytes (zeroed when new, else holding an
    /// earlier window), reused from the pool when one is large enough; `None`
    /// when the driver refuses the allocation.
    pub fn take(&self, len: usize) -> Option<Bytes> {
        let reused = {
            let mut free = self.shared.free.lock().ok()?;
            free.iter()
                .position(|b| b.len >= len)
                .map(|i| free.swap_remove(i))
        };
        let block = match reused {
            Some(b) => b,
            None => {
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
                // SAFETY: p points to len.max(1) writable bytes just allocated.
                unsafe { std::ptr::write_bytes(p.cast::<u8>(), 0, len.max(1)) };
                Block {
                    ptr: p.cast(),
                    len: len.max(1),
                }
            }
        };
        let controller = Controller {
            block: Some(block),
            shared: self.shared.clone(),
        };
        // SAFETY: the block holds at least `len` initialised bytes (zeroed at
        // allocation, or written by an earlier window).
        Some(unsafe { Bytes::from_controller(Box::new(controller), len) })
    }
}

/// Hands a pool block to CubeCL as pinned [`Bytes`], and back to the pool on drop.
struct Controller {
    block: Option<Block>,
    shared: Arc<Shared>,
}

impl Drop for Controller {
    fn drop(&mut self) {
        if let (Some(b), Ok(mut free)) = (self.block.take(), self.shared.free.lock()) {
            free.push(b);
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
