//! Products that no device compiler fuses, so that every kernel rounds as its
//! CPU twin does.
//!
//! NVRTC compiles CubeCL's CUDA source with `--fmad=true` (CubeCL 0.10 passes
//! no option to turn it off) and so contracts `c + a·b` into one fused
//! multiply-add, rounding once where the CPU twin rounds twice; other Vulkan
//! drivers may do the same, Mesa's lavapipe does not. The kernels therefore
//! write each product whose value is then added as [`product`]: the fused
//! multiply-add of a, b and −0.0 given at run time. That is a·b rounded once
//! to the float type (also its sign when a·b is zero: +0 + −0 = +0), and since
//! the compiler does not know the third operand it can neither turn it back
//! into a multiply nor fuse it with the add that follows. The launches pass
//! [`NEG_ZERO`] (and [`NEG_ZERO_F64`] for the f64 high-pass) for `nz`.
//!
//! Where Mesa evaluates `fma` as a multiply then an add (lavapipe does), the
//! result is the same: a·b rounded, then −0.0 added, which changes no value.

use cubecl::prelude::*;

/// The −0.0 the launches pass as `nz` to [`product`].
pub const NEG_ZERO: f32 = -0.0;
/// The −0.0 the f64 launches pass as `nz` to [`product`].
pub const NEG_ZERO_F64: f64 = -0.0;

/// a·b rounded once to `F`, in a form no compiler fuses into a following add
/// or subtract; `nz` must be −0.0 passed at run time ([`NEG_ZERO`]).
#[cube]
pub(crate) fn product<F: Float>(a: F, b: F, nz: F) -> F {
    fma(a, b, nz)
}
